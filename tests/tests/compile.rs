//! `posternctl compile` on a broken repository: non-zero exit, every error named by file,
//! field and owner, and the previous snapshot left untouched.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use postern_e2e::{Repo, platform};

#[test]
fn compile_errors_name_file_field_and_owner() {
    let repo = Repo::new();
    platform(&repo, &[("a", "127.0.0.1:9")]);
    repo.write(
        "teams/t/routes.yaml",
        "routes:\n  - name: ok\n    public: true\n    match: { path: { value: /ok } }\n    backendRefs: [{ name: a }]\n    timeouts: { connect: 1s, response: 2s }\n",
    );
    let snap = repo.path().join("snapshot.json");
    repo.compile_ok(&snap);
    let before = std::fs::read(&snap).unwrap();

    repo.write(
        "teams/t/more.yaml",
        r#"routes:
  - name: slow
    public: true
    match: { path: { value: /slow } }
    backendRefs: [{ name: nowhere }]
    timeouts: { connect: 1s, response: 45s }
"#,
    );
    repo.write(
        "teams/u/routes.yaml",
        "routes:\n  - name: x\n    public: true\n    match: { path: { value: /ok } }\n    backendRefs: [{ name: a }]\n    timeouts: { connect: 1s, response: 2s }\n    colour: blue\n",
    );
    let out = repo.compile(&snap);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "teams/t/more.yaml: routes[0].timeouts.response: 45s is over the platform maximum of 30s (owner: t)"
        ),
        "{err}"
    );
    assert!(
        err.contains("teams/t/more.yaml: routes[0].backendRefs[0].name: unknown cluster \"nowhere\" (owner: t)"),
        "{err}"
    );
    assert!(err.contains("teams/u/routes.yaml: routes[0].colour: unknown field `colour`"), "{err}");
    assert!(err.contains("at line 7 column 5 (owner: u)"), "{err}");
    assert_eq!(std::fs::read(&snap).unwrap(), before, "a rejected change must not touch the published snapshot");
}

use postern_model::validate::{JsonLimits, ParamIn, Validation};
use postern_model::{AuthMethod, DEFAULT_MAX_BODY_BYTES, Timeouts};

use super::*;

const PLATFORM_CLUSTERS: &str = "clusters:\n  a: { endpoints: [\"127.0.0.1:9001\"] }\n  mine: { endpoints: [\"127.0.0.1:9002\"], owner: t }\n  theirs: { endpoints: [\"127.0.0.1:9003\"], owner: u }\n";
const OWNERS: &str = "owners:\n  - { host: \"*\", pathPrefix: /t, team: t }\n  - { host: \"*\", pathPrefix: /u, team: u }\n  - { host: api.example.com, pathPrefix: /t/special, team: u }\n";

const PLANS: &str = "scopes: [orders:read, orders:write]\nproducts: [orders, search]\nplans:\n  free: { products: [search], rateLimit: { rps: 10, burst: 20 } }\n  partner: { products: [orders, search] }\n";

#[test]
fn routes_are_public_or_authenticated_with_known_scopes_and_products() {
    let authed = |auth: &str| {
        format!(
            "routes:\n  - name: r\n    timeouts: {{ connect: 1s, response: 2s }}\n    backendRefs: [{{ name: a }}]\n    match: {{ path: {{ value: /t/o }} }}\n{auth}"
        )
    };
    let s =
        compile_t(&authed("    auth: { methods: [apiKey, jwt], scopes: [orders:read], product: orders }\n")).unwrap();
    let a = s.routes[0].auth.as_ref().unwrap();
    assert_eq!(a.methods, vec![AuthMethod::ApiKey, AuthMethod::Jwt]);
    assert_eq!(s.plans["partner"].products, vec!["orders", "search"]);

    let e = error_of(&authed(""));
    assert_eq!(
        e,
        "teams/t/routes.yaml: routes[0].auth: a route needs auth unless it is marked public: true (owner: t)"
    );
    let e = error_of(&authed("    auth: { methods: [jwt], scopes: [orders:delete], product: orders }\n"));
    assert!(e.contains("routes[0].auth.scopes[0]: unknown scope \"orders:delete\""), "{e}");
    let e = error_of(&authed("    auth: { methods: [jwt], product: billing }\n"));
    assert!(e.contains("routes[0].auth.product: unknown product \"billing\""), "{e}");
    let e = error_of(&authed("    auth: { methods: [], product: orders }\n"));
    assert!(e.contains("routes[0].auth.methods: name apiKey, jwt or both"), "{e}");
    let e = error_of(&route("    match: { path: { value: /t/o } }\n    auth: { methods: [jwt], product: orders }\n"));
    assert!(e.contains("routes[0].public: a public route cannot also require auth"), "{e}");
    let e = error_of(&authed("    auth: { methods: [password], product: orders }\n"));
    assert!(e.contains("routes[0].auth.methods[0]"), "{e}");

    let s = compile_t(&authed(
        "    auth: { methods: [apiKey], product: search }\n    rateLimit: { class: search, cost: 5 }\n",
    ))
    .unwrap();
    assert_eq!(s.routes[0].rate_limit, Some(postern_model::RouteRate { class: "search".into(), cost: 5 }));
    assert_eq!(s.plans["free"].rate_limit, Some(postern_model::Rate { rps: 10, burst: 20 }));
    let e = error_of(&route("    match: { path: { value: /t/o } }\n    rateLimit: { cost: 2 }\n"));
    assert!(e.contains("routes[0].rateLimit: rate limits need an authenticated route"), "{e}");
    let e = error_of(&authed("    auth: { methods: [jwt], product: orders }\n    rateLimit: { cost: 0 }\n"));
    assert!(e.contains("routes[0].rateLimit.cost: cost is 1 to 1000"), "{e}");
}

#[test]
fn plan_quotas_are_parsed_and_bad_ones_named() {
    let with_plans = |plans: &str| {
        let dir = repo_t(&route("    match: { path: { value: /t/o } }\n"));
        std::fs::write(dir.path().join("platform/plans.yaml"), plans).unwrap();
        compile(dir.path()).map(|c| c.snapshot).map_err(|r| r.0.iter().map(ToString::to_string).collect::<Vec<_>>())
    };
    let plans = "products: [search]\nplans:\n  a: { products: [search], quota: { monthly: 1000, mode: hard } }\n  b: { products: [search], quota: { monthly: 5, mode: overage, anchor: day-15 } }\n  c: { products: [search], quota: { monthly: 5, mode: hard, anchor: every-60s } }\n";
    let s = with_plans(plans).unwrap();
    use postern_model::usage::Anchor;
    let q = |p: &str| s.plans[p].quota.unwrap();
    assert_eq!((q("a").calls, q("a").mode, q("a").anchor), (1000, postern_model::QuotaMode::Hard, Anchor::UtcMonth));
    assert_eq!((q("b").mode, q("b").anchor), (postern_model::QuotaMode::Overage, Anchor::BillingDay(15)));
    assert_eq!(q("c").anchor, Anchor::EverySeconds(60));
    let e = with_plans(
        "products: [search]\nplans:\n  a: { products: [search], quota: { monthly: 0, mode: hard, anchor: day-31 } }\n",
    )
    .unwrap_err();
    assert!(e.iter().any(|e| e.contains("plans.a.quota.monthly")), "{e:?}");
    assert!(e.iter().any(|e| e.contains("plans.a.quota.anchor") && e.contains("1 to 28")), "{e:?}");
    let e = with_plans("products: [search]\nplans:\n  a: { products: [search], quota: { monthly: 9, mode: soft } }\n")
        .unwrap_err();
    assert!(e.iter().any(|e| e.contains("plans.a")), "{e:?}");
}

fn route(body: &str) -> String {
    format!(
        "routes:\n  - name: r\n    public: true\n    timeouts: {{ connect: 1s, response: 2s }}\n    backendRefs: [{{ name: a }}]\n{body}"
    )
}

fn write(root: &Path, rel: &str, text: &str) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, text).unwrap();
}

/// A repo with the standard platform files plus `teams/t/routes.yaml`.
fn repo_t(routes: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "platform/clusters.yaml", PLATFORM_CLUSTERS);
    write(dir.path(), "platform/ownership.yaml", OWNERS);
    write(dir.path(), "platform/plans.yaml", PLANS);
    write(dir.path(), "teams/t/routes.yaml", routes);
    dir
}

/// Compiles [`repo_t`].
fn compile_t(routes: &str) -> Result<Snapshot, Vec<String>> {
    let dir = repo_t(routes);
    compile(dir.path()).map(|c| c.snapshot).map_err(|r| r.0.iter().map(ToString::to_string).collect())
}

fn error_of(routes: &str) -> String {
    let errs = compile_t(routes).expect_err("should be refused");
    assert_eq!(errs.len(), 1, "{errs:#?}");
    errs.into_iter().next().unwrap()
}

#[test]
fn the_path_policy_comes_from_gateway_yaml_and_judges_routes_and_samples() {
    let dir = repo_t(&route("    match: { path: { type: PathPrefix, value: /t } }\n"));
    let s = compile(dir.path()).unwrap().snapshot;
    assert_eq!(s.paths, PathPolicy::default());
    write(dir.path(), "platform/gateway.yaml", "paths:\n  semicolon: strip\n  emptySegments: merge\n");
    // Saved requests route as a node routes them: on the canonical path, or 400.
    write(
        dir.path(),
        "teams/t/samples/s.yaml",
        "samples:\n  - name: merged\n    request: { method: GET, path: \"/t//x;v=1\" }\n    expect: { route: r }\n  - name: encoded-slash\n    request: { method: GET, path: \"/t/a%2Fb\" }\n    expect: { status: 400 }\n",
    );
    let s = compile(dir.path()).unwrap().snapshot;
    assert_eq!(s.paths.semicolon, postern_model::path::Semicolon::Strip);
    assert_eq!(s.paths.empty_segments, postern_model::path::EmptySegments::Merge);
    write(dir.path(), "platform/gateway.yaml", "paths:\n  semicolons: strip\n");
    let e = compile(dir.path()).unwrap_err().0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n");
    assert!(e.contains("platform/gateway.yaml"), "{e}");
}

#[test]
fn a_valid_route_compiles() {
    let s =
        compile_t(&route("    match: { path: { type: Exact, value: \"/t/orders/{id}\" }, methods: [GET] }\n")).unwrap();
    assert_eq!(s.routes.len(), 1);
    assert_eq!(s.routes[0].id, "t/r");
    assert_eq!(
        s.routes[0].timeouts,
        Timeouts { connect_ms: 1000, response_ms: 2000, body_idle_ms: None, body_total_ms: 300_000 }
    );
    assert_eq!(s.routes[0].max_body_bytes, DEFAULT_MAX_BODY_BYTES);
}

#[test]
fn unknown_fields_are_named_with_their_path() {
    let e = error_of(&route("    match: { path: { value: /t }, method: GET }\n"));
    assert!(e.starts_with("teams/t/routes.yaml: routes[0].match.method: unknown field `method`"), "{e}");
}

#[test]
fn prefixes_owned_by_another_team_are_refused() {
    let e = error_of(&route("    match: { path: { value: /u/orders } }\n"));
    assert_eq!(
        e,
        "teams/t/routes.yaml: routes[0].match.path.value: host * path /u/orders belongs to team u, not t (owner: t)"
    );
    // A host-specific claim beats the any-host claim.
    let e = error_of(&route("    hostnames: [api.example.com]\n    match: { path: { value: /t/special/x } }\n"));
    assert!(e.contains("host api.example.com path /t/special/x belongs to team u, not t"), "{e}");
    let e = error_of(&route("    match: { path: { value: /nobody } }\n"));
    assert!(e.contains("is not registered to any team"), "{e}");
}

#[test]
fn equally_specific_routes_are_refused_naming_both() {
    let text = "routes:\n  - name: one\n    public: true\n    match: { path: { type: Exact, value: \"/t/o/{id}\" }, methods: [GET] }\n    backendRefs: [{ name: a }]\n    timeouts: { connect: 1s, response: 2s }\n  - name: two\n    public: true\n    match: { path: { type: Exact, value: \"/t/o/{key}\" }, methods: [GET, PUT] }\n    backendRefs: [{ name: a }]\n    timeouts: { connect: 1s, response: 2s }\n";
    let e = error_of(text);
    assert!(
        e.starts_with(
            "teams/t/routes.yaml: routes[1].match: equally specific as route t/one (teams/t/routes.yaml: routes[0])"
        ),
        "{e}"
    );
}

#[test]
fn clusters_must_exist_and_belong_to_the_team() {
    let text = route("    match: { path: { value: /t } }\n").replace("[{ name: a }]", "[{ name: nope }]");
    assert!(error_of(&text).contains("routes[0].backendRefs[0].name: unknown cluster \"nope\""));
    let text = route("    match: { path: { value: /t } }\n").replace("[{ name: a }]", "[{ name: theirs }]");
    assert!(error_of(&text).contains("cluster \"theirs\" belongs to team u"));
    let text = route("    match: { path: { value: /t } }\n").replace("[{ name: a }]", "[{ name: mine, weight: 0 }]");
    assert!(error_of(&text).contains("routes[0].backendRefs: weights add up to 0"));
}

#[test]
fn timeouts_are_required_and_capped() {
    let text = route("    match: { path: { value: /t } }\n").replace("response: 2s", "response: 31s");
    assert_eq!(
        error_of(&text),
        "teams/t/routes.yaml: routes[0].timeouts.response: 31s is over the platform maximum of 30s (owner: t)"
    );
    let text = route("    match: { path: { value: /t } }\n").replace("connect: 1s", "connect: soon");
    assert!(error_of(&text).contains("routes[0].timeouts.connect: \"soon\" is not a duration"));
    let text =
        route("    match: { path: { value: /t } }\n").replace("    timeouts: { connect: 1s, response: 2s }\n", "");
    assert!(error_of(&text).contains("missing field `timeouts`"));
}

#[test]
fn unbounded_or_malformed_patterns_are_refused() {
    let long = format!("/t{}", "/x".repeat(40));
    let e = error_of(&route(&format!("    match: {{ path: {{ value: \"{long}\" }} }}\n")));
    assert!(e.contains("routes[0].match.path.value") && e.contains("more than 32 segments"), "{e}");
    let e = error_of(&route("    match: { path: { value: \"/t/*\" } }\n"));
    assert!(e.contains("only allowed as a whole {param} segment"), "{e}");
    let e = error_of(&route("    match: { path: { value: /t }, methods: [FETCH] }\n"));
    assert!(e.contains("routes[0].match.methods: unsupported method \"FETCH\""), "{e}");
    let e = error_of(&route("    hostnames: [\"Bad_Host\"]\n    match: { path: { value: /t } }\n"));
    assert!(e.contains("routes[0].hostnames: invalid hostname"), "{e}");
}

#[test]
fn filters_rewrites_and_deprecations_are_checked() {
    let e = error_of(&route(
        "    match: { path: { value: /t } }\n    requestHeaders: { set: [{ name: x-auth-subject, value: root }] }\n",
    ));
    assert!(e.contains("routes[0].requestHeaders: set: header \"x-auth-subject\" is reserved"), "{e}");
    let e = error_of(&route(
        "    match: { path: { value: /t } }\n    rewrite: { replacePrefixMatch: /a, replaceFullPath: /b }\n",
    ));
    assert!(e.contains("routes[0].rewrite: give exactly one"), "{e}");
    let e = error_of(&route("    match: { path: { value: /t } }\n    rewrite: { replaceFullPath: \"/a/../b\" }\n"));
    assert!(e.contains("routes[0].rewrite: \"/a/../b\" is not a canonical path (its canonical form is \"/b\")"), "{e}");
    let e = error_of(&route("    match: { path: { value: /t } }\n    rewrite: { replaceFullPath: \"/a//b\" }\n"));
    assert!(e.contains("routes[0].rewrite: \"/a//b\": the path has an empty segment"), "{e}");
    let e = error_of(&route("    match: { path: { value: \"/t/%6F/{id}\" } }\n"));
    assert!(e.contains("routes[0].match.path.value: \"/t/%6F/p\" is not a canonical path"), "{e}");
    let e = error_of(&route("    match: { path: { value: /t } }\n    deprecation: { sunset: next-year }\n"));
    assert!(e.contains("routes[0].deprecation.sunset: \"next-year\" is not an RFC 3339 date"), "{e}");
    let e = error_of(&route("    match: { path: { value: /t } }\n    maxBodyBytes: 2000000000\n"));
    assert!(e.contains("routes[0].maxBodyBytes: over the platform maximum"), "{e}");
    let e = error_of(&route("    match: { path: { value: /t } }\n    maxBodyBytes: 2000000\n    bufferBody: true\n"));
    assert!(e.contains("routes[0].bufferBody: a buffered body needs maxBodyBytes of at most 1 MiB"), "{e}");
    let e = error_of(&route("    match: { path: { value: /t } }\n    wasmFilters: [{ name: nothing-here }]\n"));
    assert!(e.contains("routes[0].wasmFilters[0].name: no filter manifest teams/t/filters/nothing-here.yaml"), "{e}");
    // A manifest's module stays inside the team's filters/ folder.
    for module in ["/dev/zero", "../../../secret.wasm", "./f.wasm", "a\\\\b.wasm"] {
        let dir = repo_t(&route("    match: { path: { value: /t } }\n    wasmFilters: [{ name: f }]\n"));
        write(dir.path(), "teams/t/filters/f.yaml", &format!("module: \"{module}\"\nlimits: {{}}\n"));
        let e = compile(dir.path()).err().map(|r| r.0.iter().map(ToString::to_string).collect::<Vec<_>>());
        let shown = module.replace("\\\\", "\\");
        assert_eq!(
            e,
            Some(vec![format!(
                "teams/t/filters/f.yaml: module: {shown:?}: a file name inside teams/t/filters/ (no absolute path, '.' or '..') (owner: t)"
            )])
        );
    }
    let e = error_of(&route(
        "    match: { path: { value: /t } }\n    wasmFilters: [{ name: f, quarantine: { failurePercent: 0 } }]\n",
    ));
    assert!(e.contains("routes[0].wasmFilters[0].quarantine.failurePercent: 0 is out of range: 1 to 100"), "{e}");
    let e = error_of(&route(
        "    match: { path: { value: /t } }\n    wasmFilters: [{ name: f, quarantine: { forSecs: 7200 } }]\n",
    ));
    assert!(e.contains("routes[0].wasmFilters[0].quarantine.forSecs: 7200 is out of range: 1 to 3600"), "{e}");
    let e = error_of(&route(
        "    match: { path: { value: /t } }\n    wasmFilters: [{ name: f, quarantine: { minCall: 5 } }]\n",
    ));
    assert!(e.contains("unknown field `minCall`"), "{e}");
}

#[test]
fn saved_requests_must_reach_their_routes() {
    let dir = repo_t(&route("    match: { path: { value: /t/orders }, methods: [GET] }\n"));
    let w = |rel: &str, text: &str| write(dir.path(), rel, text);
    let sample =
        |name: &str, req: &str, expect: &str| format!("  - name: {name}\n    request: {req}\n    expect: {expect}\n");
    let good = [
        sample("list", "{ path: /t/orders/7 }", "{ route: r }"),
        sample("by id", "{ path: \"/t/orders?x=1\", host: \"Any.Example:443\" }", "{ route: t/r }"),
        sample("delete", "{ method: DELETE, path: /t/orders }", "{ status: 405 }"),
        sample("elsewhere", "{ path: /u/x }", "{ status: 404 }"),
    ]
    .concat();
    w("teams/t/samples/orders.yaml", &format!("samples:\n{good}"));
    assert!(compile(dir.path()).is_ok());

    let bad = [
        sample("moved", "{ path: /t/elsewhere }", "{ route: r }"),
        sample("now routed", "{ path: /t/orders }", "{ status: 404 }"),
        sample("partner pool", "{ path: /t/orders, pool: partner }", "{ route: r }"),
    ]
    .concat();
    w("teams/t/samples/orders.yaml", &format!("samples:\n{bad}"));
    let errs: Vec<String> = compile(dir.path()).err().unwrap().0.iter().map(ToString::to_string).collect();
    assert_eq!(
        errs,
        vec![
            "teams/t/samples/orders.yaml: samples[0]: \"moved\": expected route t/r, got no route (404) (owner: t)",
            "teams/t/samples/orders.yaml: samples[1]: \"now routed\": expected no route (404), got route t/r (owner: t)",
            "teams/t/samples/orders.yaml: samples[2]: \"partner pool\": expected route t/r, got no route (404) (owner: t)",
        ]
    );
}

#[test]
fn duplicate_names_are_refused() {
    let one = route("    match: { path: { value: /t/a } }\n");
    let two = one.replace("routes:\n", "").replace("/t/a", "/t/b");
    let e = error_of(&format!("{one}{two}"));
    assert!(e.contains("routes[1].name: route t/r is already defined at teams/t/routes.yaml: routes[0]"), "{e}");
}

const ORDERS_SPEC: &str = "openapi: 3.0.3\npaths:\n  /orders/{id}:\n    post:\n      operationId: createOrder\n      parameters:\n        - { name: id, in: path, required: true, schema: { type: integer } }\n      requestBody:\n        required: true\n        content:\n          application/json:\n            schema: { $ref: '#/components/schemas/Order' }\ncomponents:\n  schemas:\n    Order: { type: object, required: [qty], properties: { qty: { type: integer, minimum: 1 } } }\n";

/// Compiles [`repo_t`] with `spec` as `teams/t/openapi/orders.yaml`.
fn compile_spec(routes: &str, spec: &str) -> Result<Snapshot, Vec<String>> {
    let dir = repo_t(routes);
    write(dir.path(), "teams/t/openapi/orders.yaml", spec);
    compile(dir.path()).map(|c| c.snapshot).map_err(|r| r.0.iter().map(ToString::to_string).collect())
}

/// A route on `POST /t/orders/{id}` with `validate: <validate>` and `extra` lines.
fn validated(validate: &str, extra: &str) -> String {
    route(&format!(
        "    match: {{ path: {{ type: Exact, value: \"/t/orders/{{id}}\" }}, methods: [POST] }}\n    validate: {validate}\n{extra}"
    ))
}

#[test]
fn a_validated_route_carries_its_operation_and_buffers_its_body() {
    use postern_model::validate::{Media, ParamShape, Parameter, RequestBody, Scalar};
    use serde_json::json;
    let routes = validated("{ openapi: orders.yaml, operationId: createOrder, json: { maxDepth: 8 } }", "");
    let s = compile_spec(&routes, ORDERS_SPEC).unwrap();
    let dialect = crate::openapi::SCHEMA_DIALECT;
    let want = Validation {
        source: "teams/t/openapi/orders.yaml#createOrder".into(),
        parameters: vec![Parameter {
            name: "id".into(),
            location: ParamIn::Path,
            required: true,
            shape: ParamShape::Scalar { of: Scalar::Integer },
            schema: json!({ "$schema": dialect, "type": "integer" }),
        }],
        body: Some(RequestBody {
            required: true,
            media: vec![Media {
                range: "application/json".into(),
                schema: Some(json!({
                    "$schema": dialect,
                    "$ref": "#/$defs/~1components~1schemas~1Order",
                    "$defs": { "/components/schemas/Order": { "type": "object", "required": ["qty"],
                        "properties": { "qty": { "type": "integer", "minimum": 1 } } } },
                })),
            }],
        }),
        json: JsonLimits { max_depth: 8, ..JsonLimits::default() },
    };
    assert_eq!(s.routes[0].validate, Some(want));
    assert!(s.routes[0].buffer_body);
}

#[test]
fn validate_is_checked_against_its_document_and_the_route() {
    let e = |validate: &str, extra: &str| compile_spec(&validated(validate, extra), ORDERS_SPEC).unwrap_err();
    assert_eq!(
        e("{ openapi: orders.yaml, operationId: create }", ""),
        vec![
            "teams/t/routes.yaml: routes[0].validate.operationId: teams/t/openapi/orders.yaml: no operation has operationId \"create\" (known: createOrder) (owner: t)"
        ]
    );
    let e1 = e("{ openapi: ../u/openapi/orders.yaml, operationId: createOrder }", "");
    assert!(e1[0].contains("routes[0].validate.openapi: \"../u/openapi/orders.yaml\" is not a .yaml"), "{e1:?}");
    let e1 = e("{ openapi: other.yaml, operationId: createOrder }", "");
    assert!(e1[0].contains("routes[0].validate.openapi: no OpenAPI document teams/t/openapi/other.yaml"), "{e1:?}");
    let e1 = e("{ openapi: orders.yaml, operationId: createOrder, json: { maxDepth: 0 } }", "");
    assert!(e1[0].contains("routes[0].validate.json.maxDepth: 0 is out of range (1 to 128)"), "{e1:?}");
    let e1 = e("{ openapi: orders.yaml, operationId: createOrder }", "    maxBodyBytes: 2000000\n");
    assert!(e1[0].contains("routes[0].validate: validating a body needs maxBodyBytes of at most 1 MiB"), "{e1:?}");
    let routes = validated("{ openapi: orders.yaml, operationId: createOrder }", "")
        .replace("{id}", "{key}")
        .replace("methods: [POST]", "methods: [GET]");
    let e1 = compile_spec(&routes, ORDERS_SPEC).unwrap_err();
    assert_eq!(e1.len(), 2, "{e1:?}");
    assert!(e1[0].contains("routes[0].validate: path parameter \"id\" of teams/t/openapi/orders.yaml#createOrder is not a {id} segment of the route's path /t/orders/{key}"), "{e1:?}");
    assert!(
        e1[1]
            .contains("routes[0].validate: operation createOrder is POST /orders/{id}, but the route matches only GET"),
        "{e1:?}"
    );
}

#[test]
fn errors_in_a_document_name_its_file_and_pointer_once() {
    let spec = ORDERS_SPEC.replace("minimum: 1", "$ref: 'common.yaml#/Qty'");
    let one = validated("{ openapi: orders.yaml, operationId: createOrder }", "");
    let two = one.replace("routes:\n", "").replace("name: r", "name: r2").replace("/t/orders/", "/t/orders2/");
    assert_eq!(
        compile_spec(&format!("{one}{two}"), &spec).unwrap_err(),
        vec![
            "teams/t/openapi/orders.yaml: /components/schemas/Order/properties/qty/$ref: remote $ref is refused: common.yaml#/Qty (owner: t)"
        ]
    );
    let e = compile_spec(&one, "openapi: 3.0.3\npaths: [\n").unwrap_err();
    assert!(e.len() == 1 && e[0].starts_with("teams/t/openapi/orders.yaml: "), "{e:?}");
}

#[test]
fn a_schema_the_node_cannot_build_is_named_in_the_spec() {
    // Look-behind is not in the linear-time engine the node runs patterns with.
    let spec = ORDERS_SPEC.replace("minimum: 1", "pattern: '(?<=a)b'");
    let one = validated("{ openapi: orders.yaml, operationId: createOrder }", "");
    let e = compile_spec(&one, &spec).unwrap_err();
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(
        e[0].starts_with(
            "teams/t/openapi/orders.yaml: /components/schemas/Order/properties/qty/pattern: request body application/json: "
        ) && e[0].ends_with("(owner: t)"),
        "{e:?}"
    );
}

#[test]
fn compression_is_opt_in_with_a_threshold() {
    let s = compile_t(&route("    match: { path: { value: /t/c } }\n    compress: true\n")).unwrap();
    assert_eq!(s.routes[0].compress, Some(postern_model::Compress { min_bytes: 1024 }));
    let s = compile_t(&route("    match: { path: { value: /t/c } }\n    compress: { minBytes: 0 }\n")).unwrap();
    assert_eq!(s.routes[0].compress, Some(postern_model::Compress { min_bytes: 0 }));
    let s = compile_t(&route("    match: { path: { value: /t/c } }\n    compress: false\n")).unwrap();
    assert_eq!(s.routes[0].compress, None);
    let e =
        compile_t(&route("    match: { path: { value: /t/c } }\n    compress: { minBytes: 9999999 }\n")).unwrap_err();
    assert!(e[0].contains("routes[0].compress.minBytes: is 0 to 1 MiB"), "{e:?}");
}

#[test]
fn a_transcoded_route_carries_its_descriptors_and_is_checked() {
    const PROTO: &str = "syntax = \"proto3\";\npackage t.v1;\nimport \"google/api/annotations.proto\";\n\
        message Get { string id = 1; }\nmessage Thing { string id = 1; }\n\
        service Things { rpc GetThing(Get) returns (Thing) { option (google.api.http) = { get: \"/t/v1/things/{id}\" }; } }\n";
    let routes = route(
        "    match: { path: { type: PathPrefix, value: /t/v1 } }\n    grpc: { proto: things.proto, service: t.v1.Things }\n",
    );
    let dir = repo_t(&routes);
    write(dir.path(), "teams/t/proto/things.proto", PROTO);
    for f in ["annotations.proto", "http.proto"] {
        let from =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/config/teams/orders/proto/google/api").join(f);
        write(dir.path(), &format!("teams/t/proto/google/api/{f}"), &std::fs::read_to_string(from).unwrap());
    }
    let errs = |dir: &Path| -> Vec<String> {
        compile(dir).map(|_| Vec::new()).unwrap_or_else(|r| r.0.iter().map(ToString::to_string).collect())
    };
    // An HTTP/1.1 cluster cannot carry gRPC.
    assert_eq!(
        errs(dir.path()),
        ["teams/t/routes.yaml: routes[0].grpc: cluster a must set protocol: http2 to carry gRPC (owner: t)"]
    );
    write(
        dir.path(),
        "platform/clusters.yaml",
        &PLATFORM_CLUSTERS.replace(
            "a: { endpoints: [\"127.0.0.1:9001\"] }",
            "a: { endpoints: [\"127.0.0.1:9001\"], protocol: http2 }",
        ),
    );
    let s = compile(dir.path()).unwrap().snapshot;
    let g = s.routes[0].grpc.as_ref().unwrap();
    assert_eq!((g.source.as_str(), g.service.as_str()), ("teams/t/proto/things.proto", "t.v1.Things"));
    assert!(s.routes[0].buffer_body);
    assert_eq!(postern_transcode::Transcoder::build(g).unwrap().bindings().len(), 1);
    // A binding outside the route's prefix; an unknown field in a template; no file.
    write(dir.path(), "teams/t/routes.yaml", &routes.replace("value: /t/v1 }", "value: /t/v2 }"));
    assert_eq!(
        errs(dir.path()),
        [
            "teams/t/routes.yaml: routes[0].grpc: teams/t/proto/things.proto: the binding GET /t/v1/things/{id} is not under the route's path /t/v2 (owner: t)"
        ]
    );
    write(dir.path(), "teams/t/routes.yaml", &routes);
    write(dir.path(), "teams/t/proto/things.proto", &PROTO.replace("{id}", "{nope}"));
    assert_eq!(
        errs(dir.path()),
        [
            "teams/t/proto/things.proto: t.v1.Things.GetThing (get /t/v1/things/{nope}): t.v1.Get has no field \"nope\" (owner: t)"
        ]
    );
    write(dir.path(), "teams/t/routes.yaml", &routes.replace("things.proto", "other.proto"));
    assert_eq!(
        errs(dir.path()),
        ["teams/t/routes.yaml: routes[0].grpc.proto: no file teams/t/proto/other.proto (owner: t)"]
    );

    // Read whole: a body over 1 MiB is refused at the field.
    write(dir.path(), "teams/t/proto/things.proto", PROTO);
    write(dir.path(), "teams/t/routes.yaml", &routes.replace("    grpc:", "    maxBodyBytes: 1048577\n    grpc:"));
    assert_eq!(
        errs(dir.path()),
        [
            "teams/t/routes.yaml: routes[0].maxBodyBytes: a gRPC-transcoded route reads its body whole: maxBodyBytes of at most 1 MiB (owner: t)"
        ]
    );
    write(dir.path(), "teams/t/routes.yaml", &routes.replace("    grpc:", "    maxBodyBytes: 1048576\n    grpc:"));
    assert_eq!(compile(dir.path()).unwrap().snapshot.routes[0].max_body_bytes, 1 << 20);
    write(dir.path(), "teams/t/routes.yaml", &routes);

    // Imports stay inside the team's proto/ folder, as regular files of bounded size.
    let with_import =
        |import: &str| PROTO.replace("import \"google", &format!("import \"{import}\";\nimport \"google"));
    let refused = |import: &str, why: &str| {
        vec![format!("teams/t/proto/things.proto: does not compile: \"{import}\" refused: {why} (owner: t)")]
    };
    write(dir.path(), "teams/t/proto/things.proto", &with_import("/dev/zero"));
    assert_eq!(errs(dir.path()), refused("/dev/zero", "an absolute path (imports are relative to teams/t/proto/)"));
    write(dir.path(), "teams/t/proto/things.proto", &with_import("../../../x.proto"));
    assert_eq!(
        errs(dir.path()),
        refused("../../../x.proto", "'..' or '.' in a path (imports stay inside teams/t/proto/)")
    );
    write(dir.path(), "teams/t/proto/things.proto", &with_import("google\\api\\http.proto"));
    assert_eq!(errs(dir.path()), refused("google\\api\\http.proto", "a backslash in a file name"));
    let outside = tempfile::tempdir().unwrap();
    write(outside.path(), "secret.proto", "syntax = \"proto3\";\n");
    std::os::unix::fs::symlink(outside.path().join("secret.proto"), dir.path().join("teams/t/proto/link.proto"))
        .unwrap();
    std::os::unix::fs::symlink(outside.path(), dir.path().join("teams/t/proto/out")).unwrap();
    write(dir.path(), "teams/t/proto/things.proto", &with_import("link.proto"));
    assert_eq!(errs(dir.path()), refused("link.proto", "a symbolic link out of teams/t/proto/"));
    // Whether a file exists past a link out is not told.
    for name in ["out/secret.proto", "out/missing.proto"] {
        write(dir.path(), "teams/t/proto/things.proto", &with_import(name));
        assert_eq!(errs(dir.path()), refused(name, "a symbolic link out of teams/t/proto/"));
    }
    let made = std::process::Command::new("mkfifo").arg(dir.path().join("teams/t/proto/fifo.proto")).status().unwrap();
    assert!(made.success());
    write(dir.path(), "teams/t/proto/things.proto", &with_import("fifo.proto"));
    assert_eq!(errs(dir.path()), refused("fifo.proto", "not a regular file, refused"));
    write(dir.path(), "teams/t/proto/big.proto", &" ".repeat(usize::try_from(PROTO_FILE_CAP).unwrap() + 1));
    write(dir.path(), "teams/t/proto/things.proto", &with_import("big.proto"));
    assert_eq!(
        errs(dir.path()),
        refused("big.proto", &format!("{} bytes, over the limit of {PROTO_FILE_CAP}", PROTO_FILE_CAP + 1))
    );
    // A chain of imports longer than the file cap.
    for i in 0..=PROTO_FILES_CAP {
        write(
            dir.path(),
            &format!("teams/t/proto/c/{i}.proto"),
            &format!("syntax = \"proto3\";\nimport \"c/{}.proto\";\n", i + 1),
        );
    }
    write(dir.path(), &format!("teams/t/proto/c/{}.proto", PROTO_FILES_CAP + 1), "syntax = \"proto3\";\n");
    write(dir.path(), "teams/t/proto/things.proto", &with_import("c/0.proto"));
    let e = errs(dir.path());
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].contains(&format!("more than {PROTO_FILES_CAP} .proto files in one compile")), "{e:?}");
    // The main file is read by the same rules.
    write(dir.path(), "teams/t/routes.yaml", &routes.replace("things.proto", "fifo.proto"));
    assert_eq!(
        errs(dir.path()),
        ["teams/t/proto/fifo.proto: does not compile: \"fifo.proto\" refused: not a regular file, refused (owner: t)"]
    );
}

#[test]
fn every_error_is_reported_at_once() {
    let text = route("    match: { path: { value: /u } }\n").replace("response: 2s", "response: 1h");
    let errs = compile_t(&text).unwrap_err();
    assert_eq!(errs.len(), 2, "{errs:#?}");
}

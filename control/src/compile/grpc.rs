//! A route's `grpc:`: the service's descriptors, checked by building the node's own
//! transcoder.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use postern_model::Cluster;
use postern_model::disk::read_untrusted;
use postern_router::PathKind;
use protox::file::{ChainFileResolver, File, FileResolver, GoogleFileResolver};

use super::context::{Ctx, RouteAt};
use crate::config::RouteDoc;

/// The largest `.proto` file a team's compile reads: 1 MiB.
pub const PROTO_FILE_CAP: u64 = 1 << 20;

/// The most `.proto` files one route's compile reads (its own and every import of its
/// team's; the well-known types are not counted): 256.
pub const PROTO_FILES_CAP: usize = 256;

/// The largest descriptor set (`grpc.proto` naming a `.pb`/`.desc` file) a compile reads:
/// 16 MiB.
pub const DESCRIPTOR_SET_CAP: u64 = 16 << 20;

/// The `.proto` files a team's compile may read: regular files under its own
/// `teams/<team>/proto/` folder, named relative to it (no absolute path, no `..`, no
/// backslash), still under it once every symbolic link is resolved, each at most
/// [`PROTO_FILE_CAP`] bytes, at most [`PROTO_FILES_CAP`] of them. Chained before protox's
/// well-known Google types, which are compiled in and read nothing. A refusal names its
/// rule and says nothing of files outside the folder.
struct TeamProtos {
    /// The folder, canonical.
    dir: PathBuf,
    /// As the team knows it (`teams/<team>/proto/`), for messages.
    shown: String,
    opened: AtomicUsize,
}

impl TeamProtos {
    fn new(root: &Path, team: &str) -> Result<TeamProtos, String> {
        let shown = format!("teams/{team}/proto/");
        let outside = || format!("{shown} is not a folder inside the repository, refused");
        let root = root.canonicalize().map_err(|e| format!("cannot read the repository: {e}"))?;
        let dir = root.join("teams").join(team).join("proto").canonicalize().map_err(|_| outside())?;
        if !dir.starts_with(&root) || !dir.is_dir() {
            return Err(outside());
        }
        Ok(TeamProtos { dir, shown, opened: AtomicUsize::new(0) })
    }

    /// Why the name `name` is refused before anything is looked up, if it is.
    fn name_rule(&self, name: &str) -> Option<String> {
        let why = if name.contains('\\') {
            "a backslash in a file name".to_owned()
        } else if Path::new(name).is_absolute() {
            format!("an absolute path (imports are relative to {})", self.shown)
        } else if name.split('/').any(|c| c == "." || c == "..") {
            format!("'..' or '.' in a path (imports stay inside {})", self.shown)
        } else if name.split('/').any(str::is_empty) {
            "an empty component in a path".to_owned()
        } else {
            return None;
        };
        Some(format!("\"{name}\" refused: {why}"))
    }

    /// The file `name` stands for; `Err(None)` when there is none, `Err(Some(why))` when
    /// it is refused.
    fn locate(&self, name: &str) -> Result<PathBuf, Option<String>> {
        if let Some(why) = self.name_rule(name) {
            return Err(Some(why));
        }
        let refused = |why: &str| Some(format!("\"{name}\" refused: {why}"));
        let rel = Path::new(name);
        if !rel.components().all(|c| matches!(c, Component::Normal(_))) {
            return Err(refused(&format!("'..' or '.' in a path (imports stay inside {})", self.shown)));
        }
        // Each symbolic link on the way must stay inside the folder; nothing past one that
        // leaves it is looked at.
        let mut at = self.dir.clone();
        for part in rel.components() {
            at.push(part);
            let Ok(meta) = std::fs::symlink_metadata(&at) else { return Err(None) };
            if meta.file_type().is_symlink() {
                match at.canonicalize() {
                    Ok(real) if real.starts_with(&self.dir) => {}
                    _ => return Err(refused(&format!("a symbolic link out of {}", self.shown))),
                }
            }
        }
        match at.canonicalize() {
            Ok(real) if real.starts_with(&self.dir) => Ok(real),
            Ok(_) => Err(refused(&format!("a symbolic link out of {}", self.shown))),
            Err(_) => Err(None),
        }
    }
}

impl FileResolver for TeamProtos {
    fn open_file(&self, name: &str) -> Result<File, protox::Error> {
        let path = match self.locate(name) {
            Ok(p) => p,
            // Not there: the next resolver (the well-known types) may have it.
            Err(None) => return Err(protox::Error::file_not_found(name)),
            Err(Some(why)) => return Err(protox::Error::new(why)),
        };
        let opened = self.opened.fetch_add(1, Ordering::Relaxed).saturating_add(1);
        if opened > PROTO_FILES_CAP {
            return Err(protox::Error::new(format!(
                "\"{name}\" refused: more than {PROTO_FILES_CAP} .proto files in one compile"
            )));
        }
        let bytes = read_untrusted(&path, PROTO_FILE_CAP)
            .map_err(|e| protox::Error::new(format!("\"{name}\" refused: {e}")))?;
        let text =
            String::from_utf8(bytes).map_err(|_| protox::Error::new(format!("\"{name}\" refused: not UTF-8 text")))?;
        // The parser refuses such imports too, but under another name ("invalid group
        // name"): said here with the rule.
        if let Some(why) = imports(&text).into_iter().find_map(|i| self.name_rule(&i)) {
            return Err(protox::Error::new(why));
        }
        File::from_source(name, &text)
    }
}

/// The names a `.proto` source imports (`import [public|weak] "name";`), found by a
/// small scan that skips comments and reads string literals whole.
fn imports(text: &str) -> Vec<String> {
    #[derive(PartialEq)]
    enum Token {
        Word(String),
        Text(String),
        Other,
    }
    let mut tokens = Vec::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '/' if chars.peek() == Some(&'/') => {
                chars.by_ref().find(|&c| c == '\n');
            }
            '/' if chars.peek() == Some(&'*') => {
                chars.next();
                let mut last = ' ';
                for c in chars.by_ref() {
                    if last == '*' && c == '/' {
                        break;
                    }
                    last = c;
                }
            }
            '"' | '\'' => {
                let mut value = String::new();
                while let Some(d) = chars.next() {
                    match d {
                        '\\' => {
                            value.push(d);
                            value.extend(chars.next());
                        }
                        d if d == c => break,
                        d => value.push(d),
                    }
                }
                tokens.push(Token::Text(value));
            }
            c if c.is_alphanumeric() || c == '_' => {
                let mut word = String::from(c);
                while let Some(&d) = chars.peek().filter(|d| d.is_alphanumeric() || **d == '_') {
                    word.push(d);
                    chars.next();
                }
                tokens.push(Token::Word(word));
            }
            c if c.is_whitespace() => {}
            _ => tokens.push(Token::Other),
        }
    }
    let mut out = Vec::new();
    let mut it = tokens.iter().peekable();
    while let Some(t) = it.next() {
        if *t != Token::Word("import".into()) {
            continue;
        }
        if matches!(it.peek(), Some(Token::Word(w)) if w == "public" || w == "weak") {
            it.next();
        }
        if let Some(Token::Text(name)) = it.peek() {
            out.push(name.clone());
        }
    }
    out
}

/// A route's `grpc:`: the service's descriptors (compiled from `.proto` sources with
/// protox, a pure-Rust protobuf compiler, or read as a descriptor set), checked by
/// building the node's own transcoder; every binding must fall under the route's prefix
/// and the route's backends must speak HTTP/2.
pub(crate) fn route_grpc(
    cx: &mut Ctx,
    route: &RouteAt<'_>,
    doc: &crate::config::GrpcDoc,
    kind: PathKind,
    r: &RouteDoc,
    clusters: &BTreeMap<String, Cluster>,
) -> Option<postern_model::transcode::Transcode> {
    let (file, field, team) = (route.file, route.field, route.team);
    let owner = Some(team);
    let at = format!("{field}.grpc");
    let name = doc.proto.as_str();
    if name.is_empty() || name.contains(['/', '\\']) || name.contains("..") {
        cx.error(file, format!("{at}.proto"), "a file name in teams/<team>/proto/ (no '/' nor '..')", owner);
        return None;
    }
    if route.max_body_bytes > postern_model::MAX_BUFFERED_BODY_BYTES {
        // A transcoded request is read whole (JSON in, one protobuf message out).
        cx.error(
            file,
            format!("{field}.maxBodyBytes"),
            "a gRPC-transcoded route reads its body whole: maxBodyBytes of at most 1 MiB",
            owner,
        );
    }
    let dir = cx.root.join("teams").join(team).join("proto");
    let rel = format!("teams/{team}/proto/{name}");
    let path = dir.join(name);
    if std::fs::symlink_metadata(&path).is_err() {
        cx.error(file, format!("{at}.proto"), format!("no file {rel}"), owner);
        return None;
    }
    let descriptors = if name.ends_with(".proto") {
        let resolver = match TeamProtos::new(&cx.root, team) {
            Ok(r) => r,
            Err(e) => {
                cx.error(&path, "", e, owner);
                return None;
            }
        };
        let mut chain = ChainFileResolver::new();
        chain.add(resolver);
        chain.add(GoogleFileResolver::new());
        let mut c = protox::Compiler::with_file_resolver(chain);
        c.include_imports(true).include_source_info(false);
        match c.open_file(name) {
            Ok(c) => c.encode_file_descriptor_set(),
            Err(e) => {
                cx.error(&path, "", format!("does not compile: {e}"), owner);
                return None;
            }
        }
    } else {
        match read_untrusted(&path, DESCRIPTOR_SET_CAP) {
            Ok(d) => d,
            Err(e) => {
                cx.error(&path, "", format!("cannot be read: {e}"), owner);
                return None;
            }
        }
    };
    let t = postern_model::transcode::Transcode { source: rel.clone(), descriptors, service: doc.service.clone() };
    let built = match postern_transcode::Transcoder::build(&t) {
        Ok(b) => b,
        Err(e) => {
            cx.error(&path, "", e.to_string(), owner);
            return None;
        }
    };
    if kind != PathKind::Prefix {
        cx.error(
            file,
            format!("{field}.match.path"),
            "a transcoded route matches a PathPrefix its bindings fall under",
            owner,
        );
    }
    let prefix = route.path.trim_end_matches('/');
    for b in built.bindings() {
        let lit = b.literal_prefix();
        if !(lit == format!("{prefix}/") || lit.starts_with(&format!("{prefix}/")) || prefix.is_empty()) {
            cx.error(
                file,
                at.clone(),
                format!(
                    "{rel}: the binding {} {} is not under the route's path {}",
                    b.http_method(),
                    b.template_text(),
                    route.path
                ),
                owner,
            );
        }
    }
    for backend in &r.backend_refs {
        if let Some(c) = clusters.get(&backend.name)
            && !c.http2
        {
            cx.error(
                file,
                at.clone(),
                format!("cluster {} must set protocol: http2 to carry gRPC", backend.name),
                owner,
            );
        }
    }
    Some(t)
}

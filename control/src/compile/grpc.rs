//! A route's `grpc:`: the service's descriptors, checked by building the node's own
//! transcoder.

use std::collections::BTreeMap;

use postern_model::Cluster;
use postern_router::PathKind;

use super::context::{Ctx, RouteAt};
use crate::config::RouteDoc;

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
    let dir = cx.root.join("teams").join(team).join("proto");
    let rel = format!("teams/{team}/proto/{name}");
    let path = dir.join(name);
    if !path.is_file() {
        cx.error(file, format!("{at}.proto"), format!("no file {rel}"), owner);
        return None;
    }
    let descriptors = if name.ends_with(".proto") {
        let compiled = protox::Compiler::new([&dir]).and_then(|mut c| {
            c.include_imports(true).include_source_info(false);
            c.open_file(name)?;
            Ok(c.encode_file_descriptor_set())
        });
        match compiled {
            Ok(d) => d,
            Err(e) => {
                cx.error(&path, "", format!("does not compile: {e}"), owner);
                return None;
            }
        }
    } else {
        match std::fs::read(&path) {
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

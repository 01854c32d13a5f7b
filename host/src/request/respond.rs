//! The one place where gateway errors become HTTP responses: `application/problem+json`
//! (RFC 9457) with a stable `code` and the request id.

use std::borrow::Cow;

use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Response, StatusCode};
use postern_filter_contract::{Problem, Reply};

use crate::request::body::ResponseBody;
use crate::request::error::ProxyError;
use postern_validate::{DecodeError, Refusal};

const PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");

/// The problem the caller sees for a gateway error: one status and stable code per kind.
pub fn error(e: &ProxyError) -> Problem {
    let detail = Cow::Owned(e.to_string());
    match e {
        ProxyError::InvalidPath(d) => Problem::new(StatusCode::BAD_REQUEST, "invalid_path", *d),
        ProxyError::BadRequest(d) => Problem::new(StatusCode::BAD_REQUEST, "bad_request", *d),
        ProxyError::BodyTimeout | ProxyError::BodyBroken(_) | ProxyError::ClientBodyBroken(_) => {
            Problem::new(StatusCode::BAD_REQUEST, "bad_request", detail)
        }
        ProxyError::RouteNotFound => Problem::new(StatusCode::NOT_FOUND, "route_not_found", detail),
        ProxyError::MethodNotAllowed(allow) => {
            Problem::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", detail)
                .with_header(http::header::ALLOW, allow.clone())
        }
        ProxyError::BodyTooLarge { .. } => Problem::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", detail)
            .with_header(http::header::CONNECTION, HeaderValue::from_static("close")),
        ProxyError::NoEndpoint | ProxyError::ConnectRefused(_) | ProxyError::UpstreamBroken(_) => {
            Problem::new(StatusCode::BAD_GATEWAY, "upstream_unavailable", detail)
        }
        ProxyError::ConnectTimeout(_) | ProxyError::ResponseTimeout { .. } => {
            Problem::new(StatusCode::GATEWAY_TIMEOUT, "upstream_timeout", detail)
        }
        ProxyError::UpstreamOverloaded => Problem::new(StatusCode::SERVICE_UNAVAILABLE, "upstream_overloaded", detail)
            .with_header(http::header::RETRY_AFTER, HeaderValue::from_static("1")),
        ProxyError::ClientShare => Problem::new(StatusCode::SERVICE_UNAVAILABLE, "client_share_exceeded", detail)
            .with_header(http::header::RETRY_AFTER, HeaderValue::from_static("1")),
        ProxyError::NodeOverloaded => Problem::new(StatusCode::SERVICE_UNAVAILABLE, "node_overloaded", detail)
            .with_header(http::header::RETRY_AFTER, HeaderValue::from_static("1")),
        ProxyError::Shed(_) => Problem::new(StatusCode::SERVICE_UNAVAILABLE, "shed", detail)
            .with_header(http::header::RETRY_AFTER, HeaderValue::from_static("1")),
        ProxyError::CircuitOpen(after) => Problem::new(StatusCode::SERVICE_UNAVAILABLE, "circuit_open", detail)
            .with_header(http::header::RETRY_AFTER, HeaderValue::from(after.as_millis().div_ceil(1000).max(1) as u64)),
        ProxyError::FilterPath(_) => Problem::new(StatusCode::SERVICE_UNAVAILABLE, "filter_failed", detail),
        ProxyError::UpstreamProtocol(d) => Problem::new(StatusCode::BAD_GATEWAY, "upstream_protocol_error", *d),
        ProxyError::Internal(d) => Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", *d),
        ProxyError::Refused(r) => refusal(r, detail),
        ProxyError::Encoding(_) => Problem::new(StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_encoding", detail),
        ProxyError::Decode(DecodeError::TooLarge(_) | DecodeError::Ratio) => {
            Problem::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", detail)
                .with_header(http::header::CONNECTION, HeaderValue::from_static("close"))
        }
        ProxyError::Decode(DecodeError::Corrupt(_)) => {
            Problem::new(StatusCode::BAD_REQUEST, "invalid_encoding", detail)
        }
        ProxyError::Grpc { code, .. } => {
            let (status, name) = postern_transcode::status(*code);
            Problem::new(status, name, detail).with_extension("grpc_status", serde_json::Value::from(*code))
        }
    }
}

/// A request the route's validator refused: every bad field named in `errors`.
fn refusal(r: &Refusal, detail: Cow<'static, str>) -> Problem {
    match r {
        Refusal::Invalid(fields) => {
            let errors = fields
                .iter()
                .map(|f| serde_json::json!({"in": f.location, "pointer": f.pointer, "message": f.message}))
                .collect();
            Problem::new(StatusCode::BAD_REQUEST, "validation_failed", detail)
                .with_extension("errors", serde_json::Value::Array(errors))
        }
        Refusal::Json(e) => Problem::new(StatusCode::BAD_REQUEST, "invalid_json", detail).with_extension(
            "errors",
            serde_json::json!([{"in": "body", "offset": e.offset, "message": e.reason.to_string()}]),
        ),
        Refusal::MediaType(_) => Problem::new(StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type", detail),
    }
}

/// Renders a problem; the body names the code, status, detail and request id.
pub fn problem(p: &Problem, request_id: &HeaderValue) -> Response<ResponseBody> {
    let title = p.status.canonical_reason().unwrap_or("Error");
    let mut body = serde_json::json!({
        "type": format!("https://postern.dev/problems/{}", p.code),
        "title": title,
        "status": p.status.as_u16(),
        "code": p.code,
        "detail": p.detail,
        "request_id": request_id.to_str().unwrap_or_default(),
    });
    if let Some(members) = body.as_object_mut() {
        for (k, v) in &p.extensions {
            // The standard members are the gateway's own.
            members.entry(k.clone()).or_insert_with(|| v.clone());
        }
    }
    let bytes = serde_json::to_vec(&body).unwrap_or_default();
    let mut resp = Response::new(ResponseBody::full(bytes));
    *resp.status_mut() = p.status;
    let h = resp.headers_mut();
    h.insert(CONTENT_TYPE, PROBLEM_JSON);
    for (k, v) in &p.headers {
        h.append(k, v.clone());
    }
    resp
}

/// Renders a filter's reply.
pub fn reply(r: Reply, request_id: &HeaderValue) -> Response<ResponseBody> {
    match r {
        Reply::Problem(p) => problem(&p, request_id),
        Reply::Custom { status, headers, body } => {
            let mut resp = Response::new(ResponseBody::full(body));
            *resp.status_mut() = if status.is_informational() { StatusCode::INTERNAL_SERVER_ERROR } else { status };
            *resp.headers_mut() = headers;
            resp
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn problem_body_has_code_and_request_id() {
        let rid = HeaderValue::from_static("abc123");
        let resp = problem(&error(&ProxyError::RouteNotFound), &rid);
        assert_eq!(resp.status(), StatusCode::NOT_FOUND);
        assert_eq!(resp.headers()[CONTENT_TYPE], "application/problem+json");
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["code"], "route_not_found");
        assert_eq!(v["status"], 404);
        assert_eq!(v["request_id"], "abc123");
    }

    #[test]
    fn errors_keep_their_status_and_code() {
        let limit = error(&ProxyError::BodyTooLarge { limit: 10 });
        assert_eq!((limit.status.as_u16(), limit.code), (413, "payload_too_large"));
        assert_eq!(limit.detail, "the request body is over this route's limit of 10 bytes");
        assert_eq!(limit.headers[http::header::CONNECTION], "close");
        let t = error(&ProxyError::ResponseTimeout { timeout: std::time::Duration::from_millis(250) });
        assert_eq!((t.status.as_u16(), t.code), (504, "upstream_timeout"));
        assert_eq!(t.detail, "the backend did not answer within 250 ms");
        let allow = error(&ProxyError::MethodNotAllowed(HeaderValue::from_static("GET")));
        assert_eq!((allow.status.as_u16(), allow.code), (405, "method_not_allowed"));
        assert_eq!(allow.headers[http::header::ALLOW], "GET");
        assert_eq!(error(&ProxyError::NoEndpoint).code, "upstream_unavailable");
        let open = error(&ProxyError::CircuitOpen(std::time::Duration::from_millis(8_200)));
        assert_eq!((open.status.as_u16(), open.code), (503, "circuit_open"));
        assert_eq!(open.headers[http::header::RETRY_AFTER], "9");
        let shed = error(&ProxyError::Shed(postern_model::Priority::Free));
        assert_eq!((shed.status.as_u16(), shed.code), (503, "shed"));
        assert_eq!(shed.headers[http::header::RETRY_AFTER], "1");
        assert_eq!(shed.detail, "overloaded: free requests are being shed; try again shortly");
        assert_eq!(error(&ProxyError::UpstreamOverloaded).headers[http::header::RETRY_AFTER], "1");
        assert_eq!(error(&ProxyError::ClientShare).headers[http::header::RETRY_AFTER], "1");
    }
}

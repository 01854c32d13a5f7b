//! The one place where gateway errors become HTTP responses: `application/problem+json`
//! (RFC 9457) with a stable `code` and the request id.

use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Response, StatusCode};
use postern_filter_contract::{Problem, Reply};

use crate::body::ResponseBody;

const PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");

/// Standard problems, so every call site uses the same status and code.
pub mod problems {
    use http::StatusCode;
    use postern_filter_contract::Problem;
    use std::borrow::Cow;

    /// 404: no route for this host, method and path.
    pub fn route_not_found() -> Problem {
        Problem::new(StatusCode::NOT_FOUND, "route_not_found", "no route matches this host and path")
    }
    /// 405: the path exists with other methods.
    pub fn method_not_allowed(allow: http::HeaderValue) -> Problem {
        Problem::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "this route does not take this method")
            .with_header(http::header::ALLOW, allow)
    }
    /// 413: the body is over the route's limit.
    pub fn payload_too_large(limit: u64) -> Problem {
        Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("the request body is over this route's limit of {limit} bytes"),
        )
        .with_header(http::header::CONNECTION, http::HeaderValue::from_static("close"))
    }
    /// 400: the request path cannot be routed safely.
    pub fn invalid_path(detail: &'static str) -> Problem {
        Problem::new(StatusCode::BAD_REQUEST, "invalid_path", detail)
    }
    /// 400: malformed request.
    pub fn bad_request(detail: impl Into<Cow<'static, str>>) -> Problem {
        Problem::new(StatusCode::BAD_REQUEST, "bad_request", detail)
    }
    /// 502: the backend refused, reset or broke the exchange.
    pub fn upstream_unavailable(detail: impl Into<Cow<'static, str>>) -> Problem {
        Problem::new(StatusCode::BAD_GATEWAY, "upstream_unavailable", detail)
    }
    /// 504: the backend did not answer within the route's timeout.
    pub fn upstream_timeout(detail: impl Into<Cow<'static, str>>) -> Problem {
        Problem::new(StatusCode::GATEWAY_TIMEOUT, "upstream_timeout", detail)
    }
    /// 500: a gateway bug; never expected.
    pub fn internal(detail: impl Into<Cow<'static, str>>) -> Problem {
        Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", detail)
    }
}

/// Renders a problem; the body names the code, status, detail and request id.
pub fn problem(p: &Problem, request_id: &HeaderValue) -> Response<ResponseBody> {
    let title = p.status.canonical_reason().unwrap_or("Error");
    let body = serde_json::json!({
        "type": format!("https://postern.dev/problems/{}", p.code),
        "title": title,
        "status": p.status.as_u16(),
        "code": p.code,
        "detail": p.detail,
        "request_id": request_id.to_str().unwrap_or_default(),
    });
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
        let resp = problem(&problems::route_not_found(), &rid);
        assert_eq!(resp.status(), StatusCode::NOT_FOUND);
        assert_eq!(resp.headers()[CONTENT_TYPE], "application/problem+json");
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["code"], "route_not_found");
        assert_eq!(v["status"], 404);
        assert_eq!(v["request_id"], "abc123");
    }
}

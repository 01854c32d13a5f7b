//! The CLI's side of the control plane's API: one request with a bearer token.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use postern_model::protocol::MAX_WAIT_S;

/// One request to a control plane, as the CLI makes it, with an optional JSON body.
pub async fn request_with(
    method: &str,
    url: &str,
    token: &str,
    ca: Option<&std::path::Path>,
    body: Option<serde_json::Value>,
) -> anyhow::Result<(StatusCode, Bytes)> {
    let client = postern_model::tls::client(ca)?;
    let body = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
    let req = Request::builder()
        .method(method)
        .uri(url)
        .header(http::header::AUTHORIZATION, format!("Bearer {token}"))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))?;
    let resp = tokio::time::timeout(Duration::from_secs(MAX_WAIT_S + 10), client.request(req))
        .await
        .map_err(|_| anyhow::anyhow!("{url}: no answer"))?
        .map_err(|e| anyhow::anyhow!("{url}: {e}"))?;
    let status = resp.status();
    let body = resp.into_body().collect().await.map_err(|e| anyhow::anyhow!("{url}: {e}"))?.to_bytes();
    Ok((status, body))
}

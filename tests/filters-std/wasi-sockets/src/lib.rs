//! `wasi-sockets`: connects to `127.0.0.1:1` with `std::net`, so the component
//! imports `wasi:sockets`. The gateway must refuse to load it (a filter is granted
//! no network) or, if it loads, deny the connection.
//!
//! It forwards the request with `x-wasi-sockets: connected` or
//! `x-wasi-sockets: denied: <error kind>`, so a test can see which happened.

use postern_filter_sdk::{Context, Decision, Filter, Request, export_filter};

/// The filter.
pub struct WasiSockets;

impl Filter for WasiSockets {
    fn on_request(_req: &Request, _cx: &Context) -> Decision {
        let outcome = match std::net::TcpStream::connect("127.0.0.1:1") {
            Ok(_) => "connected".to_owned(),
            Err(e) => format!("denied: {:?}", e.kind()),
        };
        Decision::forward().set_header("x-wasi-sockets", outcome)
    }
}

export_filter!(WasiSockets);

#[cfg(test)]
mod tests {
    use super::*;
    use postern_filter_sdk::testing;

    // Natively this really tries 127.0.0.1:1 (loopback only), which is refused.
    #[test]
    fn reports_the_outcome_in_a_header() {
        let d = WasiSockets::on_request(&testing::request("GET", "/"), &testing::context());
        let v = d.edits().and_then(|e| e.set_value_str("x-wasi-sockets")).expect("header");
        assert!(v == "connected" || v.starts_with("denied: "), "{v}");
    }
}

//! `huge-body`: answers 200 with a 256 KiB body. The WIT contract asks for "a small
//! body"; the gateway must refuse a reply this large (or cap it) and fail the
//! request, not buffer it unchecked.
#![no_std]

use postern_filter_sdk::prelude::*;

/// The filter.
pub struct HugeBody;

/// The body's size.
pub const BODY_LEN: usize = 256 << 10;

impl Filter for HugeBody {
    fn on_request(_req: &Request, _cx: &Context) -> Decision {
        Decision::respond(200).header("content-type", "application/octet-stream").body(vec![b'b'; BODY_LEN])
    }
}

export_filter!(HugeBody);

#[cfg(test)]
mod tests {
    use super::*;
    use postern_filter_sdk::testing;

    #[test]
    fn replies_with_a_large_body() {
        let d = HugeBody::on_request(&testing::request("GET", "/"), &testing::context());
        let r = d.reply().expect("replied");
        assert_eq!(r.status, 200);
        assert_eq!(r.body.len(), BODY_LEN);
    }
}

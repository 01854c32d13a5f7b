//! `huge-header`: forwards the request with 1,000 set-headers of 1 KiB each (about
//! 10 MiB of edits). The gateway must refuse edits that large and fail the request,
//! not forward them or run out of memory.
#![no_std]

use postern_filter_sdk::prelude::*;

/// The filter.
pub struct HugeHeader;

/// How many headers.
pub const COUNT: usize = 1_000;
/// The size of each value.
pub const VALUE_LEN: usize = 1024;

impl Filter for HugeHeader {
    fn on_request(_req: &Request, _cx: &Context) -> Decision {
        // Built directly rather than with `Decision::set_header`, whose de-duplication
        // would make this quadratic.
        let set_headers = (0..COUNT).map(|i| (format!("x-huge-{i:05}"), vec![b'h'; VALUE_LEN])).collect();
        Decision::Continue(RequestEdits { set_headers, ..RequestEdits::default() })
    }
}

export_filter!(HugeHeader);

#[cfg(test)]
mod tests {
    extern crate alloc;

    use super::*;
    use postern_filter_sdk::testing;

    #[test]
    fn sets_ten_thousand_one_kib_headers() {
        let d = HugeHeader::on_request(&testing::request("GET", "/"), &testing::context());
        let e = d.edits().expect("forwarded");
        assert_eq!(e.set_headers.len(), COUNT);
        assert!(e.set_headers.iter().all(|(_, v)| v.len() == VALUE_LEN));
        let names: alloc::collections::BTreeSet<_> = e.set_headers.iter().map(|(n, _)| n).collect();
        assert_eq!(names.len(), COUNT);
    }
}

//! `memory-bomb`: allocates 1 MiB blocks, writes every byte and keeps them all,
//! until memory runs out. The gateway's memory limit must stop it (the failed
//! allocation aborts, which traps) and fail the request.
#![no_std]

use core::hint::black_box;

use postern_filter_sdk::prelude::*;

/// The filter.
pub struct MemoryBomb;

/// The size of each block.
pub const BLOCK: usize = 1 << 20;

impl Filter for MemoryBomb {
    fn on_request(_req: &Request, _cx: &Context) -> Decision {
        let mut blocks: Vec<Vec<u8>> = Vec::new();
        loop {
            // A non-zero fill writes every byte (fresh zeroed pages would not be
            // touched); `black_box` keeps the blocks from being optimised away.
            let block = vec![black_box(0xa5u8); BLOCK];
            blocks.push(black_box(block));
            black_box(&blocks);
        }
    }
}

export_filter!(MemoryBomb);

#[cfg(test)]
mod tests {
    use super::*;
    use postern_filter_sdk::testing;

    // `on_request` would exhaust this machine's memory, so only the other phases run.
    #[test]
    fn other_phases_are_harmless() {
        let req = testing::request("GET", "/");
        assert!(MemoryBomb::on_request_body(&req, b"", &testing::context()).is_forward());
        assert!(MemoryBomb::on_response(&testing::response(200), &testing::context()).is_empty());
    }
}

//! Generates the `orders.v1` messages, server and client from the orders team's proto,
//! compiled in pure Rust by `protox` (no `protoc` needed), and writes the compiled
//! descriptor set (with its imports, source info and the `google.api.http` method
//! options) to `OUT_DIR/orders_descriptor.bin`.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    let proto_dir = manifest_dir.join("../config/teams/orders/proto");
    for file in ["orders.proto", "google/api/annotations.proto", "google/api/http.proto"] {
        println!("cargo:rerun-if-changed={}", proto_dir.join(file).display());
    }
    let mut compiler = protox::Compiler::new([&proto_dir])?;
    compiler.include_imports(true).include_source_info(true).open_file("orders.proto")?;
    // Encoded by protox itself: `prost_types` has no room for extension options, so its
    // `encode_to_vec` would drop the HTTP rules.
    std::fs::write(out_dir.join("orders_descriptor.bin"), compiler.encode_file_descriptor_set())?;
    tonic_prost_build::configure().compile_fds(compiler.file_descriptor_set())?;
    Ok(())
}

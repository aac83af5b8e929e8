//! Compiles the .proto files with protox (pure Rust), so building needs no system `protoc`.

/// Messages that carry a `secrets` field.
const REDACTED_DEBUG: [&str; 2] = [
    "csi.v1.NodeStageVolumeRequest",
    "csi.v1.NodeExpandVolumeRequest",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/csi.proto", "proto/pluginregistration.proto"];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let descriptors = protox::compile(protos, ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Their `secrets` must not print: Debug is written by hand in lib.rs.
        .skip_debug(REDACTED_DEBUG)
        .compile_fds(descriptors)?;
    Ok(())
}

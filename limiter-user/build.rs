//! Points the agent at the eBPF object it embeds.
//!
//! `cargo xtask build` compiles that object on the pinned nightly and passes its path in
//! `LIMITER_EBPF_OBJECT`; a plain `cargo build` after one xtask build finds it at its default place.

use std::path::PathBuf;

fn main() {
    println!("cargo::rerun-if-env-changed=LIMITER_EBPF_OBJECT");
    let object = std::env::var_os("LIMITER_EBPF_OBJECT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../target/ebpf/bpfel-unknown-none/release/limiter")
        });
    if !object.is_file() {
        panic!(
            "the eBPF object {} is missing: build it with `cargo xtask build`",
            object.display()
        );
    }
    println!("cargo::rerun-if-changed={}", object.display());
    println!("cargo::rustc-env=LIMITER_EBPF_OBJECT={}", object.display());
}

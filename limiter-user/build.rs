//! Points the agent at the eBPF object it embeds.
//!
//! `cargo xtask build` compiles that object on the pinned nightly and passes its path in
//! `LIMITER_EBPF_OBJECT`; a plain `cargo build` after one xtask build finds it at its default
//! place. On a fresh clone there is no object yet, and `cargo check`, clippy and rust-analyzer
//! must still work there: the build embeds an empty stub instead, with a warning, and the agent
//! refuses to load it (`loader::LoadError::NoObject`) rather than failing somewhere obscure.

use std::path::PathBuf;

fn main() {
    println!("cargo::rerun-if-env-changed=LIMITER_EBPF_OBJECT");
    let explicit = std::env::var_os("LIMITER_EBPF_OBJECT").map(PathBuf::from);
    let object = explicit.clone().unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../target/ebpf/bpfel-unknown-none/release/limiter")
    });
    // Watched even while missing: cargo reruns this script until the object appears.
    println!("cargo::rerun-if-changed={}", object.display());
    if object.is_file() {
        println!("cargo::rustc-env=LIMITER_EBPF_OBJECT={}", object.display());
        return;
    }
    if explicit.is_some() {
        // Whoever named a path meant that object; a stub would hide their mistake.
        panic!(
            "LIMITER_EBPF_OBJECT names {}, which does not exist",
            object.display()
        );
    }
    println!(
        "cargo::warning=the eBPF object {} is missing, so this build embeds an empty stub: \
         it checks and lints, but the agent will not start. Build with `cargo xtask build`.",
        object.display()
    );
    let stub = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"))
        .join("limiter-ebpf-stub.o");
    std::fs::write(&stub, []).expect("writing the stub eBPF object");
    println!("cargo::rustc-env=LIMITER_EBPF_OBJECT={}", stub.display());
}

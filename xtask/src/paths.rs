//! Where things live, derived from the workspace root so that every command agrees.

use std::path::PathBuf;

/// The nightly that compiles the eBPF crate; bpf-linker is built against its own libLLVM.
pub const NIGHTLY: &str = "nightly-2026-05-19";
/// The bpf-linker release known to build against that nightly's LLVM.
pub const BPF_LINKER_VERSION: &str = "0.13.0";
/// Both supported hosts (x86_64, arm64) are little-endian.
pub const BPF_TARGET: &str = "bpfel-unknown-none";

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// The page `cargo xtask bench --write` writes the figures to.
pub fn benchmarks_page() -> PathBuf {
    root().join("docs/benchmarks.md")
}

pub fn target() -> PathBuf {
    root().join("target")
}

/// bpf-linker and the libLLVM links it loads through its rpath; kept inside the project.
pub fn bpf_toolchain() -> PathBuf {
    target().join("bpf-toolchain")
}

pub fn bpf_linker() -> PathBuf {
    bpf_toolchain().join("bin").join("bpf-linker")
}

pub fn ebpf_target_dir() -> PathBuf {
    target().join("ebpf")
}

/// The object the agent embeds.
pub fn ebpf_object() -> PathBuf {
    ebpf_target_dir()
        .join(BPF_TARGET)
        .join("release")
        .join("limiter")
}

pub fn agent_binary() -> PathBuf {
    target().join("release").join("limiter")
}

/// The mosquitto plugin, as `cargo xtask build` leaves it.
pub fn mosquitto_plugin() -> PathBuf {
    target().join("release").join("liblimiter_mosquitto.so")
}

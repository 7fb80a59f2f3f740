//! Builds the eBPF object on the pinned nightly, then the agent that embeds it.

use std::{path::PathBuf, process::Command};

use anyhow::{Context, Result, bail};

use crate::{
    paths::{self, BPF_TARGET, NIGHTLY},
    setup,
};

/// Environment a nested cargo must not inherit from the `cargo run` that started xtask.
const INHERITED: &[&str] = &[
    "RUSTUP_TOOLCHAIN",
    "RUSTC",
    "RUSTC_WRAPPER",
    "RUSTFLAGS",
    "CARGO_ENCODED_RUSTFLAGS",
    "CARGO_BUILD_RUSTFLAGS",
    "CARGO_TARGET_DIR",
];

/// A cargo command on the given toolchain, run from the workspace root, with a clean environment.
pub fn cargo(toolchain: &str) -> Command {
    let mut cmd = Command::new("rustup");
    cmd.args(["run", toolchain, "cargo"])
        .current_dir(paths::root());
    for var in INHERITED {
        cmd.env_remove(var);
    }
    cmd.env("LIMITER_EBPF_OBJECT", paths::ebpf_object());
    cmd
}

/// Runs a command, echoing it, and fails with its exit status.
pub fn status(cmd: &mut Command) -> Result<()> {
    let shown = format!("{cmd:?}");
    let st = cmd.status().with_context(|| format!("starting {shown}"))?;
    if !st.success() {
        bail!("{shown} failed: {st}");
    }
    Ok(())
}

/// Builds the kernel programs with BPF CPU v3 (atomic fetch-add and compare-and-swap) and BTF.
pub fn ebpf() -> Result<PathBuf> {
    setup::ensure()?;
    let bin = paths::bpf_toolchain().join("bin");
    let path = std::env::var_os("PATH").unwrap_or_default();
    let path = std::env::join_paths(std::iter::once(bin).chain(std::env::split_paths(&path)))?;
    status(
        cargo(NIGHTLY)
            .args(["build", "-Z", "build-std=core", "--target", BPF_TARGET])
            .args(["--release", "--bins", "-p", "limiter-ebpf", "--target-dir"])
            .arg(paths::ebpf_target_dir())
            .env("PATH", path)
            .env(
                "CARGO_ENCODED_RUSTFLAGS",
                ["-Cdebuginfo=2", "-Clink-arg=--btf", "-Ctarget-cpu=v3"].join("\x1f"),
            ),
    )?;
    Ok(paths::ebpf_object())
}

/// Builds the eBPF object and the release agent; returns the agent's path.
pub fn all() -> Result<PathBuf> {
    ebpf()?;
    status(cargo("stable").args([
        "build",
        "--release",
        "-p",
        "limiter-user",
        "--bin",
        "limiter",
    ]))?;
    Ok(paths::agent_binary())
}

/// Builds, then runs `limiter run ARGS`, through sudo when not already root.
pub fn run(args: &[String]) -> Result<()> {
    let agent = all()?;
    let mut cmd = if is_root() {
        Command::new(&agent)
    } else {
        let mut sudo = Command::new("sudo");
        sudo.arg("-E").arg(&agent);
        sudo
    };
    cmd.arg("run").args(args);
    status(&mut cmd)
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

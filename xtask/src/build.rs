//! Builds the eBPF object on the pinned nightly, then the agent that embeds it.

use std::{path::PathBuf, process::Command};

use anyhow::Result;

use crate::{
    cmd::{cargo, status},
    cross::{self, Target},
    paths::{self, BPF_TARGET, NIGHTLY},
    setup,
};

/// Builds the kernel programs with BPF CPU v3 (atomic fetch-add and compare-and-swap) and BTF.
///
/// `allows-misaligned-mem-access`: packet headers sit at any alignment (the IPv4 addresses of
/// an untagged frame at 2 mod 4), and without it LLVM reads every multi-byte field a byte at a
/// time. The kernels the agent supports run on x86_64 and arm64, which have efficient
/// unaligned access, so the verifier accepts misaligned packet and map-value reads.
pub fn ebpf() -> Result<PathBuf> {
    setup::ensure()?;
    let bin = paths::bpf_toolchain().join("bin");
    let path = std::env::var_os("PATH").unwrap_or_default();
    let path = std::env::join_paths(std::iter::once(bin).chain(std::env::split_paths(&path)))?;
    status(
        cargo(NIGHTLY)
            .args(["build", "-Z", "build-std=core", "--target", BPF_TARGET])
            .args(["--release", "--bins", "-p", "limiter-ebpf"])
            .args(["--features", "bpf", "--target-dir"])
            .arg(paths::ebpf_target_dir())
            .env("PATH", path)
            .env(
                "CARGO_ENCODED_RUSTFLAGS",
                [
                    "-Cdebuginfo=2",
                    "-Clink-arg=--btf",
                    "-Ctarget-cpu=v3",
                    "-Ctarget-feature=+allows-misaligned-mem-access",
                ]
                .join("\x1f"),
            ),
    )?;
    Ok(paths::ebpf_object())
}

/// Builds the eBPF object, the release agent and the mosquitto plugin; returns the agent's
/// path (the plugin is at [`paths::mosquitto_plugin`]).
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
    status(cargo("stable").args(["build", "--release", "-p", "limiter-mosquitto", "--lib"]))?;
    Ok(paths::agent_binary())
}

/// Builds the eBPF object and the release agent for another target; returns the agent's path.
pub fn cross(target: Target) -> Result<PathBuf> {
    ebpf()?;
    cross::ensure(target)?;
    let mut cmd = cargo("stable");
    cmd.args([
        "build",
        "--release",
        "-p",
        "limiter-user",
        "--bin",
        "limiter",
    ]);
    cross::configure(&mut cmd, target);
    status(&mut cmd)?;
    Ok(target.agent_binary())
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

//! Cross-building the agent for arm64 on an x86_64 machine (docs/architecture.md, "Kernels
//! under qemu"): the Rust target, Debian's aarch64 GCC as linker and C compiler, and qemu-user
//! to run what it builds. The eBPF object is the same for both: it is built once, for `bpfel`.

use std::{path::PathBuf, process::Command};

use anyhow::Result;
use clap::ValueEnum;

use crate::{
    cmd::{output, status},
    paths, setup,
};

/// A userspace target other than the host's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Target {
    /// arm64 Linux (aarch64-unknown-linux-gnu).
    Aarch64,
}

impl Target {
    pub fn triple(self) -> &'static str {
        match self {
            Self::Aarch64 => "aarch64-unknown-linux-gnu",
        }
    }

    /// Where the target's C libraries live on the build machine (Debian's cross packages).
    pub fn sysroot(self) -> PathBuf {
        match self {
            Self::Aarch64 => PathBuf::from("/usr/aarch64-linux-gnu"),
        }
    }

    /// The agent built for this target.
    pub fn agent_binary(self) -> PathBuf {
        paths::target()
            .join(self.triple())
            .join("release")
            .join("limiter")
    }
}

/// Installs the Rust target, the cross compiler and qemu-user when missing.
pub fn ensure(target: Target) -> Result<()> {
    setup::ensure_packages(&[
        ("/usr/bin/aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu"),
        (
            "/usr/aarch64-linux-gnu/lib/libc.so.6",
            "libc6-dev-arm64-cross",
        ),
        ("/usr/bin/qemu-aarch64", "qemu-user"),
    ])?;
    let installed = output(
        "rustup",
        &["target", "list", "--installed", "--toolchain", "stable"],
    )?;
    if !installed.lines().any(|l| l.trim() == target.triple()) {
        println!("setup: adding the Rust target {}", target.triple());
        status(Command::new("rustup").args([
            "target",
            "add",
            "--toolchain",
            "stable",
            target.triple(),
        ]))?;
    }
    Ok(())
}

/// Points a cargo command at the cross linker and C compiler, and runs what it builds (the
/// unit tests) under qemu-user with the target's libraries.
pub fn configure(cmd: &mut Command, target: Target) {
    match target {
        Target::Aarch64 => {
            cmd.env(
                "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER",
                "aarch64-linux-gnu-gcc",
            )
            .env("CC_aarch64_unknown_linux_gnu", "aarch64-linux-gnu-gcc")
            .env(
                "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER",
                format!("qemu-aarch64 -L {}", target.sysroot().display()),
            );
        }
    }
    cmd.args(["--target", target.triple()]);
}

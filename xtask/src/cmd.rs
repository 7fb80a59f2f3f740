//! Running other programs: the helpers every command shares. It sits below `setup`, `build`
//! and `test` and imports nothing but `paths`, so the modules above it only ever import
//! downwards.

use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::paths;

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

/// Runs a program outside any pinned toolchain and returns its standard output; fails with
/// its standard error.
pub fn output(program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .env_remove("RUSTUP_TOOLCHAIN")
        .output()
        .with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!(
            "{program} {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8(out.stdout)?)
}

//! `cargo xtask package`: the Debian package, built with cargo-deb from what `build` made, and
//! the check that it installs and runs.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::{
    build,
    cmd::{cargo, status},
    paths, setup,
};

/// Builds the agent, the plugin and the man page, then the .deb; returns its path.
pub fn build() -> Result<PathBuf> {
    setup::ensure_cargo_deb()?;
    build::all()?;
    let man = paths::target().join("release").join("man");
    std::fs::create_dir_all(&man).with_context(|| format!("creating {}", man.display()))?;
    status(
        cargo("stable")
            .args([
                "run",
                "-q",
                "--release",
                "-p",
                "limiter-user",
                "--example",
                "man",
                "--",
            ])
            .arg(man.join("limiter.1")),
    )?;
    let out = paths::target().join("debian");
    let _ = std::fs::remove_dir_all(&out);
    status(
        cargo("stable")
            .args([
                "deb",
                "-p",
                "limiter-user",
                "--no-build",
                "--no-strip",
                "--output",
            ])
            .arg(&out),
    )?;
    let deb = std::fs::read_dir(&out)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .with_context(|| format!("cargo deb left no .deb in {}", out.display()))?;
    println!("package: {}", deb.display());
    Ok(deb)
}

/// Every file the package must install, relative to the root.
const FILES: &[&str] = &[
    "usr/bin/limiter",
    "usr/lib/limiter/liblimiter_mosquitto.so",
    "lib/systemd/system/limiter.service",
    "etc/limiter.toml",
    "usr/share/man/man1/limiter.1",
];

/// Unpacks the package into a scratch root and runs the agent from there.
pub fn check(deb: &Path) -> Result<()> {
    let root = std::env::temp_dir().join(format!("limiter-deb-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let result = unpack_and_run(deb, &root);
    let _ = std::fs::remove_dir_all(&root);
    result
}

fn unpack_and_run(deb: &Path, root: &Path) -> Result<()> {
    status(Command::new("dpkg").arg("-x").arg(deb).arg(root))?;
    for file in FILES {
        // cargo-deb may compress the man page.
        let path = root.join(file);
        if !path.exists() && !path.with_extension("1.gz").exists() {
            bail!("the package lacks {file}");
        }
    }
    let out = Command::new(root.join("usr/bin/limiter"))
        .arg("--version")
        .output()
        .context("running the packaged limiter")?;
    let version = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || !version.starts_with("limiter ") {
        bail!(
            "the packaged `limiter --version` printed {version:?} ({})",
            out.status
        );
    }
    println!("package: installs and runs: {}", version.trim());
    Ok(())
}

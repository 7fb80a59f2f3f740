//! Installs the eBPF toolchain idempotently, as docs/architecture.md ("Toolchain") describes.

use std::{fs, os::unix::fs::symlink, path::Path, process::Command};

use anyhow::{Context, Result, bail};

use crate::{
    cmd::{output, status},
    paths::{self, BPF_LINKER_VERSION, NIGHTLY},
};

/// `rust-src` for `-Z build-std=core`; clippy to lint the eBPF crate on its own toolchain.
const NIGHTLY_COMPONENTS: &[&str] = &["rust-src", "clippy"];

/// Brings the machine to a state where the eBPF crate builds; prints only what it changes.
pub fn ensure() -> Result<()> {
    ensure_nightly()?;
    ensure_bpf_linker()
}

fn ensure_nightly() -> Result<()> {
    let installed = output("rustup", &["toolchain", "list"]).unwrap_or_default();
    let components = if installed.lines().any(|l| l.starts_with(NIGHTLY)) {
        output(
            "rustup",
            &["component", "list", "--installed", "--toolchain", NIGHTLY],
        )
        .unwrap_or_default()
    } else {
        String::new()
    };
    let missing: Vec<&str> = NIGHTLY_COMPONENTS
        .iter()
        .copied()
        .filter(|c| !components.lines().any(|l| l.starts_with(c)))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    println!("setup: installing {NIGHTLY} with {}", missing.join(", "));
    let mut cmd = Command::new("rustup");
    cmd.args(["toolchain", "install", NIGHTLY, "--profile", "minimal"]);
    for component in NIGHTLY_COMPONENTS {
        cmd.args(["--component", component]);
    }
    status(&mut cmd)
}

fn ensure_bpf_linker() -> Result<()> {
    let linker = paths::bpf_linker();
    let toolchain = paths::bpf_toolchain();
    let llvm = toolchain.join("llvm");
    let sysroot = output("rustc", &[&format!("+{NIGHTLY}"), "--print", "sysroot"])?;
    let soname = libllvm_soname(Path::new(sysroot.trim()))?;
    // The linker's rpath points at these links, so they must exist even when the binary does.
    link_libllvm(Path::new(sysroot.trim()), &soname, &llvm.join("lib"))?;
    if Command::new(&linker)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return Ok(());
    }
    let version = output("rustc", &[&format!("+{NIGHTLY}"), "-vV"])?;
    let major = version
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next())
        .context("the nightly does not report its LLVM version")?
        .to_string();
    println!(
        "setup: building bpf-linker {BPF_LINKER_VERSION} against {NIGHTLY}'s LLVM {major} (about 90 s)"
    );
    status(
        Command::new("cargo")
            .args([
                "install",
                &format!("bpf-linker@{BPF_LINKER_VERSION}"),
                "--locked",
                "--no-default-features",
                "--features",
                &format!("llvm-{major}"),
                "--root",
            ])
            .arg(&toolchain)
            .env("LLVM_PREFIX", &llvm)
            .env_remove("RUSTUP_TOOLCHAIN"),
    )?;
    let check = output(linker.to_str().context("non-UTF-8 path")?, &["--version"])?;
    println!("setup: {}", check.trim());
    Ok(())
}

fn libllvm_soname(sysroot: &Path) -> Result<String> {
    let lib = sysroot.join("lib");
    let entries = fs::read_dir(&lib).with_context(|| format!("reading {}", lib.display()))?;
    for entry in entries {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.starts_with("libLLVM.so.") || (name.starts_with("libLLVM-") && name.contains(".so"))
        {
            return Ok(name);
        }
    }
    bail!(
        "{NIGHTLY} ships no libLLVM shared library in {}",
        lib.display()
    )
}

/// Links the nightly's libLLVM under both the name the linker links against and the
/// name it loads at run time.
fn link_libllvm(sysroot: &Path, soname: &str, dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let source = sysroot.join("lib").join(soname);
    for name in ["libLLVM.so", soname] {
        let link = dir.join(name);
        if fs::read_link(&link).is_ok_and(|t| t == source) {
            continue;
        }
        let _ = fs::remove_file(&link);
        symlink(&source, &link).with_context(|| format!("linking {}", link.display()))?;
    }
    Ok(())
}

/// Programs the tests drive, and the Debian package of each: `ip` for the network
/// namespaces, the broker and its clients for the plugin's end-to-end test, `systemd-analyze`
/// to verify the unit, `promtool` to check and unit-test the alert rules, `redis-server` and
/// `redis-cli` for the fleet tests' own Redis servers and cluster. A minimal image may lack
/// any of them.
const TEST_TOOLS: &[(&str, &str)] = &[
    ("ip", "iproute2"),
    ("mosquitto", "mosquitto"),
    ("mosquitto_pub", "mosquitto-clients"),
    ("systemd-analyze", "systemd"),
    ("promtool", "prometheus"),
    ("redis-server", "redis-server"),
    ("redis-cli", "redis-tools"),
];

/// Installs the Debian packages of whichever [`TEST_TOOLS`] are missing, in one apt run.
pub fn ensure_test_tools() -> Result<()> {
    ensure_tools(TEST_TOOLS)
}

/// The firewalls `cargo xtask bench flood` measures limiter beside: nftables, and iptables
/// (its hashlimit, connlimit and SYNPROXY targets).
const BENCH_TOOLS: &[(&str, &str)] = &[("nft", "nftables"), ("iptables", "iptables")];

/// Installs the Debian packages of whichever [`BENCH_TOOLS`] are missing, in one apt run.
pub fn ensure_bench_tools() -> Result<()> {
    ensure_tools(BENCH_TOOLS)
}

/// Installs, through the package manager, the Debian package of each `(command, package)`
/// whose command is not on `PATH`; nothing when all are there.
pub fn ensure_tools(tools: &[(&str, &str)]) -> Result<()> {
    install(
        tools
            .iter()
            .filter(|(command, _)| !on_path(command))
            .map(|(_, package)| *package)
            .collect(),
    )
}

/// Installs `packages` with apt-get; does nothing (and touches no package index) when there
/// are none. Waits for the package database rather than failing when another install holds it.
fn install(packages: Vec<&str>) -> Result<()> {
    if packages.is_empty() {
        return Ok(());
    }
    println!("setup: installing {}", packages.join(", "));
    let lock = ["-o", "DPkg::Lock::Timeout=600"];
    status(Command::new("apt-get").args(lock).args(["update", "-q"]))?;
    status(
        Command::new("apt-get")
            .args(lock)
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&packages)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

/// `cargo xtask package` builds the .deb with cargo-deb, from crates.io.
pub fn ensure_cargo_deb() -> Result<()> {
    if Command::new("cargo")
        .args(["deb", "--version"])
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return Ok(());
    }
    println!("setup: installing cargo-deb (about 2 minutes)");
    status(
        Command::new("cargo")
            .args(["install", "cargo-deb", "--locked"])
            .env_remove("RUSTUP_TOOLCHAIN"),
    )
}

/// Whether `program` is an executable file in a directory of `PATH` (or the sbin
/// directories, where Debian puts the broker, even when they are not on a user's `PATH`).
fn on_path(program: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .any(|dir| dir.join(program).is_file())
}

/// The network-namespace tests drive `ip` (iproute2); a minimal image may lack it.
pub fn ensure_iproute2() -> Result<()> {
    ensure_tools(&[("ip", "iproute2")])
}

/// Installs through apt-get each package whose marker file is missing (for packages that put
/// nothing on `PATH`, such as kernels and cross libraries).
pub fn ensure_packages(packages: &[(&str, &str)]) -> Result<()> {
    install(
        packages
            .iter()
            .filter(|(marker, _)| !Path::new(marker).exists())
            .map(|(_, package)| *package)
            .collect(),
    )
}

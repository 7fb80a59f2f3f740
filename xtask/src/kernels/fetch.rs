//! The guests' ingredients from the package manager: qemu, busybox and cpio installed through
//! apt-get, kernel packages fetched with `apt-get download` and unpacked under target/.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use super::{Arch, Kernel};
use crate::{
    cmd::{output, status},
    paths, setup,
};

/// The tools every guest needs, as (file that shows it is installed, Debian package).
const TOOLS: &[(&str, &str)] = &[
    ("/usr/bin/qemu-system-x86_64", "qemu-system-x86"),
    ("/bin/busybox", "busybox-static"),
    ("/usr/bin/cpio", "cpio"),
];

/// An unpacked kernel package.
pub struct Fetched {
    /// The release, as `uname -r` prints it in the guest.
    pub release: String,
    pub vmlinuz: PathBuf,
    /// `lib/modules/<release>`.
    pub modules: PathBuf,
}

/// Installs what the guests of `arches` need; idempotent.
pub fn ensure_tools(arches: &[Arch]) -> Result<()> {
    setup::ensure_packages(TOOLS)?;
    if arches.contains(&Arch::Arm64) {
        ensure_foreign_arch("arm64")?;
        setup::ensure_packages(&[("/usr/bin/qemu-system-aarch64", "qemu-system-arm")])?;
    }
    Ok(())
}

/// Lets apt-get download packages of `arch` (the arm64 kernel and busybox).
fn ensure_foreign_arch(arch: &str) -> Result<()> {
    let known = output("dpkg", &["--print-foreign-architectures"])?;
    if known.lines().any(|l| l.trim() == arch) {
        return Ok(());
    }
    println!("setup: adding the {arch} package architecture");
    status(Command::new("dpkg").args(["--add-architecture", arch]))?;
    status(Command::new("apt-get").args(["update", "-q"]))
}

/// Where packages are downloaded and unpacked.
pub fn dir() -> PathBuf {
    paths::target().join("kernels")
}

/// The kernel package `kernel.package` (a meta-package) stands for today, downloaded and
/// unpacked once.
pub fn kernel(kernel: &Kernel) -> Result<Fetched> {
    let meta = qualified(kernel.package, kernel.arch);
    let package = resolve(&meta)?;
    let unpacked = dir().join(&package);
    unpack(&qualified(&package, kernel.arch), &unpacked)?;
    let boot = unpacked.join("boot");
    let vmlinuz = fs::read_dir(&boot)
        .with_context(|| format!("reading {}", boot.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))
        })
        .with_context(|| format!("{package} holds no boot/vmlinuz-*"))?;
    let release = vmlinuz
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("vmlinuz-"))
        .context("a vmlinuz without a release")?
        .to_string();
    let modules = unpacked.join("lib/modules").join(&release);
    Ok(Fetched {
        release,
        vmlinuz,
        modules,
    })
}

/// The arm64 packages a guest's userland takes from Debian: busybox, and iproute2 with the
/// libraries `ip` loads (the C library comes from the cross toolchain's sysroot).
const ARM64_USERLAND: &[&str] = &[
    "busybox-static",
    "iproute2",
    "libbpf1",
    "libelf1",
    "libmnl0",
    "libbsd0",
    "libcap2",
    "zlib1g",
    "libmd0",
];

/// The arm64 userland of [`ARM64_USERLAND`], unpacked into one root; returns the root.
pub fn arm64_root() -> Result<PathBuf> {
    let root = dir().join("arm64-root");
    for package in ARM64_USERLAND {
        unpack(&qualified(package, Arch::Arm64), &root)?;
    }
    Ok(root)
}

fn qualified(package: &str, arch: Arch) -> String {
    match arch {
        Arch::Amd64 => package.to_string(),
        Arch::Arm64 => format!("{package}:arm64"),
    }
}

/// The package a kernel meta-package depends on: `linux-image-cloud-amd64` →
/// `linux-image-6.1.0-57-cloud-amd64`.
fn resolve(meta: &str) -> Result<String> {
    let depends = output("apt-cache", &["depends", meta])?;
    depends
        .lines()
        .filter_map(|l| l.trim().strip_prefix("Depends: "))
        .map(|p| p.split(':').next().unwrap_or(p).to_string())
        .find(|p| p.starts_with("linux-image-"))
        .with_context(|| format!("{meta} depends on no linux-image package"))
}

/// Downloads `package` (apt-get download) and unpacks it into `into`, unless that is already
/// done.
fn unpack(package: &str, into: &Path) -> Result<()> {
    let name = package.split(':').next().unwrap_or(package);
    let done = into.join(format!(".{name}.unpacked"));
    if done.exists() {
        return Ok(());
    }
    let root = dir();
    fs::create_dir_all(&root)?;
    println!("kernels: downloading {package}");
    status(
        Command::new("apt-get")
            .args(["download", "-q", package])
            .current_dir(&root),
    )?;
    let deb = newest_deb(&root, name)?;
    status(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(into))?;
    fs::remove_file(&deb)?;
    fs::write(&done, b"")?;
    Ok(())
}

fn newest_deb(dir: &Path, name: &str) -> Result<PathBuf> {
    let prefix = format!("{name}_");
    let mut debs: Vec<PathBuf> = fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name().is_some_and(|n| {
                let n = n.to_string_lossy();
                n.starts_with(&prefix) && n.ends_with(".deb")
            })
        })
        .collect();
    debs.sort();
    match debs.pop() {
        Some(deb) => Ok(deb),
        None => bail!(
            "apt-get download left no {prefix}*.deb in {}",
            dir.display()
        ),
    }
}

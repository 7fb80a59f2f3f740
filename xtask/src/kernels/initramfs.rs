//! The guest's whole userland, one gzipped cpio: busybox, the agent, the test binaries,
//! iproute2's `ip` (the tests drive it), the libraries they load, the kernel's veth, clsact,
//! cls_bpf and TCP socket-diagnostics modules, and an `/init` that runs the tests and powers off.

use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use super::{Arch, Skip, fetch::Fetched};
use crate::cmd::{output, status};

/// The modules the tests need, which Debian's cloud kernels build as modules (each is used
/// only when the kernel has it as a module; built-in ones need nothing).
const MODULES: &[&str] = &[
    "drivers/net/veth",
    "net/sched/sch_ingress",
    "net/sched/cls_bpf",
    // The agent's socket table (`sock_diag` for TCP), which a host loads on demand and a
    // guest without modprobe cannot: inet_diag first, tcp_diag needs it.
    "net/ipv4/inet_diag",
    "net/ipv4/tcp_diag",
];

/// What goes into the guest besides the kernel's modules.
pub struct Payload {
    pub arch: Arch,
    pub busybox: PathBuf,
    pub agent: PathBuf,
    pub ip: PathBuf,
    /// (name, binary) of each test binary, run in this order.
    pub tests: Vec<(String, PathBuf)>,
    /// Where the binaries' shared libraries are looked up, in order.
    pub library_dirs: Vec<PathBuf>,
}

/// The guests' `LIMITER_TEST_SLOWDOWN` (tests/src/agent.rs): the factor on the tests' 20 s
/// agent-startup deadline. Under TCG, on this project's 2-core machines shared with builds,
/// the agent took up to 7 s to start (x86_64 6.1, the verifier most of it; arm64 6.1: 4 s),
/// so a factor of 3 leaves the same margin over a slow start as 20 s does on the host.
const SLOWDOWN: u32 = 3;

/// The markers `/init` prints, which the host reads from the serial console.
pub const RC_MARKER: &str = "KTEST-RC";
pub const END_MARKER: &str = "KTEST-END";

/// Builds the initramfs for `kernel` at `out`; its `/init` runs every test but `skips`.
pub fn build(kernel: &Fetched, payload: &Payload, skips: &[Skip], out: &Path) -> Result<()> {
    let stage = out.with_extension("d");
    let _ = fs::remove_dir_all(&stage);
    for dir in [
        "bin",
        "sbin",
        "usr/bin",
        "usr/sbin",
        "usr/local/sbin",
        "proc",
        "sys",
        "dev",
        "tmp",
        "run",
        "var",
        "modules",
        "tests",
        "lib",
        "lib64",
    ] {
        fs::create_dir_all(stage.join(dir))?;
    }
    std::os::unix::fs::symlink("/run", stage.join("var/run"))?;
    fs::copy(&payload.busybox, stage.join("bin/busybox"))
        .with_context(|| format!("copying {}", payload.busybox.display()))?;
    install(
        &payload.agent,
        &stage.join("usr/local/sbin/limiter"),
        payload.arch,
    )?;
    install(&payload.ip, &stage.join("usr/local/sbin/ip"), payload.arch)?;
    for (name, binary) in &payload.tests {
        install(binary, &stage.join("tests").join(name), payload.arch)?;
    }
    let mut binaries = vec![payload.agent.clone(), payload.ip.clone()];
    binaries.extend(payload.tests.iter().map(|(_, b)| b.clone()));
    copy_libraries(&binaries, payload, &stage)?;
    let modules = copy_modules(kernel, &stage)?;
    fs::write(stage.join("init"), init_script(&modules, payload, skips))?;
    set_executable(&stage.join("init"))?;
    status(Command::new("sh").arg("-c").arg(format!(
        "cd '{}' && find . | cpio -o -H newc --quiet | gzip -1 > '{}'",
        stage.display(),
        out.display()
    )))?;
    fs::remove_dir_all(&stage)?;
    Ok(())
}

/// Copies a binary without its debug information: the test binaries shrink tenfold, and the
/// whole initramfs lives in the guest's memory.
fn install(from: &Path, to: &Path, arch: Arch) -> Result<()> {
    let strip = match arch {
        Arch::Amd64 => "strip",
        Arch::Arm64 => "aarch64-linux-gnu-strip",
    };
    status(
        Command::new(strip)
            .arg("--strip-debug")
            .arg("-o")
            .arg(to)
            .arg(from),
    )
}

fn set_executable(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// Every shared library the binaries need, transitively (their `NEEDED` entries, found in
/// the payload's library directories), and the dynamic loader; the guest finds them through
/// `LD_LIBRARY_PATH=/lib`.
fn copy_libraries(binaries: &[PathBuf], payload: &Payload, stage: &Path) -> Result<()> {
    let mut seen = BTreeSet::new();
    let mut todo: Vec<PathBuf> = binaries.to_vec();
    while let Some(binary) = todo.pop() {
        let dynamic = output(
            "readelf",
            &["-d", "-l", binary.to_str().context("non-UTF-8 path")?],
        )?;
        for line in dynamic.lines() {
            if let Some(interp) = line
                .trim()
                .strip_prefix("[Requesting program interpreter: ")
                .and_then(|l| l.strip_suffix(']'))
            {
                let from =
                    find_library(Path::new(interp).file_name().context("no name")?, payload)?;
                let to = stage.join(interp.trim_start_matches('/'));
                fs::create_dir_all(to.parent().context("no parent")?)?;
                fs::copy(&from, &to).with_context(|| format!("copying {}", from.display()))?;
            }
            let Some(name) = line
                .split("Shared library: [")
                .nth(1)
                .and_then(|l| l.split(']').next())
            else {
                continue;
            };
            if seen.insert(name.to_string()) {
                let from = find_library(name.as_ref(), payload)?;
                fs::copy(&from, stage.join("lib").join(name))
                    .with_context(|| format!("copying {}", from.display()))?;
                todo.push(from);
            }
        }
    }
    Ok(())
}

fn find_library(name: &std::ffi::OsStr, payload: &Payload) -> Result<PathBuf> {
    payload
        .library_dirs
        .iter()
        .map(|dir| dir.join(name))
        .find(|p| p.exists())
        .with_context(|| {
            format!(
                "{} is in none of {:?}",
                name.to_string_lossy(),
                payload.library_dirs
            )
        })
}

/// The modules of [`MODULES`] the kernel has as modules, decompressed (busybox `insmod` takes
/// plain `.ko`); returns their names in the guest, in load order.
fn copy_modules(kernel: &Fetched, stage: &Path) -> Result<Vec<String>> {
    let builtin = fs::read_to_string(kernel.modules.join("modules.builtin")).unwrap_or_default();
    let mut names = Vec::new();
    for module in MODULES {
        let base = kernel.modules.join("kernel").join(module);
        let name = format!(
            "{}.ko",
            Path::new(module)
                .file_name()
                .context("no name")?
                .to_string_lossy()
        );
        let to = stage.join("modules").join(&name);
        let plain = base.with_extension("ko");
        let xz = base.with_extension("ko.xz");
        if plain.exists() {
            fs::copy(&plain, &to)?;
        } else if xz.exists() {
            let out = Command::new("xz")
                .arg("-dc")
                .arg(&xz)
                .output()
                .context("running xz")?;
            if !out.status.success() {
                bail!("xz -dc {} failed", xz.display());
            }
            fs::write(&to, out.stdout)?;
        } else if builtin.contains(&format!("kernel/{module}.ko")) {
            continue;
        } else {
            bail!("kernel {} has no {module} module", kernel.release);
        }
        names.push(name);
    }
    Ok(names)
}

/// Mounts what the agent and the tests use, loads the modules, runs each test binary one test
/// at a time (the guest has one CPU), prints a marker with each exit status, and powers off.
fn init_script(modules: &[String], payload: &Payload, skips: &[Skip]) -> String {
    let mut script = format!(
        "#!/bin/busybox sh\n\
         /bin/busybox --install -s\n\
         export PATH=/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin\n\
         export LD_LIBRARY_PATH=/lib\n\
         export LIMITER_BIN=/usr/local/sbin/limiter\n\
         export LIMITER_TEST_SLOWDOWN={SLOWDOWN}\n\
         mount -t proc proc /proc\n\
         mount -t sysfs sys /sys\n\
         mount -t devtmpfs dev /dev\n\
         mount -t tmpfs tmp /tmp\n\
         mount -t tmpfs run /run\n\
         mount -t bpf bpf /sys/fs/bpf\n",
    );
    for module in modules {
        script.push_str(&format!("insmod /modules/{module}\n"));
    }
    script.push_str("ip link set lo up\necho \"guest kernel $(uname -r)\"\n");
    let skip: String = skips
        .iter()
        .map(|(test, _)| format!(" --skip {test}"))
        .collect();
    for (name, _) in &payload.tests {
        script.push_str(&format!(
            "/tests/{name} --test-threads=1{skip}\necho \"{RC_MARKER} {name} $?\"\n"
        ));
    }
    script.push_str(&format!("echo {END_MARKER}\npoweroff -f\n"));
    script
}

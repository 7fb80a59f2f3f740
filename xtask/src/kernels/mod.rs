//! `cargo xtask test-kernels`: the agent and the privileged tests that prove it (starting,
//! attaching on a veth in namespaces the tests make, TCP caps enforced end to end, adoption
//! after SIGKILL, detach) on every kernel the project claims and this machine can get: the
//! host's, run directly, and Debian's kernel packages booted under qemu (TCG).
//!
//! Its own command, not part of `cargo xtask test`: a run takes many minutes of emulation.
//! Submodules import only `crate::{cmd, paths, setup, build}` and each other downwards:
//! `fetch` and `qemu` know nothing of the others, `initramfs` takes what `fetch` unpacked.

mod fetch;
mod initramfs;
mod qemu;

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::{
    build,
    cmd::cargo,
    cross::{self, Target},
};
use initramfs::{Payload, RC_MARKER};

/// An architecture the agent runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Arch {
    Amd64,
    Arm64,
}

impl Arch {
    fn name(self) -> &'static str {
        match self {
            Self::Amd64 => "x86_64",
            Self::Arm64 => "arm64",
        }
    }
}

/// A kernel to boot: a Debian meta-package, resolved to today's package of that series.
pub struct Kernel {
    pub arch: Arch,
    pub package: &'static str,
}

/// The kernels booted under qemu: Debian 12's own 6.1, and its 6.12 builds, on both
/// architectures.
const KERNELS: &[Kernel] = &[
    Kernel {
        arch: Arch::Amd64,
        package: "linux-image-cloud-amd64",
    },
    Kernel {
        arch: Arch::Amd64,
        package: "linux-image-6.12-cloud-amd64",
    },
    Kernel {
        arch: Arch::Arm64,
        package: "linux-image-cloud-arm64",
    },
    Kernel {
        arch: Arch::Arm64,
        package: "linux-image-6.12-cloud-arm64",
    },
];

/// The privileged test binaries the guests run: the agent end to end (start, attach,
/// caps, adoption after SIGKILL, reload, detach) and real TCP through the loaded datapath.
const TESTS: &[&str] = &["agent_e2e", "netns_tcp"];

/// How long one guest may take: a bound for failing, not a figure. TCG runs the tests many
/// times slower than the host (an x86_64 6.1 guest: about 5 minutes for `netns_tcp` and a
/// minute a test of `agent_e2e`), and an arm64 guest on an x86_64 host slower still.
fn guest_timeout(arch: Arch) -> Duration {
    match arch {
        Arch::Amd64 => Duration::from_secs(2400),
        Arch::Arm64 => Duration::from_secs(4200),
    }
}

/// A test a row leaves out, as (name, why): passed to the harness as `--skip name`, and named
/// with its reason in the table.
type Skip = (&'static str, &'static str);

/// The privileged tests the guests leave out.
const GUEST_SKIPS: &[Skip] = &[(
    "a_spoofed_syn_flood_locks_no_real_client_out",
    "a load test: under TCG the guest sends only part of its 200,000 spoofed SYNs within the \
     test's 30 s bound (x86_64 6.1: 56,353); it runs on the host's kernel",
)];

/// The unit tests qemu-user cannot run. A name ending in `::tests::` is a whole module's
/// (libtest's `--skip` matches a substring), so a test added there later is left out too.
const QEMU_USER_SKIPS: &[Skip] = &[(
    "datapath::sockets::tests::",
    "qemu-user has no NETLINK_SOCK_DIAG (the guests' agents use it)",
)];

/// One row of the matrix.
struct Row {
    kernel: String,
    arch: Arch,
    how: &'static str,
    /// What ran, in words, including what was left out.
    tests: String,
    passed: u64,
    failed: u64,
    took: Duration,
    ok: bool,
}

/// `cargo xtask setup`'s share: the tools and kernel packages the guests need.
pub fn setup() -> Result<()> {
    let arches: Vec<Arch> = KERNELS.iter().map(|k| k.arch).collect();
    fetch::ensure_tools(&arches)?;
    for kernel in KERNELS {
        fetch::kernel(kernel)?;
    }
    Ok(())
}

/// Runs the matrix, or only the rows of `only` (the host's kernel counts as amd64).
pub fn run(only: Option<Arch>) -> Result<()> {
    if !build::is_root() {
        bail!(
            "test-kernels runs the privileged tests: run it as root (`sudo -E cargo xtask test-kernels`)"
        );
    }
    setup()?;
    crate::setup::ensure_iproute2()?;
    let wanted = |arch: Arch| only.is_none_or(|only| only == arch);
    let mut rows = Vec::new();
    if wanted(Arch::Amd64) {
        rows.extend(amd64_rows()?);
    }
    if wanted(Arch::Arm64) {
        rows.extend(arm64_rows()?);
    }
    print_table(&rows);
    let passed = rows.iter().filter(|r| r.ok).count();
    let failed = rows.len() - passed;
    println!("kernels: {passed} passed, {failed} failed");
    if failed > 0 {
        bail!("{failed} kernel(s) failed");
    }
    Ok(())
}

/// The host's kernel, then the x86_64 guests.
fn amd64_rows() -> Result<Vec<Row>> {
    let agent = build::all()?;
    let tests = test_binaries(None)?;
    let mut rows = vec![host_row(&agent, &tests)?];
    let amd64 = Payload {
        arch: Arch::Amd64,
        busybox: PathBuf::from("/bin/busybox"),
        agent,
        ip: PathBuf::from("/usr/sbin/ip"),
        tests,
        library_dirs: [
            "/lib/x86_64-linux-gnu",
            "/usr/lib/x86_64-linux-gnu",
            "/lib64",
        ]
        .map(PathBuf::from)
        .to_vec(),
    };
    for kernel in KERNELS.iter().filter(|k| k.arch == Arch::Amd64) {
        rows.push(guest_row(kernel, &amd64)?);
    }
    Ok(rows)
}

/// The arm64 agent's unit tests under qemu-user, then the arm64 guests.
fn arm64_rows() -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let arm64 = Target::Aarch64;
    let arm64_agent = build::cross(arm64)?;
    rows.push(qemu_user_row(arm64)?);
    let arm64_root = fetch::arm64_root()?;
    let arm64 = Payload {
        arch: Arch::Arm64,
        busybox: arm64_root.join("bin/busybox"),
        agent: arm64_agent,
        ip: arm64_root.join("bin/ip"),
        tests: test_binaries(Some(arm64))?,
        library_dirs: vec![
            arm64_root.join("lib/aarch64-linux-gnu"),
            arm64_root.join("usr/lib/aarch64-linux-gnu"),
            arm64.sysroot().join("lib"),
        ],
    };
    for kernel in KERNELS.iter().filter(|k| k.arch == Arch::Arm64) {
        rows.push(guest_row(kernel, &arm64)?);
    }
    Ok(rows)
}

/// Builds the privileged test binaries without running them; returns (name, path) of each of
/// [`TESTS`], read from cargo's JSON messages.
fn test_binaries(target: Option<Target>) -> Result<Vec<(String, PathBuf)>> {
    let mut cmd = cargo("stable");
    cmd.args([
        "test",
        "-p",
        "limiter-tests",
        "--no-run",
        "--message-format=json",
    ]);
    for test in TESTS {
        cmd.args(["--test", test]);
    }
    if let Some(target) = target {
        cross::configure(&mut cmd, target);
    }
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .context("building the test binaries")?;
    if !out.status.success() {
        bail!("building the test binaries failed");
    }
    let mut found = Vec::new();
    for line in String::from_utf8(out.stdout)?.lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let name = message["target"]["name"].as_str().unwrap_or_default();
        if let (Some(executable), true) = (
            message["executable"].as_str(),
            TESTS.contains(&name) && message["profile"]["test"].as_bool() == Some(true),
        ) {
            found.push((name.to_string(), PathBuf::from(executable)));
        }
    }
    if found.len() != TESTS.len() {
        bail!("cargo built {found:?}, not every one of {TESTS:?}");
    }
    Ok(found)
}

/// What a row runs, in words: `what`, and the tests it leaves out, each with its reason.
fn described(what: &str, skips: &[Skip]) -> String {
    let mut text = what.to_string();
    for (i, (test, why)) in skips.iter().enumerate() {
        let name = match test.strip_suffix("::tests::") {
            Some(module) => format!("{module}'s tests"),
            None => test.rsplit("::").next().unwrap_or(test).to_string(),
        };
        text.push_str(if i == 0 { " but " } else { "; " });
        text.push_str(&format!("`{name}` ({why})"));
    }
    text
}

/// The host's own kernel, no emulation: the same binaries run directly.
fn host_row(agent: &Path, tests: &[(String, PathBuf)]) -> Result<Row> {
    let started = Instant::now();
    let kernel = crate::cmd::output("uname", &["-r"])?.trim().to_string();
    let _bpffs = crate::bpffs::Restore::new();
    let mut lines = Vec::new();
    for (name, binary) in tests {
        let out = Command::new(binary)
            .arg("--test-threads=1")
            .env("LIMITER_BIN", agent)
            .output()
            .with_context(|| format!("running {name}"))?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        print!("{text}");
        lines.extend(text.lines().map(str::to_string));
        lines.push(format!(
            "{RC_MARKER} {name} {}",
            out.status.code().unwrap_or(-1)
        ));
    }
    Ok(score(
        kernel,
        Arch::Amd64,
        "host",
        described(&TESTS.join(", "), &[]),
        &lines,
        true,
        started.elapsed(),
    ))
}

/// The unit tests of every userspace crate (`--lib --bins`), built for `target` and run under
/// qemu-user (the runner `cross::configure` sets): the agent's logic on the other
/// architecture, no kernel involved, but for [`QEMU_USER_SKIPS`]. Integration tests are left
/// out: some start the agent binary, which a process under qemu-user cannot exec without
/// binfmt_misc.
fn qemu_user_row(target: Target) -> Result<Row> {
    let started = Instant::now();
    let mut cmd = cargo("stable");
    cmd.args([
        "test",
        "--workspace",
        "--exclude",
        "limiter-ebpf",
        "--exclude",
        "limiter-tests",
        "--lib",
        "--bins",
    ]);
    cross::configure(&mut cmd, target);
    // After `--target`: what follows `--` goes to the test binaries.
    cmd.arg("--");
    for (test, _) in QEMU_USER_SKIPS {
        cmd.args(["--skip", test]);
    }
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .context("running the unit tests under qemu-user")?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    print!("{text}");
    let lines: Vec<String> = text.lines().map(str::to_string).collect();
    let mut row = score(
        "unit tests".to_string(),
        Arch::Arm64,
        "qemu-user",
        described("every crate's unit tests", QEMU_USER_SKIPS),
        &lines,
        true,
        started.elapsed(),
    );
    row.ok = out.status.success() && row.passed > 0 && row.failed == 0;
    Ok(row)
}

fn guest_row(kernel: &Kernel, payload: &Payload) -> Result<Row> {
    let started = Instant::now();
    let fetched = fetch::kernel(kernel)?;
    let arch = kernel.arch;
    let initrd = fetch::dir().join(format!("initramfs-{}.cpio.gz", fetched.release));
    initramfs::build(&fetched, payload, GUEST_SKIPS, &initrd)?;
    let tag = format!("{} {}", arch.name(), fetched.release);
    let console = qemu::boot(arch, &fetched.vmlinuz, &initrd, &tag, guest_timeout(arch))?;
    Ok(score(
        fetched.release.clone(),
        arch,
        "qemu (TCG)",
        described(&TESTS.join(", "), GUEST_SKIPS),
        &console.lines,
        console.finished,
        started.elapsed(),
    ))
}

/// Adds up the harness's "test result:" lines; a kernel passes when every test binary ran
/// to the end with status 0, something passed and nothing failed or was ignored.
fn score(
    kernel: String,
    arch: Arch,
    how: &'static str,
    tests: String,
    lines: &[String],
    finished: bool,
    took: Duration,
) -> Row {
    let (mut passed, mut failed, mut ignored) = (0, 0, 0);
    let mut statuses = Vec::new();
    for line in lines {
        if let Some(rest) = line.split("test result: ").nth(1) {
            for part in rest.split(['.', ';']) {
                let mut words = part.split_whitespace();
                if let (Some(n), Some(what)) = (words.next(), words.next()) {
                    let n: u64 = n.parse().unwrap_or(0);
                    match what {
                        "passed" => passed += n,
                        "failed" => failed += n,
                        "ignored" => ignored += n,
                        _ => {}
                    }
                }
            }
        }
        if let Some(rest) = line.split(&format!("{RC_MARKER} ")).nth(1) {
            statuses.push(rest.split_whitespace().nth(1) == Some("0"));
        }
    }
    let ok = finished
        && statuses.len() == TESTS.len()
        && statuses.iter().all(|&s| s)
        && passed > 0
        && failed == 0
        && ignored == 0;
    Row {
        kernel,
        arch,
        how,
        tests,
        passed,
        failed,
        took,
        ok,
    }
}

fn print_table(rows: &[Row]) {
    println!();
    println!("| kernel | arch | run | tests | passed | failed | took | result |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for row in rows {
        println!(
            "| {} | {} | {} | {} | {} | {} | {}:{:02} | {} |",
            row.kernel,
            row.arch.name(),
            row.how,
            row.tests,
            row.passed,
            row.failed,
            row.took.as_secs() / 60,
            row.took.as_secs() % 60,
            if row.ok { "pass" } else { "FAIL" }
        );
    }
}

//! `cargo xtask test`, `cargo xtask fuzz` and `cargo xtask bench`.

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};

use crate::{
    build,
    cmd::{cargo, output, status},
    package,
    paths::{self, BPF_TARGET, NIGHTLY},
    setup,
};

/// The package holding every test that needs root, BPF and network namespaces.
const PRIVILEGED: &str = "limiter-tests";

pub fn run() -> Result<()> {
    setup::ensure()?;
    step("formatting");
    status(cargo("stable").args(["fmt", "--all", "--check"]))?;
    step("eBPF build");
    build::ebpf()?;
    step("clippy (userspace)");
    status(cargo("stable").args([
        "clippy",
        "--workspace",
        "--exclude",
        "limiter-ebpf",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    step("clippy (eBPF)");
    status(
        cargo(NIGHTLY)
            .args(["clippy", "-Z", "build-std=core", "--target", BPF_TARGET])
            .args(["--release", "-p", "limiter-ebpf"])
            .args(["--features", "bpf", "--target-dir"])
            .arg(paths::ebpf_target_dir())
            .args(["--", "-D", "warnings"]),
    )?;
    step("unit tests");
    status(cargo("stable").args([
        "test",
        "--workspace",
        "--exclude",
        "limiter-ebpf",
        "--exclude",
        PRIVILEGED,
    ]))?;
    step("package");
    let deb = package::build()?;
    package::check(&deb)?;
    let agent = paths::agent_binary();
    step("privileged tests");
    let bpffs = preflight()?;
    // Every test binary runs even after one fails, so a failure never hides the others'.
    let counts = run_counting(
        cargo("stable")
            .args(["test", "--no-fail-fast", "-p", PRIVILEGED])
            .env("LIMITER_BIN", &agent)
            .env("LIMITER_MOSQUITTO_PLUGIN", paths::mosquitto_plugin()),
    );
    drop(bpffs);
    let counts = counts?;
    // The last line, in the plain "N passed, N failed" form CI reads.
    println!(
        "privileged: {} passed, {} failed",
        counts.passed, counts.failed
    );
    if counts.failed > 0 || counts.ignored > 0 || !counts.ok {
        bail!(
            "privileged tests: {} failed, {} ignored",
            counts.failed,
            counts.ignored
        );
    }
    if counts.passed == 0 {
        bail!("no privileged test ran");
    }
    Ok(())
}

/// The differential test (`tests/tests/model.rs`) with `frames` frames, optimised: the
/// frames and the model cost more than the programs in a debug build. The seed comes from
/// the clock unless given, and is printed so a failure can be replayed.
pub fn fuzz(frames: u64, seed: Option<u64>) -> Result<()> {
    let agent = build::all()?;
    let _bpffs = preflight()?;
    let seed = match seed {
        Some(seed) => seed,
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .context("the clock is before 1970")?
            .as_nanos() as u64,
    };
    step(&format!("fuzz: {frames} frames, seed {seed}"));
    status(
        cargo("stable")
            .args(["test", "-p", PRIVILEGED, "--test", "model", "--release"])
            .args(["--", "--nocapture"])
            .env("LIMITER_BIN", &agent)
            .env("LIMITER_FUZZ_FRAMES", frames.to_string())
            .env("LIMITER_MODEL_SEED", seed.to_string()),
    )
}

pub fn bench_kernel(page: Option<&(PathBuf, String)>) -> Result<()> {
    let agent = build::all()?;
    let _bpffs = preflight()?;
    status(reported(
        cargo("stable")
            .args(["bench", "-p", PRIVILEGED, "--bench", "kernel"])
            .env("LIMITER_BIN", &agent),
        page,
    ))
}

/// The files a bench run writes itself: changes to them do not make a tree dirty for the
/// next run.
const BENCH_OUTPUT: [&str; 2] = ["docs/benchmarks.md", "README.md"];

/// The commit `--write` stamps the figures with. The figures must come from code anyone can
/// check out, so a tree with changes beyond the bench's own output is refused, naming them.
pub fn measured_commit() -> Result<String> {
    let root = paths::root();
    let root = root.to_str().context("a UTF-8 workspace path")?;
    let changed = output("git", &["-C", root, "status", "--porcelain"])?;
    let dirty: Vec<&str> = changed
        .lines()
        .filter(|line| !BENCH_OUTPUT.iter().any(|path| line.get(3..) == Some(*path)))
        .collect();
    if !dirty.is_empty() {
        bail!(
            "bench --write measures a commit, and the tree differs from it (commit or stash \
             first):\n{}",
            dirty.join("\n")
        );
    }
    Ok(
        output("git", &["-C", root, "rev-parse", "--short", "HEAD"])?
            .trim()
            .to_owned(),
    )
}

/// A bench that writes its report into `page` as well as printing it (see
/// `limiter_tests::report`), stamped with the commit [`measured_commit`] checked.
fn reported<'a>(bench: &'a mut Command, page: Option<&(PathBuf, String)>) -> &'a mut Command {
    if let Some((page, commit)) = page {
        bench
            .env("LIMITER_BENCH_WRITE", page)
            .env("LIMITER_BENCH_COMMIT", commit);
    }
    bench
}

/// The firewalls it is compared with come from Debian's packages.
pub fn bench_flood(sources: &[u32], spoofed: bool, page: Option<&(PathBuf, String)>) -> Result<()> {
    let agent = build::all()?;
    let _bpffs = preflight()?;
    setup::ensure_bench_tools()?;
    let mut bench = cargo("stable");
    bench
        .args(["bench", "-p", PRIVILEGED, "--bench", "flood", "--"])
        .env("LIMITER_BIN", &agent);
    if spoofed {
        bench.arg("--spoofed");
    }
    if !sources.is_empty() {
        let sources: Vec<String> = sources.iter().map(u32::to_string).collect();
        bench.args(["--sources", &sources.join(",")]);
    }
    status(reported(&mut bench, page))
}

/// The application-layer limiter needs no privileges: it is measured in process and over
/// its socket, and its fleet mode against a `redis-server` the bench starts (from the tests' harness).
pub fn bench_app(page: Option<&(PathBuf, String)>) -> Result<()> {
    build::ebpf()?;
    status(reported(
        cargo("stable").args(["bench", "-p", PRIVILEGED, "--bench", "app"]),
        page,
    ))?;
    crate::setup::ensure_tools(&[
        ("redis-server", "redis-server"),
        ("redis-cli", "redis-tools"),
    ])?;
    status(reported(
        cargo("stable").args(["bench", "-p", PRIVILEGED, "--bench", "fleet"]),
        page,
    ))
}

fn step(name: &str) {
    println!("==> {name}");
}

/// Privileged tests never skip: where they cannot run, say why and fail. Keep the guard it
/// returns while they run: a BPF filesystem their agents mounted is taken down with it.
fn preflight() -> Result<crate::bpffs::Restore> {
    if !build::is_root() {
        bail!(
            "the privileged tests need root (BPF and network namespaces): run `sudo -E cargo xtask test`"
        );
    }
    if !Path::new("/sys/fs/bpf").is_dir() {
        bail!(
            "/sys/fs/bpf is missing: this kernel has no BPF filesystem, so the privileged tests cannot run"
        );
    }
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        bail!("this kernel exposes no BTF (/sys/kernel/btf/vmlinux): the kernel programs need it");
    }
    setup::ensure_test_tools()?;
    Ok(crate::bpffs::Restore::new())
}

#[derive(Default)]
struct Counts {
    passed: u64,
    failed: u64,
    ignored: u64,
    ok: bool,
}

/// Runs a `cargo test`, echoing its output, and adds up every "test result:" line.
fn run_counting(cmd: &mut Command) -> Result<Counts> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .context("starting cargo test")?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut counts = Counts::default();
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        println!("{line}");
        if let Some(rest) = line.strip_prefix("test result: ") {
            for part in rest.split(['.', ';']) {
                let mut words = part.split_whitespace();
                if let (Some(n), Some(what)) = (words.next(), words.next()) {
                    let n: u64 = n.parse().unwrap_or(0);
                    match what {
                        "passed" => counts.passed += n,
                        "failed" => counts.failed += n,
                        "ignored" => counts.ignored += n,
                        _ => {}
                    }
                }
            }
        }
    }
    counts.ok = child.wait()?.success();
    Ok(counts)
}

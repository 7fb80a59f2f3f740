//! Boots a kernel and its initramfs under qemu with TCG (KVM guests hang on these machines:
//! docs/architecture.md, "Kernels under qemu") and collects what the guest prints on its
//! serial console.

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};

use super::{Arch, initramfs::END_MARKER};

/// The guest's serial output, and whether it reached its end marker before the deadline.
pub struct Console {
    pub lines: Vec<String>,
    pub finished: bool,
}

/// Boots `vmlinuz` with `initrd`, echoing the console prefixed with `tag`, and stops the guest
/// once it prints the end marker, exits, or `timeout` passes.
pub fn boot(
    arch: Arch,
    vmlinuz: &Path,
    initrd: &Path,
    tag: &str,
    timeout: Duration,
) -> Result<Console> {
    let mut cmd = match arch {
        Arch::Amd64 => {
            let mut cmd = Command::new("qemu-system-x86_64");
            cmd.args(["-append", "console=ttyS0 rdinit=/init panic=-1 quiet"]);
            cmd
        }
        Arch::Arm64 => {
            let mut cmd = Command::new("qemu-system-aarch64");
            // Debian's arm64 kernels sign and check return addresses with pointer
            // authentication; TCG computes the architected QARMA5 cipher for each, which made
            // the kernel (the verifier above all) about six times slower: the agent took 24 s
            // to start on 6.1, 4 s with qemu's cheap implementation-defined algorithm.
            cmd.args(["-M", "virt", "-cpu", "max,pauth-impdef=on"]);
            cmd.args(["-append", "console=ttyAMA0 rdinit=/init panic=-1 quiet"]);
            cmd
        }
    };
    cmd.args(["-accel", "tcg", "-m", "2048", "-smp", "1"])
        .args(["-nographic", "-no-reboot", "-net", "none", "-kernel"])
        .arg(vmlinuz)
        .arg("-initrd")
        .arg(initrd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = cmd.spawn().context("starting qemu")?;
    let stdout = child.stdout.take().context("no stdout")?;
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + timeout;
    let mut console = Console {
        lines: Vec::new(),
        finished: false,
    };
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                let line = line.trim_end_matches('\r').to_string();
                println!("[{tag}] {line}");
                let end = line.trim() == END_MARKER;
                console.lines.push(line);
                if end {
                    console.finished = true;
                    break;
                }
            }
            // The guest powered off (EOF) or the deadline passed.
            Err(_) => break,
        }
    }
    if !console.finished {
        println!("[{tag}] the guest stopped or timed out before it finished");
    }
    // After the end marker the guest powers itself off, which closes the console; a guest
    // that does not within the grace period, or ran past its deadline, is stopped.
    let grace = Instant::now() + Duration::from_secs(20);
    while let Ok(line) = rx.recv_timeout(grace.saturating_duration_since(Instant::now())) {
        println!("[{tag}] {line}");
    }
    if child.try_wait()?.is_none() {
        child.kill().context("stopping qemu")?;
    }
    child.wait()?;
    drop(rx);
    let _ = reader.join();
    Ok(console)
}

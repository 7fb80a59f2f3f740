//! `cargo xtask bench flood [--spoofed]`: what a SYN flood costs the host, per SYN, with
//! limiter beside a floor (an XDP program that drops everything) and beside what an operator
//! would otherwise use, every case measured in the same run, their rounds interleaved so that
//! machine noise hits all of them alike.
//!
//! Two floods, one module each: [`closed_port`] (the default) floods a port nothing listens
//! on from a fixed set of sources, beside nftables and iptables meters; [`spoofed`]
//! (`--spoofed`) floods a listening port from a fresh random source per SYN, the flood SYN
//! cookies are for, beside the kernel's own cookies and iptables SYNPROXY, and then
//! [`cookie_transfer`] times a connection a cookie let in against a normal one.
//!
//! Each case makes its own pair of network namespaces joined by a veth, puts the filter under
//! test on the server end, and sends SYNs from the client end through an AF_PACKET socket.

mod closed_port;
mod cookie_transfer;
mod spoofed;

use std::{
    os::fd::{AsFd, AsRawFd},
    time::Duration,
};

use anyhow::{Context, Result};
use aya::{
    Ebpf,
    programs::{Xdp, XdpMode},
};
use clap::Parser;
use limiter_tests::{netns::Netns, packet::PacketSocket};

/// The protected port.
const PORT: u16 = 5672;
/// A case that cannot send its SYNs in this long is cut short (and says so).
const CASE_LIMIT: Duration = Duration::from_secs(30);
/// Sent per `sendmmsg` call.
const BATCH: usize = 64;

/// `cargo xtask bench flood [--spoofed] [--sources N,...]` passes its options on.
#[derive(Parser)]
struct Args {
    /// Flood a listening port from a fresh random source per SYN (see `spoofed`), instead of
    /// a closed port.
    #[arg(long)]
    spoofed: bool,
    /// The closed-port flood's numbers of source addresses, one row each (at most one per
    /// distinct SYN, so that every address sends).
    #[arg(long, value_delimiter = ',', default_values_t = [1, 10_000],
          value_parser = clap::value_parser!(u32).range(1..=closed_port::DISTINCT as i64),
          conflicts_with = "spoofed")]
    sources: Vec<u32>,
    /// Passed by `cargo bench` to every bench.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.spoofed {
        spoofed::run()?;
        cookie_transfer::run()
    } else {
        closed_port::run(&args.sources)
    }
}

/// The benchmarks' anchor object (`limiter-ebpf/src/pass.rs`): the floor and the spoofed
/// flood's client end.
fn anchor_object() -> Result<Ebpf> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../target/ebpf/bpfel-unknown-none/release/pass"
    );
    Ebpf::load_file(path).context("the anchor object (cargo xtask build builds it)")
}

/// The anchor object's XDP `program` attached to `ifname` in `ns`; detached when the result
/// is dropped.
fn attach_anchor(ns: &Netns, ifname: &str, program: &str) -> Result<Ebpf> {
    ns.run(|| {
        let mut ebpf = anchor_object()?;
        let prog: &mut Xdp = ebpf
            .program_mut(program)
            .with_context(|| format!("{program} in the anchor object"))?
            .try_into()?;
        prog.load()?;
        prog.attach(ifname, XdpMode::Driver)?;
        Ok(ebpf)
    })?
}

/// Sends `frames` in one `sendmmsg` call; returns how many went out (none when the transmit
/// queue is full, for the caller to try again).
fn send_batch<F: AsRef<[u8]>>(socket: &PacketSocket, frames: &[F]) -> Result<usize> {
    let mut iovecs: Vec<libc::iovec> = frames
        .iter()
        .map(|f| libc::iovec {
            iov_base: f.as_ref().as_ptr() as *mut libc::c_void,
            iov_len: f.as_ref().len(),
        })
        .collect();
    // SAFETY: an all-zero mmsghdr is valid; each gets one iovec below.
    let mut headers: Vec<libc::mmsghdr> = (0..frames.len())
        .map(|_| unsafe { std::mem::zeroed() })
        .collect();
    for (header, iovec) in headers.iter_mut().zip(iovecs.iter_mut()) {
        header.msg_hdr.msg_iov = iovec;
        header.msg_hdr.msg_iovlen = 1;
    }
    // SAFETY: every header points at one iovec over a frame that outlives the call.
    let rc = unsafe {
        libc::sendmmsg(
            socket.as_fd().as_raw_fd(),
            headers.as_mut_ptr(),
            headers.len() as u32,
            0,
        )
    };
    if rc < 0 {
        let error = std::io::Error::last_os_error();
        if error.raw_os_error() == Some(libc::ENOBUFS) {
            return Ok(0);
        }
        return Err(error).context("sendmmsg");
    }
    Ok(rc as usize)
}

/// `/proc/stat`'s columns after the CPU's name.
#[derive(Clone, Copy)]
enum Column {
    System = 3,
    Softirq = 7,
}

/// The time spent in `columns` by `cpu` (`cpu` for all CPUs, `cpu1` for one), from
/// `/proc/stat`.
fn cpu_time(cpu: &str, columns: &[Column]) -> Result<Duration> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let fields: Vec<&str> = stat
        .lines()
        .map(|line| line.split_whitespace().collect::<Vec<_>>())
        .find(|fields| fields.first() == Some(&cpu))
        .with_context(|| format!("no {cpu} line in /proc/stat"))?;
    let mut ticks = 0u64;
    for &column in columns {
        ticks += fields
            .get(column as usize)
            .with_context(|| format!("no column {} in /proc/stat", column as usize))?
            .parse::<u64>()?;
    }
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    Ok(Duration::from_nanos(ticks * 1_000_000_000 / hz))
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

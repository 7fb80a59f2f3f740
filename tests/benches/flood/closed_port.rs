//! `cargo xtask bench flood`: what a SYN flood costs the host, per SYN, with limiter beside the
//! floor (an XDP program that drops everything) and beside the firewalls an operator would
//! otherwise use (nftables meter + ct count, iptables hashlimit + connlimit), all in one run.
//!
//! Each case makes its own pair of network namespaces joined by a veth, puts the filter under
//! test on the server end, and sends pre-built SYNs from the client end through an AF_PACKET
//! socket, from 1 or 10,000 source addresses, to a protected port with nothing listening. The
//! cost is the softirq time all CPUs spent (from `/proc/stat`) divided by the SYNs sent: on a
//! veth the receive side, XDP included, runs in softirq. Rounds interleave the cases so that
//! machine noise hits all of them alike; the median of the rounds is printed, and the ratios.
//!
//! More rounds, after those, split the cost: with the kernel's BPF run-time statistics on, they
//! read how long the XDP program itself ran per SYN, for the floor and for limiter. The
//! statistics add their own clock reads to every run, so those rounds' softirq time is not used.

use std::{
    net::{IpAddr, Ipv4Addr},
    os::fd::{AsFd, AsRawFd},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use aya::{
    Ebpf,
    programs::{ProgramInfo, Xdp, XdpMode},
    sys::{Stats, enable_stats},
};
use clap::Parser;
use limiter::datapath::{Datapath, LoadOptions, XDP_PROGRAM, XdpAttachMode};
use limiter_common::{Direction, Reason, Verdict};
use limiter_tests::{
    frames::Tcp,
    kernel::settings,
    netns::{Pair, SERVER_V4},
    packet::PacketSocket,
};

const PORT: u16 = 5672;
/// SYNs per case and round: enough for the softirq clock (10 ms ticks) to resolve 1%.
const SYNS: usize = 1_000_000;
/// A case that cannot send its SYNs in this long is cut short (and says so).
const CASE_LIMIT: Duration = Duration::from_secs(30);
const ROUNDS: usize = 5;
/// Rounds of the floor and limiter with the run-time statistics on, after the measured ones.
const STATS_ROUNDS: usize = 3;
/// Sent per `sendmmsg` call.
const BATCH: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Filter {
    DropAll,
    Limiter,
    Nftables,
    Iptables,
}

impl Filter {
    const ALL: [Filter; 4] = [
        Filter::DropAll,
        Filter::Limiter,
        Filter::Nftables,
        Filter::Iptables,
    ];

    fn name(self) -> &'static str {
        match self {
            Filter::DropAll => "drop-all XDP",
            Filter::Limiter => "limiter",
            Filter::Nftables => "nftables",
            Filter::Iptables => "iptables",
        }
    }
}

/// What keeps a case's filter in place until the case ends (the firewalls live in the
/// namespace, which goes with the case).
type Installed = Option<Box<dyn std::any::Any + Send>>;

fn anchor_object() -> Result<Ebpf> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../target/ebpf/bpfel-unknown-none/release/pass"
    );
    Ebpf::load_file(path).context("the anchor object (cargo xtask build builds it)")
}

/// Puts `filter` on the server end of `pair`, refusing as limiter does with
/// `--syn-rate 1 --syn-burst 1`: almost every SYN of the flood is refused.
fn install(filter: Filter, pair: &Pair) -> Result<Installed> {
    let port = PORT.to_string();
    match filter {
        Filter::DropAll => pair.server.run(|| {
            let mut ebpf = anchor_object()?;
            let prog: &mut Xdp = ebpf
                .program_mut("drop_all")
                .context("drop_all in the anchor object")?
                .try_into()?;
            prog.load()?;
            prog.attach(&pair.server_if, XdpMode::Driver)?;
            Ok(Some(Box::new(ebpf) as Box<dyn std::any::Any + Send>))
        })?,
        Filter::Limiter => pair.server.run(|| {
            let settings = settings(&["--ports", &port, "--syn-rate", "1", "--syn-burst", "1"]);
            let mut dp = Datapath::load(LoadOptions {
                flow_table_size: settings.restart.flow_table_size,
                ..LoadOptions::default()
            })?;
            dp.maps.apply(&settings.policy)?;
            dp.attach(&pair.server_if, XdpAttachMode::Native)?;
            Ok(Some(Box::new(dp) as Box<dyn std::any::Any + Send>))
        })?,
        Filter::Nftables => {
            let rules = format!(
                "table inet limiter_bench {{
                   chain input {{
                     type filter hook input priority 0; policy accept;
                     tcp dport {port} ct state new meter syn_rate size 65535 {{ ip saddr limit rate over 1/second burst 1 packets }} drop
                     tcp dport {port} ct state new meter conns size 65535 {{ ip saddr ct count over 100 }} reject with tcp reset
                   }}
                 }}"
            );
            let file = tempfile::NamedTempFile::new()?;
            std::fs::write(file.path(), rules)?;
            let path = file.path().to_str().context("temp path")?.to_owned();
            pair.server.exec(&["nft", "-f", &path])?;
            Ok(None)
        }
        Filter::Iptables => {
            // Both rules judge new connections to the protected port.
            let new_syn = ["-A", "INPUT", "-p", "tcp", "--dport", &port, "--syn"];
            for rule in [
                &[
                    "-m",
                    "hashlimit",
                    "--hashlimit-above",
                    "1/sec",
                    "--hashlimit-burst",
                    "1",
                    "--hashlimit-mode",
                    "srcip",
                    "--hashlimit-name",
                    "syn_rate",
                    "-j",
                    "DROP",
                ][..],
                &[
                    "-m",
                    "connlimit",
                    "--connlimit-above",
                    "100",
                    "--connlimit-mask",
                    "32",
                    "-j",
                    "REJECT",
                    "--reject-with",
                    "tcp-reset",
                ][..],
            ] {
                let mut cmd = vec!["iptables"];
                cmd.extend_from_slice(&new_syn);
                cmd.extend_from_slice(rule);
                pair.server.exec(&cmd)?;
            }
            Ok(None)
        }
    }
}

/// Distinct SYNs sent in turn: a flood repeats no 4-tuple soon, or the programs would pass the
/// repeats as retransmissions of a tracked SYN.
const DISTINCT: u32 = 60_000;

/// SYNs from `sources` addresses in 198.18.0.0/15 (the benchmarking range), each address with
/// its share of the source ports.
fn frames(sources: u32) -> Vec<Vec<u8>> {
    (0..DISTINCT)
        .map(|i| {
            let src = Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 0, 1)) + i % sources);
            Tcp::syn(
                IpAddr::V4(src),
                1_024 + (i / sources) as u16,
                IpAddr::V4(SERVER_V4),
                PORT,
            )
            .build()
        })
        .collect()
}

/// Sends `count` frames, cycling through `frames`, in batches; returns how many went out.
fn send(socket: &PacketSocket, frames: &[Vec<u8>], count: usize) -> Result<usize> {
    let mut iovecs: Vec<libc::iovec> = frames
        .iter()
        .map(|f| libc::iovec {
            iov_base: f.as_ptr() as *mut libc::c_void,
            iov_len: f.len(),
        })
        .collect();
    let deadline = Instant::now() + CASE_LIMIT;
    let mut sent = 0;
    let mut at = 0;
    while sent < count && Instant::now() < deadline {
        let n = BATCH.min(count - sent);
        // SAFETY: an all-zero mmsghdr is valid; each gets one iovec below.
        let mut headers: Vec<libc::mmsghdr> =
            (0..n).map(|_| unsafe { std::mem::zeroed() }).collect();
        for header in headers.iter_mut() {
            header.msg_hdr.msg_iov = &mut iovecs[at];
            header.msg_hdr.msg_iovlen = 1;
            at = (at + 1) % frames.len();
        }
        // SAFETY: every header points at one iovec over a frame that outlives the call.
        let rc = unsafe {
            libc::sendmmsg(
                socket.as_fd().as_raw_fd(),
                headers.as_mut_ptr(),
                n as u32,
                0,
            )
        };
        if rc < 0 {
            let error = std::io::Error::last_os_error();
            if error.raw_os_error() == Some(libc::ENOBUFS) {
                continue;
            }
            return Err(error).context("sendmmsg");
        }
        sent += rc as usize;
    }
    Ok(sent)
}

/// Softirq time of all CPUs, from the `cpu` line of `/proc/stat`.
fn softirq() -> Result<Duration> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat.lines().next().context("/proc/stat is empty")?;
    let ticks: u64 = line
        .split_whitespace()
        .nth(7)
        .context("no softirq column in /proc/stat")?
        .parse()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    Ok(Duration::from_nanos(ticks * 1_000_000_000 / hz))
}

/// SYNs limiter let through to the host so far (admitted: `half_open`), if `installed` is
/// limiter's datapath.
fn let_through(installed: &Installed) -> Result<Option<u64>> {
    let Some(dp) = installed
        .as_ref()
        .and_then(|i| i.downcast_ref::<Datapath>())
    else {
        return Ok(None);
    };
    Ok(Some(dp.maps.packets(
        Direction::Ingress,
        Verdict::Pass,
        Reason::HalfOpen,
    )?))
}

/// The XDP program `installed` put on the interface, as the kernel reports it now: the floor's
/// or limiter's (the firewalls have none).
fn xdp_program(installed: &Installed) -> Result<Option<ProgramInfo>> {
    let Some(installed) = installed.as_ref() else {
        return Ok(None);
    };
    let program = if let Some(dp) = installed.downcast_ref::<Datapath>() {
        dp.ebpf().program(XDP_PROGRAM)
    } else if let Some(ebpf) = installed.downcast_ref::<Ebpf>() {
        ebpf.program("drop_all")
    } else {
        None
    };
    program
        .map(|p| p.info())
        .transpose()
        .context("the XDP program's info")
}

/// What one case measured while its SYNs were sent.
struct Measured {
    /// Softirq µs per SYN.
    cost: f64,
    /// SYNs limiter let through to the host.
    passed: Option<u64>,
    /// ns the XDP program ran per run, when the kernel's run-time statistics are on.
    program_ns: Option<f64>,
}

/// One case.
fn case(filter: Filter, frames: &[Vec<u8>]) -> Result<Measured> {
    let pair = Pair::new()?;
    let installed = install(filter, &pair)?;
    let socket = pair.client.run(|| PacketSocket::bind(&pair.client_if))??;
    // Warm the caches and the tables the filters keep, then measure.
    send(&socket, frames, frames.len().min(SYNS / 10))?;
    let passed_before = let_through(&installed)?;
    let program_before = xdp_program(&installed)?;
    let before = softirq()?;
    let sent = send(&socket, frames, SYNS)?;
    let spent = softirq()? - before;
    let program_after = xdp_program(&installed)?;
    let passed = let_through(&installed)?
        .zip(passed_before)
        .map(|(after, before)| after - before);
    drop(installed);
    if sent < SYNS {
        eprintln!("  {}: only {sent} SYNs in {CASE_LIMIT:?}", filter.name());
    }
    if sent == 0 {
        bail!("no SYN went out");
    }
    let program_ns = program_before
        .zip(program_after)
        .and_then(|(before, after)| {
            let runs = after.run_count() - before.run_count();
            let time = after.run_time() - before.run_time();
            (runs > 0 && !time.is_zero()).then(|| time.as_nanos() as f64 / runs as f64)
        });
    Ok(Measured {
        cost: spent.as_secs_f64() * 1e6 / sent as f64,
        passed,
        program_ns,
    })
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// `cargo xtask bench flood [--sources N,...]` passes its options on.
#[derive(Parser)]
struct Args {
    /// The numbers of source addresses to flood from, one row each (at most one per distinct
    /// SYN, so that every address sends).
    #[arg(long, value_delimiter = ',', default_values_t = [1, 10_000],
          value_parser = clap::value_parser!(u32).range(1..=DISTINCT as i64))]
    sources: Vec<u32>,
    /// Passed by `cargo bench` to every bench; this one has no other mode.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    println!(
        "flood bench: {SYNS} SYNs per case to a protected port, {ROUNDS} rounds (median); \
         softirq µs per SYN; every filter refuses past 1 SYN/s per source"
    );
    println!(
        "{:>8} {:>13} {:>9} {:>9} {:>9} {:>13} {:>13} {:>13}",
        "sources",
        "drop-all XDP",
        "limiter",
        "nftables",
        "iptables",
        "limiter/floor",
        "nft/limiter",
        "ipt/limiter"
    );
    let mut passes = Vec::new();
    let mut split = Vec::new();
    for sources in args.sources {
        let frames = frames(sources);
        let mut results = vec![Vec::new(); Filter::ALL.len()];
        let mut passed = Vec::new();
        for _ in 0..ROUNDS {
            for (i, filter) in Filter::ALL.into_iter().enumerate() {
                let measured = case(filter, &frames)?;
                results[i].push(measured.cost);
                passed.extend(measured.passed.map(|n| n as f64));
            }
        }
        let m: Vec<f64> = results.into_iter().map(median).collect();
        println!(
            "{:>8} {:>13.3} {:>9.3} {:>9.3} {:>9.3} {:>13.2} {:>13.2} {:>13.2}",
            sources,
            m[0],
            m[1],
            m[2],
            m[3],
            m[1] / m[0],
            m[2] / m[1],
            m[3] / m[1]
        );
        passes.push((sources, median(passed)));
        split.push((sources, m[1] - m[0], program_times(&frames)?));
    }
    // What the floor never pays: the SYNs the policy admits (1 per second per source) reach
    // the host, which answers each (here with a RST: nothing listens).
    for (sources, passed) in passes {
        println!(
            "{sources:>8} sources: limiter let {passed:.0} of the {SYNS} SYNs through to the host (median)"
        );
    }
    println!(
        "XDP program's own ns per SYN ({STATS_ROUNDS} more rounds, median; run-time statistics on, \
         their clock reads included in both):"
    );
    for (sources, extra_us, (floor_ns, limiter_ns)) in split {
        println!(
            "{sources:>8} sources: drop-all {floor_ns:.0}, limiter {limiter_ns:.0}: limiter's \
             program ran {:.0} ns longer than the floor's; its softirq cost above is {:.0} ns more",
            limiter_ns - floor_ns,
            extra_us * 1e3
        );
    }
    Ok(())
}

/// The floor's and limiter's XDP programs' own time per SYN: the medians of rounds of their
/// own, the two interleaved as in the measured rounds.
fn program_times(frames: &[Vec<u8>]) -> Result<(f64, f64)> {
    let _stats = enable_stats(Stats::RunTime).context("BPF run-time statistics")?;
    let program_ns = |filter: Filter| {
        case(filter, frames)?
            .program_ns
            .with_context(|| format!("{}: the kernel reported no run time", filter.name()))
    };
    let (mut floor, mut limiter) = (Vec::new(), Vec::new());
    for _ in 0..STATS_ROUNDS {
        floor.push(program_ns(Filter::DropAll)?);
        limiter.push(program_ns(Filter::Limiter)?);
    }
    Ok((median(floor), median(limiter)))
}

//! The closed-port flood (`cargo xtask bench flood`): pre-built SYNs from 1 or 10,000 source
//! addresses (`--sources` takes other counts) to a protected port nothing listens on. The
//! cost is the softirq time all CPUs spent (from `/proc/stat`) divided by the SYNs sent: on a
//! veth the receive side, XDP included, runs in softirq, on the sending CPU.
//!
//! Cases: the floor (an XDP program that drops everything); the kernel alone (an XDP program
//! that passes everything, so the receive path is the floor's, and the host answers every SYN
//! with a RST); limiter with `--syn-rate 1 --syn-burst 1`; nftables (meter + ct count) and
//! iptables (hashlimit + connlimit) refusing past 1 SYN/s per source. Limiter's SYN rate
//! charges its token at the proven handshake, never at the SYN (a forged source must not spend
//! a real one's allowance), and nothing listens, so no handshake completes: limiter refuses
//! none of this flood and passes every SYN to the host, which answers with a RST, as the
//! kernel alone does. The firewalls' meters charge every SYN and drop almost all of them. So
//! the limiter row is limiter's SYN path plus the host's answer, to be read against the
//! kernel alone; the bench prints how many SYNs limiter let through to show it.
//!
//! More rounds, after those, split the cost: with the kernel's BPF run-time statistics on,
//! they read how long the XDP program itself ran per SYN, for the floor and for limiter. The
//! statistics add their own clock reads to every run, so those rounds' softirq time is not
//! used.

use std::{
    net::{IpAddr, Ipv4Addr},
    time::Instant,
};

use anyhow::{Context, Result, bail};
use aya::{
    Ebpf,
    programs::ProgramInfo,
    sys::{Stats, enable_stats},
};
use limiter::datapath::{Datapath, XDP_PROGRAM};
use limiter_common::{Direction, Reason, Verdict};
use limiter_tests::{
    frames::Tcp,
    kernel::attach_server,
    netns::{Pair, SERVER_V4},
    packet::PacketSocket,
    report::Report,
};

use crate::{BATCH, CASE_LIMIT, Column, PORT, attach_anchor, cpu_time, median, send_batch};

/// SYNs per case and round: enough for the softirq clock (4 ms ticks) to resolve 1%.
const SYNS: usize = 1_000_000;
const ROUNDS: usize = 5;
/// Rounds of the floor and limiter with the run-time statistics on, after the measured ones.
const STATS_ROUNDS: usize = 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Filter {
    DropAll,
    Kernel,
    Limiter,
    Nftables,
    Iptables,
}

impl Filter {
    const ALL: [Filter; 5] = [
        Filter::DropAll,
        Filter::Kernel,
        Filter::Limiter,
        Filter::Nftables,
        Filter::Iptables,
    ];

    fn name(self) -> &'static str {
        match self {
            Filter::DropAll => "drop-all XDP",
            Filter::Kernel => "kernel alone",
            Filter::Limiter => "limiter",
            Filter::Nftables => "nftables",
            Filter::Iptables => "iptables",
        }
    }
}

/// What keeps a case's filter in place until the case ends (the firewalls live in the
/// namespace, which goes with the case).
type Installed = Option<Box<dyn std::any::Any + Send>>;

/// Puts `filter` on the server end of `pair`.
fn install(filter: Filter, pair: &Pair) -> Result<Installed> {
    let port = PORT.to_string();
    let anchor = |program| -> Result<Installed> {
        Ok(Some(Box::new(attach_anchor(
            &pair.server,
            &pair.server_if,
            program,
        )?)))
    };
    match filter {
        Filter::DropAll => anchor("drop_all"),
        Filter::Kernel => anchor("pass"),
        Filter::Limiter => {
            let dp = attach_server(
                pair,
                &["--ports", &port, "--syn-rate", "1", "--syn-burst", "1"],
            )?;
            Ok(Some(Box::new(dp) as Box<dyn std::any::Any + Send>))
        }
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
pub const DISTINCT: u32 = 60_000;

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
    let deadline = Instant::now() + CASE_LIMIT;
    let mut sent = 0;
    let mut at = 0;
    while sent < count && Instant::now() < deadline {
        let n = BATCH.min(count - sent).min(frames.len() - at);
        let out = send_batch(socket, &frames[at..at + n])?;
        sent += out;
        at = (at + out) % frames.len();
    }
    Ok(sent)
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

/// The XDP program `installed` put on the interface, as the kernel reports it now: the
/// anchor's or limiter's (the firewalls have none).
fn xdp_program(installed: &Installed) -> Result<Option<ProgramInfo>> {
    let Some(installed) = installed.as_ref() else {
        return Ok(None);
    };
    let program = if let Some(dp) = installed.downcast_ref::<Datapath>() {
        dp.ebpf().program(XDP_PROGRAM)
    } else if let Some(ebpf) = installed.downcast_ref::<Ebpf>() {
        ebpf.programs().map(|(_, p)| p).find(|p| p.info().is_ok())
    } else {
        None
    };
    program
        .map(aya::programs::Program::info)
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
    /// Whether the case sent fewer SYNs than asked, in [`CASE_LIMIT`].
    cut_short: bool,
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
    let before = cpu_time("cpu", &[Column::Softirq])?;
    let sent = send(&socket, frames, SYNS)?;
    let spent = cpu_time("cpu", &[Column::Softirq])? - before;
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
        cut_short: sent < SYNS,
    })
}

pub fn run(sources: &[u32]) -> Result<()> {
    let mut report = Report::new(
        "flood",
        "flood",
        "SYN flood to a closed port: softirq µs per SYN",
        &format!(
            "{SYNS} pre-built SYNs per case and round through an AF_PACKET socket on one end \
             of a veth, from 198.18.0.0/15, to a protected port nothing listens on at the \
             other end, where the case's filter runs; the cost is the softirq time of all \
             CPUs (`/proc/stat`) over the SYNs sent (a veth's receive side, XDP included, runs \
             in softirq on the sending CPU). Cases, interleaved over {ROUNDS} rounds (median): \
             an XDP program that drops everything (the floor); the kernel alone (an XDP program \
             that passes everything, and the host's RST to every SYN); limiter with \
             `--syn-rate 1 --syn-burst 1`; nftables (meter + ct count) and iptables (hashlimit \
             + connlimit), both refusing past 1 SYN/s per source. Limiter charges a source's \
             SYN token at its proven handshake, never at the SYN, and no handshake completes to \
             a closed port: it refuses none of this flood and passes every SYN to the host, \
             which answers with a RST (the SYNs let through are counted below). So limiter is \
             to be read against the kernel alone; the firewalls charge every SYN and drop \
             almost all of them. The program times come from \
             {STATS_ROUNDS} more rounds of the floor and limiter with the kernel's BPF run-time \
             statistics on (their clock reads included in both; those rounds' softirq time is \
             not used)."
        ),
    );
    let mut rows = Vec::new();
    let mut split_rows = Vec::new();
    let mut cut_short = Vec::new();
    for &sources in sources {
        let frames = frames(sources);
        let mut results = vec![Vec::new(); Filter::ALL.len()];
        let mut passed = Vec::new();
        for _ in 0..ROUNDS {
            for (i, filter) in Filter::ALL.into_iter().enumerate() {
                let measured = case(filter, &frames)?;
                results[i].push(measured.cost);
                passed.extend(measured.passed.map(|n| n as f64));
                if measured.cut_short {
                    cut_short.push(format!("{} at {sources} sources", filter.name()));
                }
            }
        }
        let m: Vec<f64> = results.into_iter().map(median).collect();
        let [floor, kernel, limiter, nft, ipt] = m[..] else {
            unreachable!("one median per filter")
        };
        rows.push(vec![
            sources.to_string(),
            format!("{floor:.2}"),
            format!("{kernel:.2}"),
            format!("{limiter:.2}"),
            format!("{nft:.2}"),
            format!("{ipt:.2}"),
            format!("{:.2}", limiter / floor),
            format!("{:.2}", limiter / kernel),
            format!("{:.2}", nft / limiter),
            format!("{:.2}", ipt / limiter),
            format!("{:.0} of {SYNS}", median(passed)),
        ]);
        let (floor_ns, limiter_ns) = program_times(&frames)?;
        split_rows.push(vec![
            sources.to_string(),
            format!("{floor_ns:.0}"),
            format!("{limiter_ns:.0}"),
            format!("{:.0}", limiter_ns - floor_ns),
            format!("{:.0}", (limiter - floor) * 1e3),
        ]);
    }
    report.table(
        &[
            "sources",
            "drop-all XDP µs",
            "kernel alone µs",
            "limiter µs",
            "nftables µs",
            "iptables µs",
            "limiter / floor",
            "limiter / kernel alone",
            "nftables / limiter",
            "iptables / limiter",
            "SYNs limiter let through",
        ],
        &rows,
    );
    report.table(
        &[
            "sources",
            "drop-all program ns",
            "limiter program ns",
            "program's difference ns",
            "softirq difference ns",
        ],
        &split_rows,
    );
    if !cut_short.is_empty() {
        report.note(&format!(
            "Cut short (fewer than {SYNS} SYNs sent in {CASE_LIMIT:?}): {}.",
            cut_short.join(", ")
        ));
    }
    for row in &rows {
        report.summary(format!(
            "{} sources: limiter / kernel alone {}, nftables / limiter {}",
            row[0], row[7], row[8]
        ));
    }
    report.finish()
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

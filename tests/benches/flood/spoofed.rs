//! The spoofed flood (`cargo xtask bench flood --spoofed`), the one SYN cookies are for: a
//! fresh random source per SYN (198.18.0.0/15, random port and sequence number), so every SYN
//! is within any per-source rate and no source ever completes a handshake, to a port with a
//! listener, so the host answers. The server's namespace routes the flood's range out of the
//! veth, so every answer (the host's SYN-ACK, SYNPROXY's, limiter's cookie by TC or by
//! `XDP_TX`) leaves it and is dropped where it lands: the client's end runs `spoofed_sink`
//! (`limiter-ebpf/src/spoofed_sink.rs`), which drops frames to that range, passes the rest
//! (a real client's), and gives that end the NAPI that `XDP_TX` needs. The server's end always
//! runs an XDP program (the filter under test, or one that passes everything for the kernel
//! alone and SYNPROXY), so every case receives through the veth's NAPI alike.
//!
//! Cases, interleaved over [`ROUNDS`] rounds: the floor (drop everything in XDP); limiter with
//! `--syn-cookies always`, its SYN-ACKs built by TC ingress (the default) and by `XDP_TX`
//! (`--rst-xdp-tx`); limiter with cookies off (every SYN passes to the host, the kernel's
//! default `tcp_syncookies = 1`); the kernel alone with `tcp_syncookies = 2` (a cookie for every
//! SYN); iptables SYNPROXY (untracked SYNs answered by netfilter's cookies). The metric is the
//! issue's: system plus softirq time of all CPUs (`/proc/stat`) over the SYNs sent.
//!
//! That metric counts work every case shares: the AF_PACKET sender's system time and the
//! veth's own skb handling (a veth runs its peer's receive on the sending CPU), around a
//! microsecond a SYN, which flattens every ratio towards 1. So [`SPLIT_ROUNDS`] more rounds
//! count the server's work alone: both veth ends' NAPI made threaded (`/sys/class/net/IF/
//! threaded`), the server end's thread pinned to one CPU, the sender and the client end's
//! thread to the other, and the server thread's own run time (`/proc/PID/schedstat`, in ns)
//! divided by the SYNs it received. Its receive path, the filter, the host's TCP stack, and
//! the answer up to its hand-off to the peer all run in that thread, and nothing else does.
//! Both metrics are also given with the floor's cost subtracted from every case. And
//! [`PROGRAM_ROUNDS`] more, with the kernel's BPF run-time statistics on, read how long the
//! case's own programs ran per SYN (limiter's XDP and TC programs, or the anchor's), the part
//! of the cost the code under test can change; the statistics' clock reads add to every run,
//! so those rounds' other figures are not used.
//!
//! Last, a real client during the flood: one more round per case at the sender's full rate,
//! [`CONNECTS`] connects from the client's own address, each given [`FIRST_TRY`] (under the 1 s
//! before a SYN is sent again), so one that connects did so on its first SYN. While some miss,
//! the flood is paced at half the rate and the connects tried again, up to [`HALVINGS`] times:
//! the highest rate at which all connect lies between the last two rates.

use std::{
    any::Any,
    collections::BTreeSet,
    net::{IpAddr, SocketAddr, TcpListener},
    sync::atomic::{AtomicBool, AtomicUsize, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use aya::{
    Ebpf,
    sys::{Stats, enable_stats},
};
use limiter::datapath::Datapath;
use limiter_tests::{
    frames::Tcp,
    kernel::attach_server,
    netns::{CLIENT_V4, Netns, Pair, SERVER_V4},
    packet::PacketSocket,
    report::{AtLeast, Report, Target},
};
use nix::{
    sched::{CpuSet, sched_setaffinity},
    unistd::Pid,
};

use crate::{BATCH, CASE_LIMIT, Column, PORT, attach_anchor, cpu_time, median, send_batch};

/// SYNs per case and round: at 2 µs a SYN, a second of CPU, 250 ticks of `/proc/stat`.
const SYNS: usize = 500_000;
const ROUNDS: usize = 5;
/// Rounds with threaded NAPI, after the measured ones.
const SPLIT_ROUNDS: usize = 3;
/// Rounds with the BPF run-time statistics on, after those.
const PROGRAM_ROUNDS: usize = 3;
/// A real client's connects during the flood, per case.
const CONNECTS: usize = 20;
/// How many times the flood's rate is halved while some connects miss their first try.
const HALVINGS: usize = 3;
/// Less than the 1 s a client waits for its SYN's answer before sending the SYN again.
const FIRST_TRY: Duration = Duration::from_millis(900);
/// The split rounds' CPUs: the server's end on one, the sender and the client's end on the
/// other.
const SERVER_CPU: usize = 1;
const SENDER_CPU: usize = 0;
/// The flood's range, routed out of the server's namespace.
const SPOOFED_NET: &str = "198.18.0.0/15";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Case {
    Floor,
    CookiesTc,
    CookiesXdpTx,
    NoCookies,
    Kernel,
    Synproxy,
}

impl Case {
    const ALL: [Case; 6] = [
        Case::Floor,
        Case::CookiesTc,
        Case::CookiesXdpTx,
        Case::NoCookies,
        Case::Kernel,
        Case::Synproxy,
    ];

    fn name(self) -> &'static str {
        match self {
            Case::Floor => "drop-all XDP (floor)",
            Case::CookiesTc => "limiter, cookies by TC",
            Case::CookiesXdpTx => "limiter, cookies by XDP_TX",
            Case::NoCookies => "limiter, no cookies",
            Case::Kernel => "kernel alone, tcp_syncookies=2",
            Case::Synproxy => "iptables SYNPROXY",
        }
    }

    /// The server namespace's settings, made before the filter loads (limiter reads them).
    fn sysctls(self) -> &'static [&'static str] {
        match self {
            Case::CookiesTc | Case::CookiesXdpTx => {
                &["net.ipv4.tcp_syncookies=2", "net.ipv4.tcp_timestamps=2"]
            }
            Case::Kernel => &["net.ipv4.tcp_syncookies=2"],
            Case::Floor | Case::NoCookies | Case::Synproxy => &[],
        }
    }

    /// Limiter's flags, for its cases: a SYN rate no single SYN of a source can exceed.
    fn limiter_flags(self) -> Option<Vec<&'static str>> {
        let base = ["--syn-rate", "100", "--syn-burst", "100", "--syn-cookies"];
        let extra: &[&str] = match self {
            Case::CookiesTc => &["always"],
            Case::CookiesXdpTx => &["always", "--rst-xdp-tx"],
            Case::NoCookies => &["off"],
            Case::Floor | Case::Kernel | Case::Synproxy => return None,
        };
        Some(base.iter().chain(extra).copied().collect())
    }
}

/// One case's namespaces, listener, filter and client end.
struct Rig {
    /// The NAPI thread of the server's end, when threaded.
    server_napi: Option<Pid>,
    filter: Box<dyn Any + Send>,
    _sink: Ebpf,
    _listener: TcpListener,
    /// Last: the programs detach before the namespaces go.
    pair: Pair,
}

impl Rig {
    fn new(case: Case, threaded: bool) -> Result<Rig> {
        let pair = Pair::new()?;
        for setting in case.sysctls() {
            pair.server.exec(&["sysctl", "-q", "-w", setting])?;
        }
        let listener = pair
            .server
            .run(|| TcpListener::bind((SERVER_V4, PORT)))?
            .context("the listener")?;
        pair.server.exec(&[
            "ip",
            "route",
            "add",
            SPOOFED_NET,
            "via",
            &CLIENT_V4.to_string(),
        ])?;
        let filter: Box<dyn Any + Send> = match case.limiter_flags() {
            Some(flags) => {
                let port = PORT.to_string();
                let mut flags = flags;
                flags.extend(["--ports", &port]);
                Box::new(attach_server(&pair, &flags)?)
            }
            None => {
                let program = if case == Case::Floor {
                    "drop_all"
                } else {
                    "pass"
                };
                Box::new(attach_anchor(&pair.server, &pair.server_if, program)?)
            }
        };
        if case == Case::Synproxy {
            synproxy(&pair.server)?;
        }
        let sink = attach_anchor(&pair.client, &pair.client_if, "spoofed_sink")?;
        let server_napi = if threaded {
            threaded_napi(&pair.client, &pair.client_if, SENDER_CPU)?;
            Some(threaded_napi(&pair.server, &pair.server_if, SERVER_CPU)?)
        } else {
            None
        };
        Ok(Rig {
            server_napi,
            filter,
            _sink: sink,
            _listener: listener,
            pair,
        })
    }
}

/// SYNPROXY as netfilter's documentation sets it up: the port's SYNs untracked, answered by
/// SYNPROXY with a cookie; only a valid cookie's ACK makes the connection to the listener.
fn synproxy(ns: &Netns) -> Result<()> {
    let port = PORT.to_string();
    let rules: [&[&str]; 3] = [
        &[
            "-t",
            "raw",
            "-A",
            "PREROUTING",
            "-p",
            "tcp",
            "--dport",
            &port,
            "--syn",
            "-j",
            "CT",
            "--notrack",
        ],
        &[
            "-A",
            "INPUT",
            "-p",
            "tcp",
            "--dport",
            &port,
            "-m",
            "conntrack",
            "--ctstate",
            "INVALID,UNTRACKED",
            "-j",
            "SYNPROXY",
            "--sack-perm",
            "--timestamp",
            "--wscale",
            "7",
            "--mss",
            "1460",
        ],
        &[
            "-A",
            "INPUT",
            "-p",
            "tcp",
            "--dport",
            &port,
            "-m",
            "conntrack",
            "--ctstate",
            "INVALID",
            "-j",
            "DROP",
        ],
    ];
    for rule in rules {
        let mut cmd = vec!["iptables"];
        cmd.extend_from_slice(rule);
        ns.exec(&cmd)?;
    }
    // An ACK conntrack has not seen the handshake of is INVALID, so SYNPROXY checks its cookie.
    ns.exec(&[
        "sysctl",
        "-q",
        "-w",
        "net.netfilter.nf_conntrack_tcp_loose=0",
    ])
}

/// The NAPI threads of `ifname` now (`napi/IFNAME-ID`, as much of it as a task's 15-byte
/// name holds).
fn napi_threads(ifname: &str) -> Result<BTreeSet<i32>> {
    let prefix: String = format!("napi/{ifname}-").chars().take(15).collect();
    let mut threads = BTreeSet::new();
    for entry in std::fs::read_dir("/proc")? {
        let entry = entry?;
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        // A task that ended since the listing has no name to read.
        if let Ok(comm) = std::fs::read_to_string(entry.path().join("comm"))
            && comm.trim_end().starts_with(&prefix)
        {
            threads.insert(pid);
        }
    }
    Ok(threads)
}

/// Makes the NAPI of `ifname` (in `ns`) threaded and pins its thread to `cpu`; returns the
/// thread. The thread is told from those of an earlier veth of the same shortened name by
/// being new.
fn threaded_napi(ns: &Netns, ifname: &str, cpu: usize) -> Result<Pid> {
    let before = napi_threads(ifname)?;
    // `ip netns exec` mounts the namespace's own /sys for the command.
    ns.exec(&[
        "sh",
        "-c",
        &format!("echo 1 > /sys/class/net/{ifname}/threaded"),
    ])?;
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let new: Vec<i32> = napi_threads(ifname)?.difference(&before).copied().collect();
        match new[..] {
            [pid] => {
                let pid = Pid::from_raw(pid);
                pin(pid, cpu)?;
                return Ok(pid);
            }
            [] if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => bail!("{ifname}: {} new NAPI threads, not one", new.len()),
        }
    }
}

/// Pins `pid` (0: the calling thread) to `cpu`.
fn pin(pid: Pid, cpu: usize) -> Result<()> {
    let mut set = CpuSet::new();
    set.set(cpu)?;
    sched_setaffinity(pid, &set).with_context(|| format!("pinning {pid} to CPU {cpu}"))
}

/// The time `pid` has run, from `/proc/PID/schedstat`.
fn runtime(pid: Pid) -> Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/schedstat"))?;
    let ns: u64 = stat
        .split_whitespace()
        .next()
        .context("empty schedstat")?
        .parse()?;
    Ok(Duration::from_nanos(ns))
}

/// Packets `ifname` (in `ns`) received, from the namespace's `/proc/net/dev`.
fn rx_packets(ns: &Netns, ifname: &str) -> Result<u64> {
    let text = ns.run(|| std::fs::read_to_string("/proc/thread-self/net/dev"))??;
    let line = text
        .lines()
        .find_map(|l| l.trim_start().strip_prefix(&format!("{ifname}:")))
        .with_context(|| format!("no {ifname} in /proc/net/dev"))?;
    Ok(line
        .split_whitespace()
        .nth(1)
        .context("no packet count")?
        .parse()?)
}

/// SYNs from a fresh random source each, built a batch at a time just before it is sent.
struct Spoofer {
    state: u64,
    frames: Vec<Vec<u8>>,
}

impl Spoofer {
    fn new() -> Spoofer {
        Spoofer {
            state: 0x2545_F491_4F6C_DD1D,
            frames: Vec::with_capacity(BATCH),
        }
    }

    fn next(&mut self, n: usize) -> &[Vec<u8>] {
        self.frames.clear();
        for _ in 0..n {
            // xorshift64: the source, its port and the ISN from one draw.
            self.state ^= self.state << 13;
            self.state ^= self.state >> 7;
            self.state ^= self.state << 17;
            let src = std::net::Ipv4Addr::from(0xC612_0000 | (self.state as u32 & 0x1_FFFF));
            let mut syn = Tcp::syn(
                IpAddr::V4(src),
                1024 + (self.state >> 32) as u16 % 60_000,
                IpAddr::V4(SERVER_V4),
                PORT,
            );
            syn.seq = (self.state >> 16) as u32;
            self.frames.push(syn.build());
        }
        &self.frames
    }
}

/// Sends up to `count` spoofed SYNs, as fast as the socket takes them or at `pace` SYNs a
/// second, until `stop` or [`CASE_LIMIT`]; `sent` follows the count. Returns how many went out.
fn flood(
    socket: &PacketSocket,
    count: usize,
    pace: Option<f64>,
    stop: &AtomicBool,
    sent: &AtomicUsize,
) -> Result<usize> {
    let mut spoofer = Spoofer::new();
    let started = Instant::now();
    let deadline = started + CASE_LIMIT;
    let mut total = 0;
    while total < count && !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
        total += send_batch(socket, spoofer.next(BATCH.min(count - total)))?;
        sent.store(total, Ordering::Relaxed);
        if let Some(pace) = pace {
            let due = started + Duration::from_secs_f64(total as f64 / pace);
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
        }
    }
    Ok(total)
}

/// How long the programs `filter` loaded (limiter's, or the anchor's) have run, as the
/// kernel's run-time statistics count it.
fn programs_time(filter: &(dyn Any + Send)) -> Option<Duration> {
    let ebpf = match filter.downcast_ref::<Datapath>() {
        Some(dp) => dp.ebpf(),
        None => filter.downcast_ref::<Ebpf>()?,
    };
    // Only the loaded programs have statistics.
    Some(
        ebpf.programs()
            .filter_map(|(_, p)| p.info().ok())
            .map(|info| info.run_time())
            .sum(),
    )
}

/// What one round of a case measured.
struct Measured {
    /// System + softirq µs of all CPUs per SYN sent.
    host_us: f64,
    /// ns the server end's NAPI thread ran per SYN it received (threaded rounds).
    server_ns: Option<f64>,
    /// ns the case's programs ran per SYN received (rounds with the statistics on).
    programs_ns: Option<f64>,
    sent: usize,
    received: u64,
}

fn measure(case: Case, threaded: bool) -> Result<Measured> {
    let rig = Rig::new(case, threaded)?;
    let socket = rig
        .pair
        .client
        .run(|| PacketSocket::bind(&rig.pair.client_if))??;
    let (stop, progress) = (AtomicBool::new(false), AtomicUsize::new(0));
    let send = |count| {
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    if threaded {
                        pin(Pid::from_raw(0), SENDER_CPU)?;
                    }
                    flood(&socket, count, None, &stop, &progress)
                })
                .join()
                .map_err(|_| anyhow::anyhow!("the sender panicked"))?
        })
    };
    // Warm the caches and the host's tables, then measure.
    send(SYNS / 10)?;
    let received_before = rx_packets(&rig.pair.server, &rig.pair.server_if)?;
    let thread_before = rig.server_napi.map(runtime).transpose()?;
    let programs_before = programs_time(rig.filter.as_ref());
    let host_before = cpu_time("cpu", &[Column::System, Column::Softirq])?;
    let sent = send(SYNS)?;
    let host = cpu_time("cpu", &[Column::System, Column::Softirq])? - host_before;
    let thread = rig
        .server_napi
        .map(runtime)
        .transpose()?
        .zip(thread_before)
        .map(|(after, before)| after - before);
    let programs = programs_time(rig.filter.as_ref())
        .zip(programs_before)
        .map(|(after, before)| after - before);
    let received = rx_packets(&rig.pair.server, &rig.pair.server_if)? - received_before;
    if sent == 0 || received == 0 {
        bail!("{}: {sent} SYNs sent, {received} received", case.name());
    }
    Ok(Measured {
        host_us: host.as_secs_f64() * 1e6 / sent as f64,
        server_ns: thread.map(|t| t.as_nanos() as f64 / received as f64),
        programs_ns: programs.map(|t| t.as_nanos() as f64 / received as f64),
        sent,
        received,
    })
}

/// A real client's connects during a flood at full rate or at `pace`: how many connected on
/// their first SYN, and the flood's rate (SYNs a second).
fn probe(case: Case, pace: Option<f64>) -> Result<(usize, f64)> {
    let rig = Rig::new(case, false)?;
    let socket = rig
        .pair
        .client
        .run(|| PacketSocket::bind(&rig.pair.client_if))??;
    let dst = SocketAddr::from((SERVER_V4, PORT));
    let (stop, sent) = (AtomicBool::new(false), AtomicUsize::new(0));
    std::thread::scope(|scope| {
        let started = Instant::now();
        let flood = scope.spawn(|| flood(&socket, usize::MAX, pace, &stop, &sent));
        // The flood at full rate before the first connect.
        while sent.load(Ordering::Relaxed) < SYNS / 10 && !flood.is_finished() {
            std::thread::sleep(Duration::from_millis(5));
        }
        let connected = (0..CONNECTS)
            .map(|_| first_try(&rig.pair.client, dst))
            .collect::<Result<Vec<bool>>>();
        stop.store(true, Ordering::Relaxed);
        let total = flood
            .join()
            .map_err(|_| anyhow::anyhow!("the sender panicked"))??;
        let rate = total as f64 / started.elapsed().as_secs_f64();
        Ok((connected?.into_iter().filter(|&ok| ok).count(), rate))
    })
}

/// [`probe`] at full rate, then at half the last rate while some connects miss.
fn ladder(case: Case) -> Result<Vec<(usize, f64)>> {
    let mut steps = vec![probe(case, None)?];
    while let Some(&(ok, rate)) = steps.last()
        && ok < CONNECTS
        && steps.len() <= HALVINGS
    {
        steps.push(probe(case, Some(rate / 2.0))?);
    }
    Ok(steps)
}

/// Whether a connect from the client's own address to `dst` completes within [`FIRST_TRY`].
fn first_try(ns: &Netns, dst: SocketAddr) -> Result<bool> {
    use socket2::{Domain, Socket, Type};
    ns.run(|| {
        let socket = Socket::new(Domain::IPV4, Type::STREAM, None)?;
        socket.bind(&SocketAddr::from((CLIENT_V4, 0)).into())?;
        match socket.connect_timeout(&dst.into(), FIRST_TRY) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => Ok(false),
            Err(e) => Err(e).context("connecting"),
        }
    })?
}

pub fn run() -> Result<()> {
    if std::thread::available_parallelism().map_or(0, usize::from) <= SERVER_CPU {
        bail!(
            "the split rounds pin the server's end and the sender to different CPUs: two at least"
        );
    }
    let mut host = vec![Vec::new(); Case::ALL.len()];
    let mut short = BTreeSet::new();
    for _ in 0..ROUNDS {
        for (i, case) in Case::ALL.into_iter().enumerate() {
            let measured = measure(case, false)?;
            host[i].push(measured.host_us);
            if measured.sent < SYNS || (measured.received as f64) < 0.99 * SYNS as f64 {
                short.insert(case.name());
            }
        }
    }
    let mut server = vec![Vec::new(); Case::ALL.len()];
    let mut lost = vec![Vec::new(); Case::ALL.len()];
    for _ in 0..SPLIT_ROUNDS {
        for (i, case) in Case::ALL.into_iter().enumerate() {
            let measured = measure(case, true)?;
            server[i].push(measured.server_ns.context("no NAPI thread")?);
            lost[i].push(1.0 - measured.received as f64 / measured.sent as f64);
        }
    }
    let mut programs = vec![Vec::new(); Case::ALL.len()];
    {
        let _stats = enable_stats(Stats::RunTime).context("BPF run-time statistics")?;
        for _ in 0..PROGRAM_ROUNDS {
            for (i, case) in Case::ALL.into_iter().enumerate() {
                let measured = measure(case, false)?;
                programs[i].push(measured.programs_ns.context("no programs' run time")?);
            }
        }
    }
    let mut probes = Vec::new();
    for case in Case::ALL {
        probes.push(if case == Case::Floor {
            None
        } else {
            Some(ladder(case)?)
        });
    }
    let host: Vec<f64> = host.into_iter().map(median).collect();
    let server: Vec<f64> = server.into_iter().map(median).collect();
    let lost: Vec<f64> = lost.into_iter().map(median).collect();
    let programs: Vec<f64> = programs.into_iter().map(median).collect();
    let at = |case| Case::ALL.iter().position(|c| *c == case).unwrap();
    let (floor_host, floor_server) = (host[at(Case::Floor)], server[at(Case::Floor)]);

    let mut report = Report::new(
        "flood-spoofed",
        "flood --spoofed",
        "Spoofed SYN flood to a listening port: CPU per SYN",
        &format!(
            "{SYNS} SYNs per case and round through an AF_PACKET socket on the client's end of \
             a veth, each from a fresh random source in 198.18.0.0/15 (random port and ISN, \
             so every SYN is within any per-source rate and none completes a handshake), to a \
             port with a listener on the server's end, whose namespace routes that range back \
             out of the veth; the client's end runs an XDP program that drops frames to the \
             range (the answers) and passes the rest, which also gives it the NAPI that \
             `XDP_TX` needs. The server's end always runs an XDP program (the filter, or one \
             that passes everything for the kernel alone and SYNPROXY). Cases, interleaved \
             over {ROUNDS} rounds (median): the floor (drop everything in XDP); limiter with \
             `--syn-cookies always`, its SYN-ACKs built by TC ingress or sent by `XDP_TX` \
             (`--rst-xdp-tx`); limiter with cookies off (the host answers, \
             `tcp_syncookies = 1`); the kernel alone with `tcp_syncookies = 2`; iptables \
             SYNPROXY. **Host µs/SYN** is system + softirq time of all CPUs (`/proc/stat`) over \
             the SYNs sent: the issue's metric, which includes the sender's system time and \
             the veth's skb handling that every case shares. **Server ns/SYN** removes that \
             shared cost: {SPLIT_ROUNDS} more rounds with both ends' NAPI threaded, the \
             server end's thread pinned to CPU {SERVER_CPU} and the sender and client end's \
             thread to CPU {SENDER_CPU}; the server thread's own run time \
             (`/proc/PID/schedstat`) over the SYNs it received. Its receive path, the filter, \
             the host's stack and the answer up to its hand-off to the peer all run in it. \
             Both are also given less the floor's cost (\"over floor\"). **Programs' ns/SYN**: \
             {PROGRAM_ROUNDS} more rounds with the kernel's BPF run-time statistics on, the run \
             time of the case's own programs (limiter's XDP and TC programs, or the anchor's) \
             over the SYNs received; the statistics' clock reads are included. The connects: one \
             more round per case at the sender's full rate, {CONNECTS} connects from the \
             client's own address, each allowed {} ms (under the 1 s before a SYN is sent \
             again), so each that connects did so on its first SYN; while some miss, the \
             flood's rate is halved and they are tried again (at most {HALVINGS} times).",
            FIRST_TRY.as_millis()
        ),
    );
    let rows: Vec<Vec<String>> = Case::ALL
        .into_iter()
        .enumerate()
        .map(|(i, case)| {
            vec![
                case.name().to_owned(),
                format!("{:.2}", host[i]),
                format!("{:.2}", host[i] / floor_host),
                format!("{:.2}", host[i] - floor_host),
                format!("{:.0}", server[i]),
                format!("{:.2}", server[i] / floor_server),
                format!("{:.0}", server[i] - floor_server),
                format!("{:.0}", programs[i]),
                probes[i].as_ref().map_or_else(
                    || "— (drops all)".to_owned(),
                    |steps| {
                        steps
                            .iter()
                            .map(|(ok, rate)| {
                                format!("{ok}/{CONNECTS} at {:.0}k SYN/s", rate / 1e3)
                            })
                            .collect::<Vec<_>>()
                            .join("; ")
                    },
                ),
            ]
        })
        .collect();
    report.table(
        &[
            "case",
            "host µs/SYN",
            "/ floor",
            "over floor µs",
            "server ns/SYN",
            "/ floor",
            "over floor ns",
            "programs' ns/SYN",
            "first-try connects during the flood",
        ],
        &rows,
    );
    let mut targets = Vec::new();
    for cookies in [Case::CookiesTc, Case::CookiesXdpTx] {
        let c = at(cookies);
        targets.push(vec![
            format!("{} / floor", cookies.name()),
            format!("{:.2}", host[c] / floor_host),
            "—".to_owned(),
            format!("{:.2}", server[c] / floor_server),
            "—".to_owned(),
            Target(2.0).judge(host[c] / floor_host),
        ]);
        report.summary(format!(
            "{} / floor {:.2} ({})",
            cookies.name(),
            host[c] / floor_host,
            Target(2.0).judge(host[c] / floor_host)
        ));
    }
    for other in [Case::Kernel, Case::Synproxy] {
        for cookies in [Case::CookiesTc, Case::CookiesXdpTx] {
            let (o, c) = (at(other), at(cookies));
            targets.push(vec![
                format!("{} / {}", other.name(), cookies.name()),
                format!("{:.2}", host[o] / host[c]),
                format!("{:.2}", (host[o] - floor_host) / (host[c] - floor_host)),
                format!("{:.2}", server[o] / server[c]),
                format!(
                    "{:.2}",
                    (server[o] - floor_server) / (server[c] - floor_server)
                ),
                AtLeast(3.0).judge(host[o] / host[c]),
            ]);
            report.summary(format!(
                "{} / {} {:.2} ({})",
                other.name(),
                cookies.name(),
                host[o] / host[c],
                AtLeast(3.0).judge(host[o] / host[c])
            ));
        }
    }
    report.table(
        &[
            "ratio",
            "host",
            "host over floor",
            "server",
            "server over floor",
            "target (host)",
        ],
        &targets,
    );
    report.note(
        "The targets are judged on the issue's metric (host); the other columns say how much of \
         each ratio the shared cost hides: \"over floor\" divides what each case costs beyond \
         the floor.",
    );
    let ceiling: Vec<String> = [Case::CookiesTc, Case::CookiesXdpTx]
        .into_iter()
        .map(|cookies| {
            let (k, s, c) = (at(Case::Kernel), at(Case::Synproxy), at(cookies));
            format!(
                "{}: {:.2} against the kernel alone, {:.2} against SYNPROXY",
                cookies.name(),
                (host[k] - floor_host) * 1e3 / programs[c],
                (host[s] - floor_host) * 1e3 / programs[c]
            )
        })
        .collect();
    report.note(&format!(
        "The most limiter could gain were all but its own programs free: the others' host cost \
         over the floor divided by limiter's programs' ns/SYN. {}.",
        ceiling.join("; ")
    ));
    let lossy: Vec<String> = Case::ALL
        .into_iter()
        .zip(&lost)
        .filter(|(_, lost)| **lost > 0.01)
        .map(|(case, lost)| format!("{} {:.0}%", case.name(), lost * 100.0))
        .collect();
    if !lossy.is_empty() {
        report.note(&format!(
            "In the threaded rounds the sender outran the server's thread, and the veth dropped \
             SYNs before it (median share of those sent): {}; the server figures divide by the \
             SYNs received.",
            lossy.join(", ")
        ));
    }
    if !short.is_empty() {
        report.note(&format!(
            "Fewer than {SYNS} SYNs sent in {CASE_LIMIT:?}, or under 99% of them received, in \
             some round: {}.",
            short.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    report.finish()
}

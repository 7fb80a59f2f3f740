//! `cargo xtask bench kernel`: nanoseconds per packet of each datapath path under
//! BPF_PROG_TEST_RUN, each beside an XDP program that only passes, measured in the same run.
//!
//! Paths that leave no state behind (established segments, a retransmitted refused SYN) run
//! with the kernel's own repeat loop; paths that change state (an admitted SYN, an
//! ACK that completes a handshake, a refused new connection attempt) run once per call on
//! fresh frames, and so does their anchor. Each path and its anchor take turns over rounds
//! ([`REPEATED_ROUNDS`], or [`ROUNDS`] for the fresh-frame paths, each round a share of the
//! frames), and the mean of each one's middle half is printed: on a shared machine a single
//! measurement of either moves by 20%, and the kernel reports a repeat loop's mean in whole
//! nanoseconds, a step of 3% of a 35 ns anchor that only many rounds average out.

use std::net::{IpAddr, Ipv4Addr};

use aya::{
    Ebpf, TestRun, TestRunResult,
    programs::{SchedClassifier, TestRunOptions, Xdp},
};
use limiter_tests::{
    frames::{Flags, Tcp},
    kernel::{Kernel, handshake, isn},
    report::{Report, Target},
};

const REPEAT: u32 = 200_000;
const REPEATED_ROUNDS: usize = 41;
const SINGLE_RUNS: usize = 50_000;
const ROUNDS: usize = 5;
/// Overrides loaded for the policy-cost rows: an operator's exceptions, well beyond a handful.
const OVERRIDES: usize = 1_000;

/// The port profiles of the policy-cost rows: the paths' port in one of them, another beside
/// it, and the top level's on a third port; limits as the top level's, so that only finding
/// them differs.
const PROFILES: [&str; 6] = [
    "--ports",
    "1883",
    "--profile",
    "amqp:ports=5672,max-conn-per-ip=100,max-conn-total=1000000,syn-rate=1000000000",
    "--profile",
    "dashboard:ports=8080,max-conn-per-ip=4",
];

fn anchor() -> Ebpf {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../target/ebpf/bpfel-unknown-none/release/pass"
    );
    let mut ebpf = Ebpf::load_file(path).expect("the anchor object (cargo xtask build builds it)");
    let prog: &mut Xdp = ebpf.program_mut("pass").unwrap().try_into().unwrap();
    prog.load().unwrap();
    let prog: &mut SchedClassifier = ebpf.program_mut("pass_tc").unwrap().try_into().unwrap();
    prog.load().unwrap();
    ebpf
}

/// Mean nanoseconds per run over `repeat` kernel-side repeats.
fn repeated(prog: &Xdp, frame: &[u8]) -> f64 {
    let result = prog
        .test_run(TestRunOptions {
            data_in: Some(frame),
            repeat: REPEAT,
            ..Default::default()
        })
        .unwrap();
    result.duration.as_nanos() as f64
}

/// Mean nanoseconds over one run per call, one frame each.
fn single<P>(prog: &P, frames: &[Vec<u8>]) -> f64
where
    P: for<'a> TestRun<Opts<'a> = TestRunOptions<'a>, Result = TestRunResult>,
{
    let total: u128 = frames
        .iter()
        .map(|frame| {
            prog.test_run(TestRunOptions {
                data_in: Some(frame),
                ..Default::default()
            })
            .unwrap()
            .duration
            .as_nanos()
        })
        .sum();
    total as f64 / frames.len() as f64
}

fn xdp<'a>(ebpf: &'a Ebpf, name: &str) -> &'a Xdp {
    ebpf.program(name).unwrap().try_into().unwrap()
}

fn limiter(kernel: &Kernel) -> &Xdp {
    xdp(kernel.dp.ebpf(), limiter::datapath::XDP_PROGRAM)
}

/// The mean of the middle half: robust to the rounds a noisy neighbour slowed (or a lucky one
/// sped up), finer than the whole-nanosecond steps of any one round.
fn middle_mean(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let quarter = values.len() / 4;
    let middle = &values[quarter..values.len() - quarter];
    middle.iter().sum::<f64>() / middle.len() as f64
}

/// `path` and `anchor` run in turns for `rounds` rounds, each given the round's number;
/// returns the middle means of both.
fn in_turns(
    rounds: usize,
    mut path: impl FnMut(usize) -> f64,
    mut anchor: impl FnMut(usize) -> f64,
) -> (f64, f64) {
    let (mut paths, mut anchors) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        paths.push(path(round));
        anchors.push(anchor(round));
    }
    (middle_mean(paths), middle_mean(anchors))
}

/// The frames of `round` when `frames` are shared out over the rounds.
fn share(frames: &[Vec<u8>], round: usize) -> &[Vec<u8>] {
    let size = frames.len() / ROUNDS;
    &frames[round * size..(round + 1) * size]
}

fn main() -> anyhow::Result<()> {
    let anchor_obj = anchor();
    let pass = xdp(&anchor_obj, "pass");
    let server = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 1));
    let client = |i: usize| IpAddr::V4(Ipv4Addr::new(10, (i >> 16) as u8, (i >> 8) as u8, i as u8));
    let syn = |i: usize| Tcp::syn(client(i), 1024 + (i % 60_000) as u16, server, 5672);

    // Every path runs with the limits a broker host would use.
    let limits = [
        "--max-conn-per-ip",
        "100",
        "--max-conn-total",
        "1000000",
        "--syn-rate",
        "1000000000",
        "--flow-table-size",
        "262144",
    ];
    let k = Kernel::new(&limits);
    // The same with two port profiles and 1,000 overrides, /24s that cover every client the
    // paths use (their limits the top level's, so that only the lookups differ).
    let override_flags: Vec<String> = (0..OVERRIDES)
        .flat_map(|i| {
            [
                "--override".to_owned(),
                format!("10.{}.{}.0/24:max-conn-per-ip=100", i / 256, i % 256),
            ]
        })
        .collect();
    let with_overrides: Vec<&str> = limits
        .iter()
        .copied()
        .chain(PROFILES)
        .chain(override_flags.iter().map(String::as_str))
        .collect();
    let ko = Kernel::new(&with_overrides);
    let mut rows: Vec<(&str, (f64, f64), Option<Target>)> = Vec::new();

    // The established fast path: one tracked flow, its segments run by the kernel's loop.
    let flow = syn(SINGLE_RUNS + 1);
    k.connect(&flow);
    ko.connect(&flow);
    let mut data = flow.with_flags(Flags {
        ack: true,
        ..Flags::default()
    });
    data.seq = flow.seq.wrapping_add(1);
    data.ack = isn(flow.sport).wrapping_add(1001);
    data.tcp_options = false;
    let pure_ack = data.build();
    data.payload = vec![0x5A; 512];
    let data = data.build();
    rows.push((
        "established data segment",
        in_turns(
            REPEATED_ROUNDS,
            |_| repeated(limiter(&k), &data),
            |_| repeated(pass, &data),
        ),
        Some(Target(1.3)),
    ));
    rows.push((
        "established pure ACK",
        in_turns(
            REPEATED_ROUNDS,
            |_| repeated(limiter(&k), &pure_ack),
            |_| repeated(pass, &pure_ack),
        ),
        Some(Target(1.3)),
    ));

    // The cost of the profiles and overrides: the same paths with and without them, in turns.
    let mut costs: Vec<(&str, (f64, f64), Option<Target>)> = vec![(
        "established data segment",
        in_turns(
            REPEATED_ROUNDS,
            |_| repeated(limiter(&ko), &data),
            |_| repeated(limiter(&k), &data),
        ),
        Some(Target(1.1)),
    )];

    // A source that holds a connection pays the override lookup at its SYN by design (it
    // meets its cap and rate there); a new source, the row after, does not. Repeated: such
    // a SYN changes nothing.
    let holder = syn(SINGLE_RUNS + 2);
    k.connect(&holder);
    ko.connect(&holder);
    let mut again = holder.clone();
    again.sport += 1;
    let again = again.build();
    costs.push((
        "SYN of a source holding a connection",
        in_turns(
            REPEATED_ROUNDS,
            |_| repeated(limiter(&ko), &again),
            |_| repeated(limiter(&k), &again),
        ),
        None,
    ));

    // New sources' SYNs, each admitted: one run per fresh frame.
    let syns: Vec<Vec<u8>> = (0..SINGLE_RUNS).map(|i| syn(i).build()).collect();
    // On fresh kernels, so that neither has seen these sources.
    {
        let (plain, overridden) = (Kernel::new(&limits), Kernel::new(&with_overrides));
        costs.push((
            "admitted SYN of a new source",
            in_turns(
                ROUNDS,
                |round| single(limiter(&overridden), share(&syns, round)),
                |round| single(limiter(&plain), share(&syns, round)),
            ),
            Some(Target(1.1)),
        ));
    }
    rows.push((
        "admitted SYN, 262,144-slot table",
        in_turns(
            ROUNDS,
            |round| single(limiter(&k), share(&syns, round)),
            |round| single(pass, share(&syns, round)),
        ),
        Some(Target(4.0)),
    ));

    // The host's SYN-ACKs through TC egress, each writing its connection's half-open record
    // (a TC anchor that only passes), then the ACKs that complete the handshakes.
    let (syn_acks, acks): (Vec<Vec<u8>>, Vec<Vec<u8>>) = (0..SINGLE_RUNS)
        .map(|i| {
            let h = handshake(&syn(i), isn(syn(i).sport));
            (h.syn_ack, h.ack)
        })
        .unzip();
    let tc_anchor: &SchedClassifier = anchor_obj.program("pass_tc").unwrap().try_into().unwrap();
    let egress: &SchedClassifier =
        k.dp.ebpf()
            .program(limiter::datapath::TC_PROGRAM)
            .unwrap()
            .try_into()
            .unwrap();
    rows.push((
        "host's SYN-ACK (TC), records half-open",
        in_turns(
            ROUNDS,
            |round| single(egress, share(&syn_acks, round)),
            |round| single(tc_anchor, share(&syn_acks, round)),
        ),
        None,
    ));
    rows.push((
        "handshake-completing ACK",
        in_turns(
            ROUNDS,
            |round| single(limiter(&k), share(&acks, round)),
            |round| single(pass, share(&acks, round)),
        ),
        None,
    ));

    // A source past its SYN rate (its one token spent by a completed handshake): the SYN is
    // refused (dropped). Repeated, the same SYN is a retransmission of a refused attempt,
    // which changes nothing; fresh SYNs (a new ISN each) are new attempts, each counted
    // against the source, one run per call.
    let rate = Kernel::new(&["--syn-rate", "1", "--syn-burst", "1"]);
    rate.connect(&syn(1));
    let mut over = syn(1);
    over.sport += 1;
    let attempts: Vec<Vec<u8>> = (0..SINGLE_RUNS as u32)
        .map(|i| {
            let mut attempt = over.clone();
            attempt.seq = over.seq.wrapping_add(i.wrapping_mul(0x9E37_79B9));
            attempt.build()
        })
        .collect();
    let over = over.build();
    rows.push((
        "refused SYN (rate), retransmitted",
        in_turns(
            REPEATED_ROUNDS,
            |_| repeated(limiter(&rate), &over),
            |_| repeated(pass, &over),
        ),
        None,
    ));
    rows.push((
        "refused SYN (rate), new attempts",
        in_turns(
            ROUNDS,
            |round| single(limiter(&rate), share(&attempts, round)),
            |round| single(pass, share(&attempts, round)),
        ),
        None,
    ));

    let mut report = Report::new(
        "kernel",
        "kernel",
        "Kernel datapath: nanoseconds per packet",
        &format!(
            "Each path of the kernel programs under `BPF_PROG_TEST_RUN`, beside an anchor that \
             only returns (`XDP_PASS`, or `TC_ACT_OK` for the egress row), in the same run. \
             Paths that leave no state behind run in the kernel's repeat loop ({REPEAT} runs a \
             call, {REPEATED_ROUNDS} rounds); paths that change state run once per call on \
             fresh frames ({SINGLE_RUNS} frames over {ROUNDS} rounds), and so does their \
             anchor, which then includes the per-call overhead. A path and its anchor take \
             turns, and each figure is the mean of its rounds' middle half. Limits as a broker \
             host would set them: 100 per source, 1,000,000 in all, a SYN rate that never \
             refuses, a 262,144-entry flow table."
        ),
    );
    let mut headline = Vec::new();
    let rows: Vec<Vec<String>> = rows
        .into_iter()
        .map(|(path, (ns, anchor), target)| {
            let ratio = ns / anchor;
            if let Some(t) = target {
                headline.push(format!(
                    "{path} {ratio:.2} × its anchor ({})",
                    t.judge(ratio)
                ));
            }
            vec![
                path.to_owned(),
                format!("{ns:.1}"),
                format!("{anchor:.1}"),
                format!("{ratio:.2}"),
                target.map_or_else(String::new, |t| t.judge(ratio)),
            ]
        })
        .collect();
    report.table(
        &["path", "ns/packet", "anchor ns", "ratio", "target"],
        &rows,
    );
    report.note(&format!(
        "With two port profiles (`[profiles.NAME]`, the paths' port in one) and {OVERRIDES} \
         overrides (`[[overrides]]`, /24s covering every source the paths use) loaded, beside \
         the same path without them, in turns in the same run. A SYN of a source that holds a \
         connection looks its override up by design, to meet its own cap and rate; a new \
         source's SYN, the one a flood is made of, does not:"
    ));
    let costs: Vec<Vec<String>> = costs
        .into_iter()
        .map(|(path, (with, without), target)| {
            let ratio = with / without;
            if let Some(t) = target {
                headline.push(format!(
                    "{path} with profiles and {OVERRIDES} overrides {ratio:.2} × without ({})",
                    t.judge(ratio)
                ));
            }
            vec![
                path.to_owned(),
                format!("{with:.1}"),
                format!("{without:.1}"),
                format!("{ratio:.2}"),
                target.map_or_else(String::new, |t| t.judge(ratio)),
            ]
        })
        .collect();
    report.table(
        &[
            "path",
            "ns/packet with profiles and overrides",
            "without",
            "ratio",
            "target",
        ],
        &costs,
    );
    for figure in headline {
        report.summary(figure);
    }
    report.finish()
}

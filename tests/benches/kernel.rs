//! `cargo xtask bench kernel`: nanoseconds per packet of each datapath path under
//! BPF_PROG_TEST_RUN, each beside an XDP program that only passes, measured in the same run.
//!
//! Paths that leave no state behind run with the kernel's own repeat loop; paths that change
//! state (a SYN admitted, a SYN answered with an RST, which rewrites the frame) run once per
//! call on fresh frames, and so does their anchor.

use std::net::{IpAddr, Ipv4Addr};

use aya::{
    Ebpf, TestRun,
    programs::{TestRunOptions, Xdp},
};
use limiter_tests::{
    frames::{self, Flags, Tcp},
    kernel::Kernel,
};

const REPEAT: u32 = 1_000_000;
const SINGLE_RUNS: usize = 50_000;

fn anchor() -> Ebpf {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../target/ebpf/bpfel-unknown-none/release/pass"
    );
    let mut ebpf = Ebpf::load_file(path).expect("the anchor object (cargo xtask build builds it)");
    let prog: &mut Xdp = ebpf.program_mut("pass").unwrap().try_into().unwrap();
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
fn single(prog: &Xdp, frames: &[Vec<u8>]) -> f64 {
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

fn main() {
    let anchor_obj = anchor();
    let pass = xdp(&anchor_obj, "pass");
    let server = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 1));
    let client = |i: usize| IpAddr::V4(Ipv4Addr::new(10, (i >> 16) as u8, (i >> 8) as u8, i as u8));
    let syns: Vec<Vec<u8>> = (0..SINGLE_RUNS)
        .map(|i| Tcp::syn(client(i), 1024 + (i % 60_000) as u16, server, 5672).build())
        .collect();

    // Every path runs with the limits a broker host would use.
    let flags = [
        "--max-conn-per-ip",
        "100",
        "--max-conn-total",
        "1000000",
        "--syn-rate",
        "1000000000",
        "--flow-table-size",
        "262144",
    ];
    let admit = Kernel::new(&flags);

    let mut rows: Vec<(&str, f64, f64)> = Vec::new();
    let anchor_single = single(pass, &syns);
    rows.push((
        "SYN admitted, new source",
        single(limiter(&admit), &syns),
        anchor_single,
    ));
    // The same sources again on other ports: their counters and buckets exist already.
    let known: Vec<Vec<u8>> = (0..SINGLE_RUNS)
        .map(|i| Tcp::syn(client(i), 1032 + (i % 60_000) as u16, server, 5672).build())
        .collect();
    rows.push((
        "SYN admitted, known source",
        single(limiter(&admit), &known),
        anchor_single,
    ));

    let refuse = Kernel::new(&["--max-conn-per-ip", "1", "--flow-table-size", "1024"]);
    let first = Tcp::syn(client(1), 1, server, 5672);
    refuse.xdp(&first.build());
    let refused: Vec<Vec<u8>> = (0..SINGLE_RUNS)
        .map(|i| Tcp::syn(client(1), 2 + (i % 60_000) as u16, server, 5672).build())
        .collect();
    rows.push((
        "SYN refused, RST built",
        single(limiter(&refuse), &refused),
        anchor_single,
    ));

    let drop = Kernel::new(&[
        "--max-conn-per-ip",
        "1",
        "--reject-conn",
        "drop",
        "--flow-table-size",
        "1024",
    ]);
    drop.xdp(&first.build());
    let refused_frame = Tcp::syn(client(1), 2, server, 5672).build();
    let anchor_repeat = repeated(pass, &refused_frame);
    rows.push((
        "SYN refused, dropped",
        repeated(limiter(&drop), &refused_frame),
        anchor_repeat,
    ));

    let tracked = first
        .with_flags(Flags {
            ack: true,
            ..Flags::default()
        })
        .build();
    rows.push((
        "packet of a tracked flow",
        repeated(limiter(&refuse), &tracked),
        anchor_repeat,
    ));

    let retransmit = first.build();
    rows.push((
        "retransmitted SYN",
        repeated(limiter(&refuse), &retransmit),
        anchor_repeat,
    ));

    let udp = frames::udp(client(1), server);
    rows.push((
        "non-TCP",
        repeated(limiter(&refuse), &udp),
        repeated(pass, &udp),
    ));

    println!(
        "kernel datapath, ns per packet under BPF_PROG_TEST_RUN (anchor: XDP_PASS-only program, same run)"
    );
    println!(
        "{:<28} {:>10} {:>10} {:>8}",
        "path", "ns/packet", "anchor ns", "ratio"
    );
    for (path, ns, anchor) in rows {
        println!("{path:<28} {ns:>10.1} {anchor:>10.1} {:>8.2}", ns / anchor);
    }
}

//! The XDP program under BPF_PROG_TEST_RUN on frames built with etherparse.

use aya::{
    TestRun,
    programs::{TestRunOptions, Xdp},
};
use limiter::{
    loader::{Datapath, XDP_PROGRAM},
    maps,
};
use limiter_common::Stat;
use limiter_tests::frames;

const XDP_PASS: u32 = 2;

#[test]
fn xdp_passes_a_syn_and_counts_it() {
    let mut datapath = Datapath::load().expect("loading the programs");
    let before = maps::stat(&datapath, Stat::XdpPackets).unwrap();
    let frame = frames::syn_v4([10, 0, 0, 2], 40000, [10, 0, 0, 1], 5672);
    let prog: &mut Xdp = datapath
        .ebpf_mut()
        .program_mut(XDP_PROGRAM)
        .unwrap()
        .try_into()
        .unwrap();
    let result = prog
        .test_run(TestRunOptions {
            data_in: Some(&frame),
            repeat: 3,
            ..Default::default()
        })
        .expect("BPF_PROG_TEST_RUN");
    assert_eq!(result.return_value, XDP_PASS);
    assert_eq!(maps::stat(&datapath, Stat::XdpPackets).unwrap(), before + 3);
}

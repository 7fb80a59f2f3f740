//! The benchmarks' anchors, measured beside limiter's programs in the same run: an XDP program
//! that passes every packet (the floor of `BPF_PROG_TEST_RUN`), its TC twin (the floor of the
//! egress program's test runs), and one that drops every packet (the floor of a SYN flood's
//! cost on a real interface), with the spoofed flood's client end (`spoofed_sink`).
#![no_std]
#![no_main]

mod spoofed_sink;

use aya_ebpf::{
    bindings::{TC_ACT_OK, xdp_action},
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};

#[xdp]
pub fn pass(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

#[classifier]
pub fn pass_tc(_ctx: TcContext) -> i32 {
    TC_ACT_OK
}

#[xdp]
pub fn drop_all(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_DROP
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::{TC_ACT_OK, xdp_action},
    macros::{classifier, map, xdp},
    maps::PerCpuArray,
    programs::{TcContext, XdpContext},
};
use limiter_common::Stat;

#[map]
static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(Stat::COUNT, 0);

fn count(stat: Stat) {
    if let Some(slot) = STATS.get_ptr_mut(stat as u32) {
        // Per-CPU slot: no other CPU writes it, so a plain add is exact.
        unsafe { *slot += 1 };
    }
}

#[xdp]
pub fn limiter_xdp(_ctx: XdpContext) -> u32 {
    count(Stat::XdpPackets);
    xdp_action::XDP_PASS
}

#[classifier]
pub fn limiter_tc(_ctx: TcContext) -> i32 {
    count(Stat::TcPackets);
    TC_ACT_OK
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

//! The spoofed flood bench's client end: the host's answers to the flood's forged sources
//! must leave the server's namespace and be dropped where they land, as on the internet,
//! while a real client on the same veth still gets its own. An XDP program on the client's
//! end does both, and gives that end of the veth the NAPI that `XDP_TX` replies need.

use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};

/// 198.18.0.0/15, the benchmarking range the flood's sources are drawn from.
const SPOOFED_NET: u32 = 0xC612_0000;
const SPOOFED_MASK: u32 = 0xFFFE_0000;
const ETH_P_IP: u16 = 0x0800;
/// Ethernet's 14 bytes, then the IPv4 destination at offset 16 of its header.
const DST_AT: usize = 14 + 16;

/// Drops IPv4 frames to the spoofed range; passes every other frame.
#[xdp]
pub fn spoofed_sink(ctx: XdpContext) -> u32 {
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + DST_AT + 4 > end {
        return xdp_action::XDP_PASS;
    }
    // SAFETY: both reads lie within the frame, checked above.
    let (ethertype, dst) = unsafe {
        (
            u16::from_be((start as *const u8).add(12).cast::<u16>().read_unaligned()),
            u32::from_be(
                (start as *const u8)
                    .add(DST_AT)
                    .cast::<u32>()
                    .read_unaligned(),
            ),
        )
    };
    if ethertype == ETH_P_IP && dst & SPOOFED_MASK == SPOOFED_NET {
        xdp_action::XDP_DROP
    } else {
        xdp_action::XDP_PASS
    }
}

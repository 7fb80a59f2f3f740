//! The RSTs limiter sends, built in place over the packet that prompted them:
//!
//! - the RST|ACK answering a refused SYN, sent back out of the interface: by `XDP_TX`, or,
//!   on interfaces where that needs the peer's cooperation (a veth whose peer runs no XDP
//!   program drops `XDP_TX` frames), by `limiter_tc_ingress`, which finds the SYN marked in
//!   its XDP metadata and redirects the answer out of the interface's egress;
//! - the RST that replaces a handshake-completing ACK refused over a cap, passed on to the
//!   host so it drops the embryonic connection.
//!
//! The reply keeps the Ethernet header and VLAN tags (MACs swapped for an answer) and writes
//! fresh IP and TCP headers after them: no IP options, no IPv6 extension headers, no TCP
//! options. The headers are built on the stack with full checksums (a local sender's checksum
//! may be left partial by offload, so nothing of the original's is reused), then copied over
//! the original, which is at least as long, and the packet is trimmed to the reply's length.

use aya_ebpf::{
    helpers::{bpf_skb_change_tail, bpf_xdp_adjust_meta, bpf_xdp_adjust_tail},
    programs::{TcContext, XdpContext},
};
use limiter_common::RST_MARK;

use crate::{
    headers::{
        Be16, Be32, ETH_ALEN, IPV4_DONT_FRAGMENT, IPV4_HLEN, IPV6_HLEN, Ipv4Hdr, Ipv6Hdr, TCP_HLEN,
        TcpHdr, Window, add_words, as_bytes, fold,
    },
    parsing::{Endpoints, IPPROTO_TCP, MAX_L3_OFFSET, Segment, SegmentMeta, TCP_ACK, TCP_RST},
};

const TTL: u8 = 64;

/// One RST: its headers (a [`Segment`], laid out as the verifier needs) and where it goes.
struct Rst {
    headers: Segment,
    /// Back to the sender (MACs swapped), or on towards the host.
    answer: bool,
}

/// RST|ACK from the SYN's destination: seq 0, ack = the SYN's seq + 1 (RFC 9293 3.10.7.1).
#[inline(always)]
fn answering(syn: &Segment) -> Rst {
    Rst {
        headers: Segment::new(
            Endpoints {
                src: syn.dst,
                dst: syn.src,
                sport: syn.dport,
                dport: syn.sport,
                seq: 0,
                ack: syn.seq.wrapping_add(1),
            },
            SegmentMeta {
                flags: TCP_RST | TCP_ACK,
                ipv6: syn.ipv6(),
                fragment: false,
                l3_offset: syn.l3_offset(),
            },
        ),
        answer: true,
    }
}

/// A RST in the ACK's place, from the client, at the ACK's sequence number: the host finds it
/// in window and drops the embryonic connection (a SYN cookie's listener just discards it).
#[inline(always)]
fn replacing(ack: &Segment) -> Rst {
    Rst {
        headers: Segment::new(
            Endpoints {
                src: ack.src,
                dst: ack.dst,
                sport: ack.sport,
                dport: ack.dport,
                seq: ack.seq,
                ack: 0,
            },
            SegmentMeta {
                flags: TCP_RST,
                ipv6: ack.ipv6(),
                fragment: false,
                l3_offset: ack.l3_offset(),
            },
        ),
        answer: false,
    }
}

/// Rewrites the XDP frame into the RST|ACK answering `syn`, for `XDP_TX`.
#[inline(always)]
pub fn xdp_answer(ctx: &XdpContext, syn: &Segment) -> bool {
    xdp_rewrite(ctx, &answering(syn))
}

/// Rewrites the XDP frame (a handshake-completing ACK) into a RST to the host.
#[inline(always)]
pub fn xdp_replace(ctx: &XdpContext, ack: &Segment) -> bool {
    xdp_rewrite(ctx, &replacing(ack))
}

#[inline(never)]
fn xdp_rewrite(ctx: &XdpContext, rst: &Rst) -> bool {
    let w = Window::of_xdp(ctx);
    let Some(new_len) = write(&w, rst) else {
        return false;
    };
    let delta = new_len as i32 - w.len() as i32;
    // SAFETY: shrinking an XDP frame we own; `delta` is never positive here.
    delta == 0 || unsafe { bpf_xdp_adjust_tail(ctx.ctx, delta) } == 0
}

/// Marks the frame (a refused SYN) for `limiter_tc_ingress` to answer; false if the driver
/// offers no metadata room (the caller then answers with `XDP_TX`).
#[inline(always)]
pub fn xdp_mark(ctx: &XdpContext) -> bool {
    let size = core::mem::size_of::<u32>();
    // SAFETY: growing the metadata area in front of the frame we own.
    if unsafe { bpf_xdp_adjust_meta(ctx.ctx, -(size as i32)) } != 0 {
        return false;
    }
    let (meta, data) = (ctx.metadata(), ctx.data());
    if meta + size > data {
        return false;
    }
    // SAFETY: the bounds check above keeps the write inside the metadata area.
    unsafe { core::ptr::write_unaligned(meta as *mut u32, RST_MARK) };
    true
}

/// Whether XDP marked this packet for an answer; the mark is cleared, so that the answer,
/// whose metadata may travel with it (a veth hands the skb to its peer as it is), is never
/// taken for a marked SYN again.
#[inline(always)]
pub fn tc_take_mark(ctx: &TcContext) -> bool {
    // SAFETY: reading two fields of the context the program was given.
    let (meta, data) = unsafe { ((*ctx.skb.skb).data_meta as usize, ctx.data()) };
    let size = core::mem::size_of::<u32>();
    if meta + size > data {
        return false;
    }
    // SAFETY: the bounds check above keeps the accesses inside the metadata area.
    unsafe {
        if core::ptr::read_unaligned(meta as *const u32) != RST_MARK {
            return false;
        }
        core::ptr::write_unaligned(meta as *mut u32, 0);
    }
    true
}

/// Rewrites the skb (a marked SYN) into the RST|ACK answering it, ready to redirect.
#[inline(never)]
pub fn tc_answer(ctx: &TcContext, syn: &Segment) -> bool {
    let w = Window::of_tc(ctx);
    let Some(new_len) = write(&w, &answering(syn)) else {
        return false;
    };
    // SAFETY: trimming the skb we were given to the reply's length (at most its own).
    unsafe { bpf_skb_change_tail(ctx.skb.skb, new_len as u32, 0) == 0 }
}

/// Writes `rst` over the packet in `w`; returns the reply's length, or `None` if the packet
/// could not hold it (then the caller drops it instead).
#[inline(always)]
fn write(w: &Window, rst: &Rst) -> Option<usize> {
    let answer = rst.answer;
    let rst = &rst.headers;
    let l3 = usize::from(rst.l3_offset());
    if l3 > MAX_L3_OFFSET {
        return None;
    }
    if answer {
        let macs = w.read::<[u8; 2 * ETH_ALEN]>(0)?;
        let mut swapped = [0u8; 2 * ETH_ALEN];
        swapped[..ETH_ALEN].copy_from_slice(&macs[ETH_ALEN..]);
        swapped[ETH_ALEN..].copy_from_slice(&macs[..ETH_ALEN]);
        w.write(0, &swapped)?;
    }
    let tcp = tcp_header(rst);
    if rst.ipv6() {
        let tcp = with_checksum(tcp, pseudo_v6(rst));
        w.write(l3, &ipv6_header(rst))?;
        w.write(l3 + IPV6_HLEN, &tcp)?;
        Some(l3 + IPV6_HLEN + TCP_HLEN)
    } else {
        let tcp = with_checksum(tcp, pseudo_v4(rst));
        w.write(l3, &ipv4_header(rst))?;
        w.write(l3 + IPV4_HLEN, &tcp)?;
        Some(l3 + IPV4_HLEN + TCP_HLEN)
    }
}

#[inline(always)]
fn tcp_header(rst: &Segment) -> TcpHdr {
    TcpHdr {
        sport: Be16::new(rst.sport),
        dport: Be16::new(rst.dport),
        seq: Be32::new(rst.seq),
        ack: Be32::new(rst.ack),
        data_offset: ((TCP_HLEN / 4) as u8) << 4,
        flags: rst.flags(),
        window: Be16::new(0),
        check: Be16::new(0),
        urgent: Be16::new(0),
    }
}

#[inline(always)]
fn ipv4_header(rst: &Segment) -> Ipv4Hdr {
    let mut h = Ipv4Hdr {
        version_ihl: 0x45,
        tos: 0,
        total_len: Be16::new((IPV4_HLEN + TCP_HLEN) as u16),
        id: Be16::new(0),
        frag_off: Be16::new(IPV4_DONT_FRAGMENT),
        ttl: TTL,
        protocol: IPPROTO_TCP,
        check: Be16::new(0),
        src: [rst.src[12], rst.src[13], rst.src[14], rst.src[15]],
        dst: [rst.dst[12], rst.dst[13], rst.dst[14], rst.dst[15]],
    };
    h.check = Be16::new(!fold(h.word_sum()));
    h
}

#[inline(always)]
fn ipv6_header(rst: &Segment) -> Ipv6Hdr {
    Ipv6Hdr {
        version_class_flow: Be32::new(6 << 28),
        payload_len: Be16::new(TCP_HLEN as u16),
        next_header: IPPROTO_TCP,
        hop_limit: TTL,
        src: rst.src,
        dst: rst.dst,
    }
}

/// Sum of the pseudo-header words: addresses, protocol and TCP length.
#[inline(always)]
fn pseudo_v4(rst: &Segment) -> u64 {
    let sum = add_words(0, &[rst.src[12], rst.src[13], rst.src[14], rst.src[15]]);
    let sum = add_words(sum, &[rst.dst[12], rst.dst[13], rst.dst[14], rst.dst[15]]);
    sum + u64::from(IPPROTO_TCP) + TCP_HLEN as u64
}

#[inline(always)]
fn pseudo_v6(rst: &Segment) -> u64 {
    let sum = add_words(0, &rst.src);
    let sum = add_words(sum, &rst.dst);
    sum + u64::from(IPPROTO_TCP) + TCP_HLEN as u64
}

#[inline(always)]
fn with_checksum(mut tcp: TcpHdr, pseudo: u64) -> TcpHdr {
    tcp.check = Be16::new(!fold(add_words(pseudo, as_bytes::<TcpHdr, TCP_HLEN>(&tcp))));
    tcp
}

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

use crate::parsing::{
    IPPROTO_TCP, IPV4_HLEN, IPV6_HLEN, MAX_L3_OFFSET, Segment, TCP_ACK, TCP_HLEN, TCP_RST, Window,
};

const ETH_ALEN: usize = 6;
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
            syn.dst,
            syn.src,
            syn.dport,
            syn.sport,
            0,
            syn.seq.wrapping_add(1),
            TCP_RST | TCP_ACK,
            syn.ipv6(),
            false,
            syn.l3_offset(),
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
            ack.src,
            ack.dst,
            ack.sport,
            ack.dport,
            ack.seq,
            0,
            TCP_RST,
            ack.ipv6(),
            false,
            ack.l3_offset(),
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
    let w = Window {
        start: ctx.data(),
        end: ctx.data_end(),
    };
    let Some(new_len) = write(&w, rst) else {
        return false;
    };
    let delta = new_len as i32 - (w.end - w.start) as i32;
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
    let w = Window {
        start: ctx.data(),
        end: ctx.data_end(),
    };
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
        put(w, 0, &swapped)?;
    }
    let tcp = tcp_header(rst);
    if rst.ipv6() {
        let tcp = with_checksum(tcp, pseudo_v6(rst));
        put(w, l3, &ipv6_header(rst))?;
        put(w, l3 + IPV6_HLEN, &tcp)?;
        Some(l3 + IPV6_HLEN + TCP_HLEN)
    } else {
        let tcp = with_checksum(tcp, pseudo_v4(rst));
        put(w, l3, &ipv4_header(rst))?;
        put(w, l3 + IPV4_HLEN, &tcp)?;
        Some(l3 + IPV4_HLEN + TCP_HLEN)
    }
}

/// Copies `bytes` into the packet at `offset`, if they fit.
#[inline(always)]
fn put<const N: usize>(w: &Window, offset: usize, bytes: &[u8; N]) -> Option<()> {
    let p = w.ptr::<[u8; N]>(offset)?;
    // SAFETY: `ptr` checked that all N bytes lie inside the packet.
    unsafe { core::ptr::write_unaligned(p as *mut [u8; N], *bytes) };
    Some(())
}

#[inline(always)]
fn tcp_header(rst: &Segment) -> [u8; TCP_HLEN] {
    let mut h = [0u8; TCP_HLEN];
    h[0..2].copy_from_slice(&rst.sport.to_be_bytes());
    h[2..4].copy_from_slice(&rst.dport.to_be_bytes());
    h[4..8].copy_from_slice(&rst.seq.to_be_bytes());
    h[8..12].copy_from_slice(&rst.ack.to_be_bytes());
    h[12] = ((TCP_HLEN / 4) as u8) << 4;
    h[13] = rst.flags();
    h
}

#[inline(always)]
fn ipv4_header(rst: &Segment) -> [u8; IPV4_HLEN] {
    let mut h = [0u8; IPV4_HLEN];
    h[0] = 0x45;
    h[2..4].copy_from_slice(&((IPV4_HLEN + TCP_HLEN) as u16).to_be_bytes());
    h[6] = 0x40; // don't fragment
    h[8] = TTL;
    h[9] = IPPROTO_TCP;
    h[12..16].copy_from_slice(&rst.src[12..16]);
    h[16..20].copy_from_slice(&rst.dst[12..16]);
    let sum = fold(add_words(0, &h));
    h[10..12].copy_from_slice(&(!sum).to_be_bytes());
    h
}

#[inline(always)]
fn ipv6_header(rst: &Segment) -> [u8; IPV6_HLEN] {
    let mut h = [0u8; IPV6_HLEN];
    h[0] = 0x60;
    h[4..6].copy_from_slice(&(TCP_HLEN as u16).to_be_bytes());
    h[6] = IPPROTO_TCP;
    h[7] = TTL;
    h[8..24].copy_from_slice(&rst.src);
    h[24..40].copy_from_slice(&rst.dst);
    h
}

/// Sum of the pseudo-header words: addresses, protocol and TCP length.
#[inline(always)]
fn pseudo_v4(rst: &Segment) -> u64 {
    let sum = add_words(0, &[rst.src[12], rst.src[13], rst.src[14], rst.src[15]]);
    let sum = add_words(sum, &[rst.dst[12], rst.dst[13], rst.dst[14], rst.dst[15]]);
    sum + IPPROTO_TCP as u64 + TCP_HLEN as u64
}

#[inline(always)]
fn pseudo_v6(rst: &Segment) -> u64 {
    let sum = add_words(0, &rst.src);
    let sum = add_words(sum, &rst.dst);
    sum + IPPROTO_TCP as u64 + TCP_HLEN as u64
}

#[inline(always)]
fn with_checksum(mut tcp: [u8; TCP_HLEN], pseudo: u64) -> [u8; TCP_HLEN] {
    let sum = fold(add_words(pseudo, &tcp));
    tcp[16..18].copy_from_slice(&(!sum).to_be_bytes());
    tcp
}

/// Adds big-endian 16-bit words (an even number of bytes) to a one's-complement sum.
#[inline(always)]
fn add_words(mut sum: u64, bytes: &[u8]) -> u64 {
    let mut i = 0;
    while i + 1 < bytes.len() {
        sum += u16::from_be_bytes([bytes[i], bytes[i + 1]]) as u64;
        i += 2;
    }
    sum
}

#[inline(always)]
fn fold(mut sum: u64) -> u16 {
    for _ in 0..4 {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    sum as u16
}

//! Turns a refused SYN into the RST|ACK that answers it, in place, for `XDP_TX`.
//!
//! The reply keeps the Ethernet header and VLAN tags (MACs swapped) and writes fresh IP and TCP
//! headers after them: no IP options, no IPv6 extension headers, no TCP options. The headers
//! are built on the stack with full checksums (a local sender's checksum may be left partial
//! by offload, so nothing of the SYN's checksum is reused), then copied over the SYN, which is
//! at least as long, and the frame is trimmed to the reply's length.

use aya_ebpf::{helpers::bpf_xdp_adjust_tail, programs::XdpContext};

use crate::parsing::{
    IPPROTO_TCP, IPV4_HLEN, IPV6_HLEN, MAX_L3_OFFSET, Segment, TCP_ACK, TCP_HLEN, TCP_RST, Window,
};

const ETH_ALEN: usize = 6;
const TTL: u8 = 64;

/// Rewrites the frame into the RST|ACK answering `syn`; false if the frame could not be
/// rewritten (then the caller drops it instead).
#[inline(always)]
pub fn rst(ctx: &XdpContext, syn: &Segment) -> bool {
    let w = Window {
        start: ctx.data(),
        end: ctx.data_end(),
    };
    let l3 = syn.l3_offset;
    if l3 > MAX_L3_OFFSET {
        return false;
    }
    let Some(macs) = w.read::<[u8; 2 * ETH_ALEN]>(0) else {
        return false;
    };
    let mut swapped = [0u8; 2 * ETH_ALEN];
    swapped[..ETH_ALEN].copy_from_slice(&macs[ETH_ALEN..]);
    swapped[ETH_ALEN..].copy_from_slice(&macs[..ETH_ALEN]);
    let tcp = tcp_header(syn);
    let new_len = if syn.ipv6 {
        let ip = ipv6_header(syn);
        let tcp = with_checksum(tcp, pseudo_v6(syn));
        if !write(&w, 0, &swapped) || !write(&w, l3, &ip) || !write(&w, l3 + IPV6_HLEN, &tcp) {
            return false;
        }
        l3 + IPV6_HLEN + TCP_HLEN
    } else {
        let ip = ipv4_header(syn);
        let tcp = with_checksum(tcp, pseudo_v4(syn));
        if !write(&w, 0, &swapped) || !write(&w, l3, &ip) || !write(&w, l3 + IPV4_HLEN, &tcp) {
            return false;
        }
        l3 + IPV4_HLEN + TCP_HLEN
    };
    let delta = new_len as i32 - (w.end - w.start) as i32;
    // SAFETY: shrinking an XDP frame we own; `delta` is never positive here.
    delta == 0 || unsafe { bpf_xdp_adjust_tail(ctx.ctx, delta) } == 0
}

/// Copies `bytes` into the packet at `offset`, if they fit.
#[inline(always)]
fn write<const N: usize>(w: &Window, offset: usize, bytes: &[u8; N]) -> bool {
    match w.ptr::<[u8; N]>(offset) {
        Some(p) => {
            // SAFETY: `ptr` checked that all N bytes lie inside the packet.
            unsafe { core::ptr::write_unaligned(p as *mut [u8; N], *bytes) };
            true
        }
        None => false,
    }
}

/// RST|ACK from the SYN's destination: seq 0, ack = the SYN's seq + 1 (RFC 9293 3.10.7.1).
#[inline(always)]
fn tcp_header(syn: &Segment) -> [u8; TCP_HLEN] {
    let mut h = [0u8; TCP_HLEN];
    h[0..2].copy_from_slice(&syn.dport.to_be_bytes());
    h[2..4].copy_from_slice(&syn.sport.to_be_bytes());
    h[8..12].copy_from_slice(&syn.seq.wrapping_add(1).to_be_bytes());
    h[12] = ((TCP_HLEN / 4) as u8) << 4;
    h[13] = TCP_RST | TCP_ACK;
    h
}

#[inline(always)]
fn ipv4_header(syn: &Segment) -> [u8; IPV4_HLEN] {
    let mut h = [0u8; IPV4_HLEN];
    h[0] = 0x45;
    h[2..4].copy_from_slice(&((IPV4_HLEN + TCP_HLEN) as u16).to_be_bytes());
    h[6] = 0x40; // don't fragment
    h[8] = TTL;
    h[9] = IPPROTO_TCP;
    h[12..16].copy_from_slice(&syn.dst[12..16]);
    h[16..20].copy_from_slice(&syn.src[12..16]);
    let sum = fold(add_words(0, &h));
    h[10..12].copy_from_slice(&(!sum).to_be_bytes());
    h
}

#[inline(always)]
fn ipv6_header(syn: &Segment) -> [u8; IPV6_HLEN] {
    let mut h = [0u8; IPV6_HLEN];
    h[0] = 0x60;
    h[4..6].copy_from_slice(&(TCP_HLEN as u16).to_be_bytes());
    h[6] = IPPROTO_TCP;
    h[7] = TTL;
    h[8..24].copy_from_slice(&syn.dst);
    h[24..40].copy_from_slice(&syn.src);
    h
}

/// Sum of the pseudo-header words: addresses (reply direction), protocol and TCP length.
#[inline(always)]
fn pseudo_v4(syn: &Segment) -> u64 {
    let sum = add_words(0, &[syn.dst[12], syn.dst[13], syn.dst[14], syn.dst[15]]);
    let sum = add_words(sum, &[syn.src[12], syn.src[13], syn.src[14], syn.src[15]]);
    sum + IPPROTO_TCP as u64 + TCP_HLEN as u64
}

#[inline(always)]
fn pseudo_v6(syn: &Segment) -> u64 {
    let sum = add_words(0, &syn.dst);
    let sum = add_words(sum, &syn.src);
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

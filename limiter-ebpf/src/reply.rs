//! The segments limiter sends, built in place over the packet that prompted them:
//!
//! - the RST|ACK answering a refused SYN (or the RST answering a refused cookie's ACK), and
//!   the SYN-ACK carrying a SYN cookie, sent back out of the interface: by `XDP_TX`, or, on
//!   interfaces where that needs the peer's cooperation (a veth whose peer runs no XDP
//!   program drops `XDP_TX` frames), by `limiter_tc_ingress`, which finds the segment marked
//!   in its XDP metadata and redirects the answer out of the interface's egress;
//! - the RST that replaces a handshake-completing ACK refused over a cap, passed on to the
//!   host so it drops the embryonic connection.
//!
//! The reply keeps the Ethernet header and VLAN tags (MACs swapped for an answer) and writes
//! fresh IP and TCP headers after them: no IP options, no IPv6 extension headers, and TCP
//! options only on a SYN-ACK. The headers are built on the stack with full checksums (a local
//! sender's checksum may be left partial by offload, so nothing of the original's is reused).
//! A RST is copied over the original, which is at least as long, and the packet is trimmed to
//! its length; a SYN-ACK may be longer than its SYN, so the packet is first sized to it.

use aya_ebpf::{
    helpers::{bpf_skb_change_tail, bpf_xdp_adjust_tail},
    programs::{TcContext, XdpContext},
};
use limiter_common::{COOKIE_MARK, Config, RST_MARK};

use crate::{
    cookie::{Cookie, SYN_ACK_OPTIONS_LEN, SynAckOptions},
    headers::{
        Be16, Be32, ETH_ALEN, ETH_HLEN, ETH_P_8021AD, ETH_P_8021Q, ETH_P_IP, ETH_P_IPV6,
        IPV4_DONT_FRAGMENT, IPV4_HLEN, IPV6_HLEN, Ipv4Hdr, Ipv6Hdr, TCP_HLEN, TcpHdr, VLAN_HLEN,
        Window, add_words, as_bytes, fold,
    },
    parsing::{
        Endpoints, IPPROTO_TCP, MAX_L3_OFFSET, Segment, SegmentMeta, TCP_ACK, TCP_RST, TCP_SYN,
    },
};

const TTL: u8 = 64;

/// The Ethernet type field's length: it ends where the IP header (or a VLAN tag) begins.
const ETH_TYPE_LEN: usize = 2;

/// One RST: its headers (a [`Segment`], laid out as the verifier needs) and where it goes.
struct Rst {
    headers: Segment,
    /// Back to the sender (MACs swapped), or on towards the host.
    answer: bool,
}

/// The reset answering a refused segment (RFC 9293 3.10.7.1): to a SYN, RST|ACK with seq 0
/// and ack = the SYN's seq + 1; to an ACK (of a cookie refused over a cap), a RST at the
/// sequence number it acknowledged.
#[inline(always)]
fn answering(seg: &Segment) -> Rst {
    let (seq, ack, flags) = if seg.is_syn() {
        (0, seg.seq.wrapping_add(1), TCP_RST | TCP_ACK)
    } else {
        (seg.ack, 0, TCP_RST)
    };
    Rst {
        headers: Segment::new(
            Endpoints {
                src: seg.dst,
                dst: seg.src,
                sport: seg.dport,
                dport: seg.sport,
                seq,
                ack,
            },
            SegmentMeta {
                flags,
                ipv6: seg.ipv6(),
                fragment: false,
                l3_offset: seg.l3_offset(),
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

/// Rewrites the XDP frame into the reset answering `seg`, for `XDP_TX`.
#[inline(always)]
pub fn xdp_answer(ctx: &XdpContext, seg: &Segment) -> bool {
    xdp_rewrite(ctx, &answering(seg))
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

/// Marks a refused SYN for `limiter_tc_ingress` to answer: its Ethernet type (the innermost,
/// after any VLAN tags) becomes `mark` ([`limiter_common::RST_MARK`] or
/// [`limiter_common::COOKIE_MARK`]). A frame marked so never reaches the host's IP stack,
/// answered or not.
#[inline(always)]
pub fn xdp_mark(ctx: &XdpContext, seg: &Segment, mark: u16) -> bool {
    // Subtracted as a byte, which the verifier knows to be no less than zero.
    let at = usize::from(seg.l3_offset().wrapping_sub(ETH_TYPE_LEN as u8));
    (ETH_HLEN - ETH_TYPE_LEN..=MAX_L3_OFFSET).contains(&at)
        && Window::of_xdp(ctx).write(at, &Be16::new(mark)).is_some()
}

/// The mark XDP left on this packet for an answer, if any, with the frame's own Ethernet type
/// put back, since the answer is built over the frame and keeps its Ethernet header. Most
/// packets are told apart by the skb's protocol alone, which the host took from the frame's
/// type (a VLAN tag it moved out of the frame included); only a frame still tagged is read.
#[inline(always)]
pub fn tc_take_mark(ctx: &TcContext) -> Option<u16> {
    // SAFETY: reading a field of the context the program was given.
    let protocol = u16::from_be(unsafe { (*ctx.skb.skb).protocol } as u16);
    if !matches!(
        protocol,
        RST_MARK | COOKIE_MARK | ETH_P_8021Q | ETH_P_8021AD
    ) {
        return None;
    }
    take_mark(&Window::of_tc(ctx))
}

#[inline(never)]
fn take_mark(w: &Window) -> Option<u16> {
    let mut at = ETH_HLEN - ETH_TYPE_LEN;
    // Two tags at most, then the type, unrolled for the verifier.
    for _ in 0..3 {
        let proto = w.read::<Be16>(at)?.get();
        if proto == ETH_P_8021Q || proto == ETH_P_8021AD {
            at += VLAN_HLEN;
            continue;
        }
        if proto != RST_MARK && proto != COOKIE_MARK {
            return None;
        }
        let own = match w.read::<u8>(at + ETH_TYPE_LEN)? >> 4 {
            4 => ETH_P_IP,
            6 => ETH_P_IPV6,
            _ => return None,
        };
        w.write(at, &Be16::new(own))?;
        return Some(proto);
    }
    None
}

/// Rewrites the skb (a marked segment) into the reset answering it, ready to redirect.
#[inline(never)]
pub fn tc_answer(ctx: &TcContext, seg: &Segment) -> bool {
    let w = Window::of_tc(ctx);
    let Some(new_len) = write(&w, &answering(seg)) else {
        return false;
    };
    // SAFETY: trimming the skb we were given to the reply's length (at most its own).
    unsafe { bpf_skb_change_tail(ctx.skb.skb, new_len as u32, 0) == 0 }
}

/// The headers of the SYN-ACK answering `syn` with `cookie`: from the SYN's destination,
/// seq = the cookie, ack = the SYN's seq + 1.
#[inline(always)]
fn syn_ack_headers(syn: &Segment, cookie: &Cookie) -> Segment {
    Segment::new(
        Endpoints {
            src: syn.dst,
            dst: syn.src,
            sport: syn.dport,
            dport: syn.sport,
            seq: cookie.isn,
            ack: syn.seq.wrapping_add(1),
        },
        SegmentMeta {
            flags: TCP_SYN | TCP_ACK,
            ipv6: syn.ipv6(),
            fragment: false,
            l3_offset: syn.l3_offset(),
        },
    )
}

/// The frame's length with the SYN-ACK answering `syn` in it.
#[inline(always)]
fn syn_ack_len(syn: &Segment) -> usize {
    let ip = if syn.ipv6() { IPV6_HLEN } else { IPV4_HLEN };
    usize::from(syn.l3_offset()) + ip + SYN_ACK_TCP_LEN
}

const SYN_ACK_TCP_LEN: usize = TCP_HLEN + SYN_ACK_OPTIONS_LEN;

/// The SYN-ACK's TCP header and options, one block for the checksum.
#[derive(Clone, Copy)]
#[repr(C, packed)]
struct SynAckTcp {
    tcp: TcpHdr,
    options: SynAckOptions,
}

/// Resizes the XDP frame (a SYN) to the SYN-ACK answering it with `cookie` and writes it, for
/// `XDP_TX`.
#[inline(never)]
pub fn xdp_syn_ack(ctx: &XdpContext, syn: &Segment, cookie: &Cookie) -> bool {
    let delta = syn_ack_len(syn) as i32 - Window::of_xdp(ctx).len() as i32;
    // SAFETY: resizing an XDP frame we own; the kernel refuses a size it cannot give.
    if delta != 0 && unsafe { bpf_xdp_adjust_tail(ctx.ctx, delta) } != 0 {
        return false;
    }
    write_syn_ack(
        &Window::of_xdp(ctx),
        syn,
        cookie,
        crate::map_access::config(),
    )
    .is_some()
}

/// Resizes the skb (a marked SYN) to the SYN-ACK answering it with `cookie` and writes it,
/// ready to redirect.
#[inline(never)]
pub fn tc_syn_ack(ctx: &TcContext, syn: &Segment, cookie: &Cookie) -> bool {
    // SAFETY: resizing the skb we were given.
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, syn_ack_len(syn) as u32, 0) } != 0 {
        return false;
    }
    write_syn_ack(
        &Window::of_tc(ctx),
        syn,
        cookie,
        crate::map_access::config(),
    )
    .is_some()
}

/// Writes the SYN-ACK into a packet already sized for it, one header at a time, each by a
/// function of its own: the cookie's path runs under the XDP program's own frame, and BPF
/// allows 512 bytes of stack down a call chain (Debian's 6.1 rounds each frame up to 32).
/// Inlined into its two callers, so that its frame and the TCP writer's do not add up.
#[inline(always)]
fn write_syn_ack(w: &Window, syn: &Segment, cookie: &Cookie, config: &Config) -> Option<()> {
    let h = syn_ack_headers(syn, cookie);
    let l3 = usize::from(h.l3_offset());
    if l3 > MAX_L3_OFFSET {
        return None;
    }
    swap_macs(w)?;
    let tcp_at = write_ip(w, &h, l3)?;
    write_tcp(w, &h, tcp_at, cookie, config)
}

/// Writes the SYN-ACK's IP header at `l3`; returns where its TCP header starts.
#[inline(never)]
fn write_ip(w: &Window, h: &Segment, l3: usize) -> Option<usize> {
    if h.ipv6() {
        w.write(l3, &ipv6_header(h, SYN_ACK_TCP_LEN))?;
        Some(l3 + IPV6_HLEN)
    } else {
        w.write(l3, &ipv4_header(h, SYN_ACK_TCP_LEN))?;
        Some(l3 + IPV4_HLEN)
    }
}

/// Writes the SYN-ACK's TCP header and options at `tcp_at`, with the checksum summed over the
/// packet itself.
#[inline(never)]
fn write_tcp(
    w: &Window,
    h: &Segment,
    tcp_at: usize,
    cookie: &Cookie,
    config: &Config,
) -> Option<()> {
    let options = SynAckOptions::answering(cookie, h.ipv6(), config);
    let tcp = tcp_header(h, SYN_ACK_TCP_LEN, syn_ack_window(&options));
    let pseudo = if h.ipv6() {
        pseudo_v6(h, SYN_ACK_TCP_LEN)
    } else {
        pseudo_v4(h, SYN_ACK_TCP_LEN)
    };
    // One bounds check for the whole block, and every access through its pointer: a write
    // through a pointer derived apart would have its check folded into this one by the
    // compiler, and the verifier tracks bounds per pointer.
    let block = w.ptr::<SynAckTcp>(tcp_at & 0x7F)? as *mut SynAckTcp;
    // SAFETY: the block lies inside the packet (checked above), which the program may write;
    // the header is packed, so unaligned accesses through raw field pointers.
    unsafe {
        (&raw mut (*block).options).write_unaligned(options);
        (&raw mut (*block).tcp).write_unaligned(tcp);
        let sum = add_words(pseudo, as_bytes::<SynAckTcp, SYN_ACK_TCP_LEN>(&*block));
        (&raw mut (*block).tcp.check).write_unaligned(Be16::new(!fold(sum)));
    }
    Some(())
}

/// The SYN-ACK's window (never scaled, RFC 7323 2.2): ten segments of the MSS it offers, the
/// client's initial flight, until the host's first segment gives its own.
#[inline(always)]
fn syn_ack_window(options: &SynAckOptions) -> u16 {
    (u32::from(options.mss()) * 10).min(u32::from(u16::MAX)) as u16
}

#[inline(always)]
fn swap_macs(w: &Window) -> Option<()> {
    let macs = w.read::<[u8; 2 * ETH_ALEN]>(0)?;
    let mut swapped = [0u8; 2 * ETH_ALEN];
    swapped[..ETH_ALEN].copy_from_slice(&macs[ETH_ALEN..]);
    swapped[ETH_ALEN..].copy_from_slice(&macs[..ETH_ALEN]);
    w.write(0, &swapped)
}

/// Writes `rst` over the packet in `w`; returns the reply's length, or `None` if the packet
/// could not hold it (then the caller drops it instead). Not inlined: its headers get a stack
/// frame of their own, the same for XDP and TC.
#[inline(never)]
fn write(w: &Window, rst: &Rst) -> Option<usize> {
    let answer = rst.answer;
    let rst = &rst.headers;
    let l3 = usize::from(rst.l3_offset());
    if l3 > MAX_L3_OFFSET {
        return None;
    }
    if answer {
        swap_macs(w)?;
    }
    let tcp = tcp_header(rst, TCP_HLEN, 0);
    if rst.ipv6() {
        let tcp = with_checksum(tcp, pseudo_v6(rst, TCP_HLEN));
        w.write(l3, &ipv6_header(rst, TCP_HLEN))?;
        w.write(l3 + IPV6_HLEN, &tcp)?;
        Some(l3 + IPV6_HLEN + TCP_HLEN)
    } else {
        let tcp = with_checksum(tcp, pseudo_v4(rst, TCP_HLEN));
        w.write(l3, &ipv4_header(rst, TCP_HLEN))?;
        w.write(l3 + IPV4_HLEN, &tcp)?;
        Some(l3 + IPV4_HLEN + TCP_HLEN)
    }
}

/// A TCP header of `len` bytes (options included) for `seg`, its checksum left to fill.
#[inline(always)]
fn tcp_header(seg: &Segment, len: usize, window: u16) -> TcpHdr {
    TcpHdr {
        sport: Be16::new(seg.sport),
        dport: Be16::new(seg.dport),
        seq: Be32::new(seg.seq),
        ack: Be32::new(seg.ack),
        data_offset: ((len / 4) as u8) << 4,
        flags: seg.flags(),
        window: Be16::new(window),
        check: Be16::new(0),
        urgent: Be16::new(0),
    }
}

/// An IPv4 header carrying `tcp_len` bytes of TCP.
#[inline(always)]
fn ipv4_header(rst: &Segment, tcp_len: usize) -> Ipv4Hdr {
    let mut h = Ipv4Hdr {
        version_ihl: 0x45,
        tos: 0,
        total_len: Be16::new((IPV4_HLEN + tcp_len) as u16),
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
fn ipv6_header(rst: &Segment, tcp_len: usize) -> Ipv6Hdr {
    Ipv6Hdr {
        version_class_flow: Be32::new(6 << 28),
        payload_len: Be16::new(tcp_len as u16),
        next_header: IPPROTO_TCP,
        hop_limit: TTL,
        src: rst.src,
        dst: rst.dst,
    }
}

/// Sum of the pseudo-header words: addresses, protocol and TCP length.
#[inline(always)]
fn pseudo_v4(rst: &Segment, tcp_len: usize) -> u64 {
    let sum = add_words(0, &[rst.src[12], rst.src[13], rst.src[14], rst.src[15]]);
    let sum = add_words(sum, &[rst.dst[12], rst.dst[13], rst.dst[14], rst.dst[15]]);
    sum + u64::from(IPPROTO_TCP) + tcp_len as u64
}

#[inline(always)]
fn pseudo_v6(rst: &Segment, tcp_len: usize) -> u64 {
    let sum = add_words(0, &rst.src);
    let sum = add_words(sum, &rst.dst);
    sum + u64::from(IPPROTO_TCP) + tcp_len as u64
}

#[inline(always)]
fn with_checksum(mut tcp: TcpHdr, pseudo: u64) -> TcpHdr {
    tcp.check = Be16::new(!fold(add_words(pseudo, as_bytes::<TcpHdr, TCP_HLEN>(&tcp))));
    tcp
}

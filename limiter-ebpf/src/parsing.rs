//! Parses Ethernet (up to two VLAN tags), IPv4 (with options), IPv6 (with a bounded number
//! of extension headers) and TCP, checking every read against the end of the packet and every
//! header against the IP length. The headers themselves are [`crate::headers`].
//!
//! What it cannot read comes back as the [`Reason`] why, and the caller decides: on ingress a
//! packet that could be TCP but whose ports and flags cannot be read (a fragment, a cut-short
//! header, a header chain longer than we follow) is refused, because the host could still
//! reassemble or walk it to a protected port out of our sight. So is one the host would
//! discard (a wrong IPv4 header checksum, a martian IPv6 source): what it says must change no
//! state, since the host never hears it.

use limiter_common::{COOKIE_MARK, Direction, RST_MARK, Reason, source::V4_MAPPED};

use crate::headers::{
    ETH_HLEN, ETH_P_8021AD, ETH_P_8021Q, ETH_P_IP, ETH_P_IPV6, EthHdr, IPV4_FRAGMENTED, IPV4_HLEN,
    IPV4_OFFSET, IPV6_HLEN, Ipv4Hdr, Ipv6ExtHdr, Ipv6FragHdr, Ipv6Hdr, TCP_HLEN, TcpHdr, V4Frame,
    V6Frame, VLAN_HLEN, VlanHdr, Window, add_words, fold,
};

/// Two VLAN tags at most: the IP header starts no later than this.
pub const MAX_L3_OFFSET: usize = ETH_HLEN + 2 * VLAN_HLEN;
pub const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
const IPPROTO_IPIP: u8 = 4;
const IPPROTO_IPV6: u8 = 41;
const IPPROTO_GRE: u8 = 47;
const IPPROTO_ICMPV6: u8 = 58;
const IPV6_NO_NEXT: u8 = 59;
const IPPROTO_SCTP: u8 = 132;
const IPPROTO_UDPLITE: u8 = 136;
/// IPv6 extension headers followed; a longer chain is refused (`header_chain`). Real traffic
/// to a broker carries at most one or two.
const MAX_EXT_HEADERS: usize = 6;
const IPV6_HOP_BY_HOP: u8 = 0;
const IPV6_ROUTING: u8 = 43;
const IPV6_FRAGMENT: u8 = 44;
const IPV6_AUTH: u8 = 51;
const IPV6_DEST_OPTS: u8 = 60;
/// IPv4 options words past the fixed header: at most 40 bytes.
const MAX_IPV4_OPTION_WORDS: usize = 10;

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

/// A TCP segment's headers, as far as limiter needs them.
///
/// Laid out so that no store LLVM joins is misaligned: the object is built with misaligned
/// access allowed, so LLVM joins neighbouring stores into words, and the verifier refuses
/// every misaligned stack access (a segment at a 4-byte boundary made the TC program
/// unloadable, and two byte fields at an odd offset joined into one `u16` store made the XDP
/// program so). Eight-byte aligned, fields in order of size, and the four one-byte fields in
/// one word ([`SegmentMeta`]).
#[derive(Clone, Copy)]
#[repr(C, align(8))]
pub struct Segment {
    /// Source and destination as IPv6 addresses (IPv4 mapped to `::ffff:a.b.c.d`).
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub seq: u32,
    /// The acknowledgment number (meaningful with `TCP_ACK`).
    pub ack: u32,
    pub sport: u16,
    pub dport: u16,
    meta: u32,
}

/// A segment's one-byte fields, packed into [`Segment`]'s last word by [`Segment::new`].
#[derive(Clone, Copy)]
pub struct SegmentMeta {
    pub flags: u8,
    pub ipv6: bool,
    /// The first fragment of a fragmented datagram: ports readable, the rest arrives later.
    pub fragment: bool,
    /// Where the IP header starts, after Ethernet and VLAN tags (at most [`MAX_L3_OFFSET`]).
    /// A byte, not a `usize`: a value cut to a byte is bounded by its width wherever the
    /// compiler keeps it, while a bound learned by comparison is lost by older verifiers
    /// (Debian's 6.1; 6.12 keeps it) if the compiler spilled the value to the stack before
    /// comparing: 6.1 refused the reply's packet pointer arithmetic as unbounded.
    pub l3_offset: u8,
}

/// The addresses, ports and sequence numbers of a [`Segment`], by name.
#[derive(Clone, Copy)]
pub struct Endpoints {
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub sport: u16,
    pub dport: u16,
    pub seq: u32,
    pub ack: u32,
}

impl Segment {
    #[inline(always)]
    pub fn new(ends: Endpoints, meta: SegmentMeta) -> Segment {
        Segment {
            src: ends.src,
            dst: ends.dst,
            seq: ends.seq,
            ack: ends.ack,
            sport: ends.sport,
            dport: ends.dport,
            meta: u32::from_le_bytes([
                meta.flags,
                u8::from(meta.ipv6),
                u8::from(meta.fragment),
                meta.l3_offset,
            ]),
        }
    }

    #[inline(always)]
    pub fn flags(&self) -> u8 {
        self.meta as u8
    }

    #[inline(always)]
    pub fn ipv6(&self) -> bool {
        (self.meta >> 8) as u8 != 0
    }

    /// See [`SegmentMeta::fragment`].
    #[inline(always)]
    pub fn fragment(&self) -> bool {
        (self.meta >> 16) as u8 != 0
    }

    /// See [`SegmentMeta::l3_offset`].
    #[inline(always)]
    pub fn l3_offset(&self) -> u8 {
        (self.meta >> 24) as u8
    }

    /// A connection request: SYN without ACK (a SYN-ACK is the server's answer).
    #[inline(always)]
    pub fn is_syn(&self) -> bool {
        self.flags() & (TCP_SYN | TCP_ACK | TCP_RST) == TCP_SYN
    }

    #[inline(always)]
    pub fn has(&self, flag: u8) -> bool {
        self.flags() & flag != 0
    }
}

/// The common frame read with one bounds check: untagged Ethernet, then IPv4 without options
/// and not fragmented, or IPv6 with TCP as its next header, then TCP, every length consistent.
/// Anything else (VLAN tags, IP options, extension headers, fragments, a short or inconsistent
/// length) is `None`, and [`parse`] reads it. What this accepts, `parse` reads into the same
/// segment: this only spares the common case the general parser's branches and copies.
///
/// For ingress only: the window must hold the whole packet.
#[inline(always)]
pub fn parse_common(w: &Window) -> Option<Common<'_>> {
    let len = w.len();
    let v4 = w.header::<V4Frame>(0)?;
    let proto = v4.eth.proto.get();
    if proto == ETH_P_IP {
        let end = ETH_HLEN + usize::from(v4.ip.total_len.get());
        if v4.ip.version_ihl != 0x45
            || v4.ip.frag_off.get() & IPV4_FRAGMENTED != 0
            || v4.ip.protocol != IPPROTO_TCP
            || v4.tcp.header_len() < TCP_HLEN
            || end > len
            || ETH_HLEN + IPV4_HLEN + v4.tcp.header_len() > end
        {
            return None;
        }
        return Some(Common::V4(v4));
    }
    if proto != ETH_P_IPV6 {
        return None;
    }
    let v6 = w.header::<V6Frame>(0)?;
    let end = ETH_HLEN + IPV6_HLEN + usize::from(v6.ip.payload_len.get());
    if v6.ip.version() != 6
        || v6.ip.next_header != IPPROTO_TCP
        || v6.tcp.header_len() < TCP_HLEN
        || end > len
        || ETH_HLEN + IPV6_HLEN + v6.tcp.header_len() > end
    {
        return None;
    }
    Some(Common::V6(v6))
}

/// A common frame, checked by [`parse_common`]: the few fields the established fast path
/// judges by are read in place, and the whole [`Segment`] is built only when the packet
/// needs more than that.
#[derive(Clone, Copy)]
pub enum Common<'a> {
    V4(&'a V4Frame),
    V6(&'a V6Frame),
}

impl<'a> Common<'a> {
    #[inline(always)]
    fn tcp(self) -> &'a TcpHdr {
        match self {
            Common::V4(frame) => &frame.tcp,
            Common::V6(frame) => &frame.tcp,
        }
    }

    #[inline(always)]
    pub fn dport(self) -> u16 {
        self.tcp().dport.get()
    }

    #[inline(always)]
    pub fn ack(self) -> u32 {
        self.tcp().ack.get()
    }

    #[inline(always)]
    pub fn flags(self) -> u8 {
        self.tcp().flags
    }

    /// Why the host would discard the frame, if it would: checked off the fast path, since
    /// a frame the fast path passes changes no state.
    #[inline(always)]
    pub fn discarded(self) -> Option<Reason> {
        match self {
            Common::V4(frame) if fold(frame.ip.word_sum()) != 0xFFFF => Some(Reason::Checksum),
            Common::V6(frame) if martian_v6(&frame.ip.src) => Some(Reason::Martian),
            _ => None,
        }
    }

    /// The whole segment, its TCP fields read in place.
    #[inline(always)]
    pub fn segment(self) -> Segment {
        let (src, dst, ipv6) = match self {
            Common::V4(frame) => (mapped(frame.ip.src), mapped(frame.ip.dst), false),
            Common::V6(frame) => (frame.ip.src, frame.ip.dst, true),
        };
        tcp_segment(
            self.tcp(),
            src,
            dst,
            SegmentMeta {
                flags: 0,
                ipv6,
                fragment: false,
                l3_offset: ETH_HLEN as u8,
            },
        )
    }
}

/// The segment of a TCP header and its addresses; `meta.flags` is taken from the header.
#[inline(always)]
fn tcp_segment(tcp: &TcpHdr, src: [u8; 16], dst: [u8; 16], meta: SegmentMeta) -> Segment {
    Segment::new(
        Endpoints {
            src,
            dst,
            sport: tcp.sport.get(),
            dport: tcp.dport.get(),
            seq: tcp.seq.get(),
            ack: tcp.ack.get(),
        },
        SegmentMeta {
            flags: tcp.flags,
            ..meta
        },
    )
}

/// An IPv6 source the host drops on arrival (`ip6_rcv_core`): multicast, or IPv4-mapped.
#[inline(always)]
fn martian_v6(src: &[u8; 16]) -> bool {
    src[0] == 0xFF || src[..12] == V4_MAPPED
}

/// On [`Direction::Ingress`] the window holds the whole packet, as in XDP, so a datagram
/// longer than the window was cut short, and the host's own checks (IPv4 header checksum,
/// martian sources) are made. On egress the window is only the linear part of the skb (a GSO
/// packet carries most of its payload elsewhere), and the host's own packets are trusted, so
/// there only the headers are checked.
///
/// Not inlined: its header copies get a stack frame of their own, beside the policy's rather
/// than under it (BPF allows 512 bytes of stack down any call chain).
#[inline(never)]
pub fn parse(w: &Window, direction: Direction) -> Result<Segment, Reason> {
    let ingress = direction == Direction::Ingress;
    let mut proto = w.header::<EthHdr>(0).ok_or(Reason::Truncated)?.proto.get();
    let mut l3 = ETH_HLEN;
    // Two tags at most (802.1ad outer, 802.1Q inner), unrolled for the verifier.
    for _ in 0..2 {
        if proto != ETH_P_8021Q && proto != ETH_P_8021AD {
            break;
        }
        proto = w
            .header::<VlanHdr>(l3)
            .ok_or(Reason::Truncated)?
            .proto
            .get();
        l3 += VLAN_HLEN;
    }
    match proto {
        ETH_P_IP => parse_ipv4(w, l3, ingress),
        ETH_P_IPV6 => parse_ipv6(w, l3, ingress),
        // A third tag, or a frame from outside carrying the type the programs mark a frame
        // with for `limiter_tc_ingress` to answer (a forged mark would make it answer).
        ETH_P_8021Q | ETH_P_8021AD | RST_MARK | COOKIE_MARK => Err(Reason::Malformed),
        _ => Err(Reason::NonIp),
    }
}

#[inline(always)]
fn parse_ipv4(w: &Window, l3: usize, ingress: bool) -> Result<Segment, Reason> {
    // Read in place, never copied: a packed header copied to the stack is stored in joined
    // words at odd offsets, which every verifier refuses.
    let ip = w.header::<Ipv4Hdr>(l3).ok_or(Reason::Truncated)?;
    if ip.version() != 4 {
        return Err(Reason::Malformed);
    }
    let ihl = ip.header_len();
    let total = usize::from(ip.total_len.get());
    if ihl < IPV4_HLEN || total < ihl {
        return Err(Reason::Malformed);
    }
    if ingress && !ipv4_checksum_ok(w, l3, ip) {
        return Err(Reason::Checksum);
    }
    let frag = ip.frag_off.get();
    // More-fragments flag or an offset: part of a fragmented datagram.
    let fragment = frag & IPV4_FRAGMENTED != 0;
    if ip.protocol != IPPROTO_TCP {
        return Err(not_tcp(ip.protocol));
    }
    if frag & IPV4_OFFSET != 0 {
        // Not the first fragment: no TCP header at all.
        return Err(Reason::Fragment);
    }
    let at = Ip {
        l3,
        l4: l3 + ihl,
        end: l3 + total,
        fragment,
        whole: ingress,
    };
    parse_tcp(w, &at, mapped(ip.src), mapped(ip.dst), false)
}

/// Whether the IPv4 header's checksum, options included, is right, as the host requires.
#[inline(always)]
fn ipv4_checksum_ok(w: &Window, l3: usize, ip: &Ipv4Hdr) -> bool {
    let mut sum = ip.word_sum();
    let options = (ip.header_len() - IPV4_HLEN) / 4;
    for i in 0..MAX_IPV4_OPTION_WORDS {
        if i >= options {
            break;
        }
        match w.read::<[u8; 4]>(l3 + IPV4_HLEN + i * 4) {
            Some(word) => sum = add_words(sum, &word),
            // Cut short: the length checks refuse it as truncated.
            None => return true,
        }
    }
    fold(sum) == 0xFFFF
}

#[inline(always)]
fn parse_ipv6(w: &Window, l3: usize, ingress: bool) -> Result<Segment, Reason> {
    let ip = w.header::<Ipv6Hdr>(l3).ok_or(Reason::Truncated)?;
    if ip.version() != 6 {
        return Err(Reason::Malformed);
    }
    if ingress && martian_v6(&ip.src) {
        return Err(Reason::Martian);
    }
    let end = l3 + IPV6_HLEN + usize::from(ip.payload_len.get());
    let mut next = ip.next_header;
    let mut l4 = l3 + IPV6_HLEN;
    let mut fragment = false;
    for _ in 0..MAX_EXT_HEADERS {
        match next {
            IPPROTO_TCP => {
                let at = Ip {
                    l3,
                    l4,
                    end,
                    fragment,
                    whole: ingress,
                };
                return parse_tcp(w, &at, ip.src, ip.dst, true);
            }
            // Hop-by-hop, routing, destination options: length in 8-byte units past the first 8.
            IPV6_HOP_BY_HOP | IPV6_ROUTING | IPV6_DEST_OPTS => {
                let ext = w.header::<Ipv6ExtHdr>(l4).ok_or(Reason::Truncated)?;
                next = ext.next_header;
                l4 += (usize::from(ext.len) + 1) * 8;
            }
            IPV6_FRAGMENT => {
                let ext = w.header::<Ipv6FragHdr>(l4).ok_or(Reason::Truncated)?;
                let frag = ext.offset_flags.get();
                next = ext.next_header;
                if frag & 0xFFF8 != 0 {
                    // Not the first fragment. Its next header names what the datagram carries
                    // (or the first header after this one): only a known non-TCP payload passes.
                    return Err(if may_lead_to_tcp(next) {
                        Reason::Fragment
                    } else {
                        Reason::NonTcp
                    });
                }
                // An atomic fragment (offset 0, no more fragments) is a whole datagram.
                fragment |= frag & 1 != 0;
                l4 += 8;
            }
            // Authentication header: length in 4-byte units, minus 2.
            IPV6_AUTH => {
                let ext = w.header::<Ipv6ExtHdr>(l4).ok_or(Reason::Truncated)?;
                next = ext.next_header;
                l4 += (usize::from(ext.len) + 2) * 4;
            }
            _ => {
                // A tunnel, fragment or not, is judged as one. A first fragment whose chain
                // goes on in a later fragment, or whose upper layer is one the parser does
                // not know, could still be TCP; a first fragment of UDP or ICMPv6 passes like
                // the rest of its datagram.
                return Err(if is_tunnel(next) {
                    Reason::Tunnel
                } else if fragment && !known_not_tcp(next) {
                    Reason::Fragment
                } else {
                    Reason::NonTcp
                });
            }
        }
    }
    Err(Reason::HeaderChain)
}

/// `::ffff:a.b.c.d`, built as two words: byte-wise zeroing would compile to a `memset` loop.
#[inline(always)]
fn mapped(v4: [u8; 4]) -> [u8; 16] {
    let lo = (0xFFFF_u64 << 32) | u64::from(u32::from_be_bytes(v4));
    let mut out = [0u8; 16];
    out[8..].copy_from_slice(&lo.to_be_bytes());
    out
}

/// Whether a header of this type is TCP or may be followed by TCP.
#[inline(always)]
fn may_lead_to_tcp(next: u8) -> bool {
    matches!(
        next,
        IPPROTO_TCP | IPV6_HOP_BY_HOP | IPV6_ROUTING | IPV6_FRAGMENT | IPV6_AUTH | IPV6_DEST_OPTS
    )
}

/// IP in IP, IPv6 in IP (SIT/6in4) and GRE: the protocols that carry an IP packet the host
/// takes off a tunnel device, out of the programs' sight. (VXLAN, FOU and GUE ride on UDP,
/// ESP is encrypted: neither can be told from other traffic without configuration.)
#[inline(always)]
fn is_tunnel(protocol: u8) -> bool {
    matches!(protocol, IPPROTO_IPIP | IPPROTO_IPV6 | IPPROTO_GRE)
}

/// The reason for an IPv4 protocol other than TCP.
#[inline(always)]
fn not_tcp(protocol: u8) -> Reason {
    if is_tunnel(protocol) {
        Reason::Tunnel
    } else {
        Reason::NonTcp
    }
}

/// An upper layer that is not TCP and carries none.
#[inline(always)]
fn known_not_tcp(next: u8) -> bool {
    matches!(
        next,
        IPPROTO_UDP | IPPROTO_ICMPV6 | IPV6_NO_NEXT | IPPROTO_SCTP | IPPROTO_UDPLITE
    )
}

/// Where the IP datagram lies in the window.
struct Ip {
    l3: usize,
    /// Where the TCP header starts.
    l4: usize,
    /// Where the datagram ends by its own length (the frame may carry padding past it).
    end: usize,
    fragment: bool,
    /// The window holds the whole packet (ingress; see [`parse`]).
    whole: bool,
}

#[inline(always)]
fn parse_tcp(
    w: &Window,
    ip: &Ip,
    src: [u8; 16],
    dst: [u8; 16],
    ipv6: bool,
) -> Result<Segment, Reason> {
    // A fragment's header cut short is the tiny-fragment attack: its own reason.
    let short = if ip.fragment {
        Reason::Fragment
    } else {
        Reason::Truncated
    };
    // The packet read comes first, so its bounds check stays a check the verifier sees.
    let tcp = w.header::<TcpHdr>(ip.l4).ok_or(short)?;
    let doff = tcp.header_len();
    // On ingress, the header must lie within the datagram's own length too (padding past it
    // is not TCP header), and the datagram within the frame. The host's own packets on egress
    // are trusted: a GSO packet's IP length may even be zero.
    if ip.whole && (ip.end > w.len() || ip.l4 + doff.max(TCP_HLEN) > ip.end) {
        return Err(short);
    }
    if doff < TCP_HLEN {
        return Err(Reason::Malformed);
    }
    Ok(tcp_segment(
        tcp,
        src,
        dst,
        SegmentMeta {
            flags: 0,
            ipv6,
            fragment: ip.fragment,
            // At most MAX_L3_OFFSET (two VLAN tags), which fits a byte.
            l3_offset: ip.l3 as u8,
        },
    ))
}

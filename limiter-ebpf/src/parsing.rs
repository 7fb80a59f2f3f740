//! Parses Ethernet (up to two VLAN tags), IPv4 (with options), IPv6 (with a bounded number
//! of extension headers) and TCP, checking every read against the end of the packet and every
//! header against the IP length.
//!
//! What it cannot read comes back as the [`Reason`] why, and the caller decides: on ingress a
//! packet that could be TCP but whose ports and flags cannot be read (a fragment, a cut-short
//! header, a header chain longer than we follow) is refused, because the host could still
//! reassemble or walk it to a protected port out of our sight.

use core::mem::size_of;

use limiter_common::Reason;

pub const ETH_HLEN: usize = 14;
pub const VLAN_HLEN: usize = 4;
/// Two VLAN tags at most: the IP header starts no later than this.
pub const MAX_L3_OFFSET: usize = ETH_HLEN + 2 * VLAN_HLEN;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88A8;
pub const IPPROTO_TCP: u8 = 6;
pub const IPV4_HLEN: usize = 20;
pub const IPV6_HLEN: usize = 40;
pub const TCP_HLEN: usize = 20;
/// IPv6 extension headers followed; a longer chain is refused (`header_chain`). Real traffic
/// to a broker carries at most one or two.
const MAX_EXT_HEADERS: usize = 6;
const IPV6_HOP_BY_HOP: u8 = 0;
const IPV6_ROUTING: u8 = 43;
const IPV6_FRAGMENT: u8 = 44;
const IPV6_AUTH: u8 = 51;
const IPV6_DEST_OPTS: u8 = 60;

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

/// The bytes a program may read: `[start, end)` of a linear packet buffer.
#[derive(Clone, Copy)]
pub struct Window {
    pub start: usize,
    pub end: usize,
}

impl Window {
    /// A pointer to a `T` at `offset`, if the whole `T` lies inside the packet.
    #[inline(always)]
    pub fn ptr<T>(&self, offset: usize) -> Option<*const T> {
        let at = self.start + offset;
        if at + size_of::<T>() > self.end {
            return None;
        }
        Some(at as *const T)
    }

    #[inline(always)]
    pub fn read<T: Copy>(&self, offset: usize) -> Option<T> {
        // SAFETY: `ptr` checked the bounds; packets carry no alignment promise.
        self.ptr::<T>(offset)
            .map(|p| unsafe { core::ptr::read_unaligned(p) })
    }

    #[inline(always)]
    fn u16_be(&self, offset: usize) -> Option<u16> {
        self.read::<[u8; 2]>(offset).map(u16::from_be_bytes)
    }
}

/// A TCP segment's headers, as far as limiter needs them.
///
/// Laid out so that no store LLVM joins is misaligned: the object is built with misaligned
/// access allowed, so LLVM joins neighbouring stores into words, and the verifier refuses
/// every misaligned stack access (a segment at a 4-byte boundary made the TC program
/// unloadable, and two byte fields at an odd offset joined into one `u16` store made the XDP
/// program so). Eight-byte aligned, fields in order of size, and the four one-byte fields in
/// one word.
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
    /// The flags, then whether IPv6, whether a first fragment, and the L3 offset, a byte each
    /// (see the accessors).
    meta: u32,
}

impl Segment {
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub fn new(
        src: [u8; 16],
        dst: [u8; 16],
        sport: u16,
        dport: u16,
        seq: u32,
        ack: u32,
        flags: u8,
        ipv6: bool,
        fragment: bool,
        l3_offset: u8,
    ) -> Segment {
        Segment {
            src,
            dst,
            seq,
            ack,
            sport,
            dport,
            meta: u32::from_le_bytes([flags, ipv6 as u8, fragment as u8, l3_offset]),
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

    /// The first fragment of a fragmented datagram: ports readable, the rest arrives later.
    #[inline(always)]
    pub fn fragment(&self) -> bool {
        (self.meta >> 16) as u8 != 0
    }

    /// Where the IP header starts, after Ethernet and VLAN tags (at most [`MAX_L3_OFFSET`]).
    /// A byte, not a `usize`: a value cut to a byte is bounded by its width wherever the
    /// compiler keeps it, while a bound learned by comparison is lost by older verifiers
    /// (Debian's 6.1; 6.12 keeps it) if the compiler spilled the value to the stack before
    /// comparing: 6.1 refused the reply's packet pointer arithmetic as unbounded.
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
/// For ingress only: the window must hold the whole packet (`whole` in [`parse`]).
#[inline(always)]
pub fn parse_common(w: &Window) -> Option<Common> {
    const V4: usize = ETH_HLEN + IPV4_HLEN + TCP_HLEN;
    const V6: usize = ETH_HLEN + IPV6_HLEN + TCP_HLEN;
    let len = w.end - w.start;
    let v4 = Bytes::<V4>::at(w)?;
    let proto = u16::from_be(v4.get::<u16, 12>());
    if proto == ETH_P_IP {
        let total = u16::from_be(v4.get::<u16, 16>()) as usize;
        let frag = u16::from_be(v4.get::<u16, 20>());
        let doff = (v4.get::<u8, 46>() >> 4) as usize * 4;
        let end = ETH_HLEN + total;
        if v4.get::<u8, 14>() != 0x45
            || frag & 0x3FFF != 0
            || v4.get::<u8, 23>() != IPPROTO_TCP
            || doff < TCP_HLEN
            || end > len
            || ETH_HLEN + IPV4_HLEN + doff > end
        {
            return None;
        }
        return Some(Common {
            tcp: v4.sub::<TCP_HLEN, 34>(),
            addrs: Addrs::V4(v4.sub::<8, 26>()),
        });
    }
    if proto != ETH_P_IPV6 {
        return None;
    }
    let v6 = Bytes::<V6>::at(w)?;
    let payload = u16::from_be(v6.get::<u16, 18>()) as usize;
    let doff = (v6.get::<u8, 66>() >> 4) as usize * 4;
    let end = ETH_HLEN + IPV6_HLEN + payload;
    if v6.get::<u8, 14>() >> 4 != 6
        || v6.get::<u8, 20>() != IPPROTO_TCP
        || doff < TCP_HLEN
        || end > len
        || ETH_HLEN + IPV6_HLEN + doff > end
    {
        return None;
    }
    Some(Common {
        tcp: v6.sub::<TCP_HLEN, 54>(),
        addrs: Addrs::V6(v6.sub::<32, 22>()),
    })
}

/// A common frame, checked by [`parse_common`]: the few fields the established fast path
/// judges by are read in place, and the whole [`Segment`] is built only when the packet
/// needs more than that.
#[derive(Clone, Copy)]
pub struct Common {
    tcp: Bytes<TCP_HLEN>,
    addrs: Addrs,
}

/// Where a common frame's source and destination addresses lie.
#[derive(Clone, Copy)]
enum Addrs {
    V4(Bytes<8>),
    V6(Bytes<32>),
}

impl Common {
    #[inline(always)]
    pub fn dport(self) -> u16 {
        u16::from_be(self.tcp.get::<u16, 2>())
    }

    #[inline(always)]
    pub fn ack(self) -> u32 {
        u32::from_be(self.tcp.get::<u32, 8>())
    }

    #[inline(always)]
    pub fn flags(self) -> u8 {
        self.tcp.get::<u8, 13>()
    }

    /// The whole segment, its TCP fields read in place.
    #[inline(always)]
    pub fn segment(self) -> Segment {
        let (src, dst, ipv6) = match self.addrs {
            Addrs::V4(ip) => (
                mapped(ip.get::<[u8; 4], 0>()),
                mapped(ip.get::<[u8; 4], 4>()),
                false,
            ),
            Addrs::V6(ip) => (ip.get::<[u8; 16], 0>(), ip.get::<[u8; 16], 16>(), true),
        };
        Segment::new(
            src,
            dst,
            u16::from_be(self.tcp.get::<u16, 0>()),
            self.dport(),
            u32::from_be(self.tcp.get::<u32, 4>()),
            self.ack(),
            self.flags(),
            ipv6,
            false,
            ETH_HLEN as u8,
        )
    }
}

/// The first `N` bytes of the packet, proven present by one bounds check, read at offsets
/// checked at compile time against `N`: one check the verifier sees, and no more.
#[derive(Clone, Copy)]
struct Bytes<const N: usize>(*const u8);

impl<const N: usize> Bytes<N> {
    #[inline(always)]
    fn at(w: &Window) -> Option<Self> {
        w.ptr::<[u8; N]>(0).map(|p| Self(p as *const u8))
    }

    #[inline(always)]
    fn get<T: Copy, const AT: usize>(self) -> T {
        const { assert!(AT + size_of::<T>() <= N) };
        // SAFETY: `at` proved `N` bytes present and `AT + size_of::<T>() <= N`; packets carry
        // no alignment promise, hence the unaligned read.
        unsafe { core::ptr::read_unaligned(self.0.add(AT) as *const T) }
    }

    /// The `M` bytes at `AT`.
    #[inline(always)]
    fn sub<const M: usize, const AT: usize>(self) -> Bytes<M> {
        const { assert!(AT + M <= N) };
        // SAFETY: stays within the `N` bytes proven present.
        Bytes(unsafe { self.0.add(AT) })
    }
}

/// `whole`: the window holds the whole packet, as in XDP, so a datagram longer than the window
/// was cut short. On TC egress the window is only the linear part of the skb (a GSO packet
/// carries most of its payload elsewhere), so there only the headers are checked.
///
/// Not inlined: its header copies get a stack frame of their own, beside the policy's rather
/// than under it (BPF allows 512 bytes of stack down any call chain).
#[inline(never)]
pub fn parse(w: &Window, whole: bool) -> Result<Segment, Reason> {
    let mut proto = w.u16_be(12).ok_or(Reason::Truncated)?;
    let mut l3 = ETH_HLEN;
    // Two tags at most (802.1ad outer, 802.1Q inner), unrolled for the verifier.
    for _ in 0..2 {
        if proto != ETH_P_8021Q && proto != ETH_P_8021AD {
            break;
        }
        proto = w.u16_be(l3 + 2).ok_or(Reason::Truncated)?;
        l3 += VLAN_HLEN;
    }
    match proto {
        ETH_P_IP => parse_ipv4(w, l3, whole),
        ETH_P_IPV6 => parse_ipv6(w, l3, whole),
        ETH_P_8021Q | ETH_P_8021AD => Err(Reason::Malformed),
        _ => Err(Reason::NonIp),
    }
}

#[inline(always)]
fn parse_ipv4(w: &Window, l3: usize, whole: bool) -> Result<Segment, Reason> {
    let header: [u8; IPV4_HLEN] = w.read(l3).ok_or(Reason::Truncated)?;
    if header[0] >> 4 != 4 {
        return Err(Reason::Malformed);
    }
    let ihl = ((header[0] & 0x0F) as usize) * 4;
    let total = u16::from_be_bytes([header[2], header[3]]) as usize;
    if ihl < IPV4_HLEN || total < ihl {
        return Err(Reason::Malformed);
    }
    let frag = u16::from_be_bytes([header[6], header[7]]);
    // More-fragments flag or an offset: part of a fragmented datagram.
    let fragment = frag & 0x3FFF != 0;
    if header[9] != IPPROTO_TCP {
        return Err(Reason::NonTcp);
    }
    if frag & 0x1FFF != 0 {
        // Not the first fragment: no TCP header at all.
        return Err(Reason::Fragment);
    }
    let src = mapped([header[12], header[13], header[14], header[15]]);
    let dst = mapped([header[16], header[17], header[18], header[19]]);
    let ip = Ip {
        l3,
        l4: l3 + ihl,
        end: l3 + total,
        ipv6: false,
        fragment,
        whole,
    };
    parse_tcp(w, &ip, src, dst)
}

#[inline(always)]
fn parse_ipv6(w: &Window, l3: usize, whole: bool) -> Result<Segment, Reason> {
    let header: [u8; IPV6_HLEN] = w.read(l3).ok_or(Reason::Truncated)?;
    if header[0] >> 4 != 6 {
        return Err(Reason::Malformed);
    }
    let end = l3 + IPV6_HLEN + u16::from_be_bytes([header[4], header[5]]) as usize;
    let mut next = header[6];
    let mut l4 = l3 + IPV6_HLEN;
    let mut fragment = false;
    for _ in 0..MAX_EXT_HEADERS {
        match next {
            IPPROTO_TCP => {
                let mut src = [0u8; 16];
                let mut dst = [0u8; 16];
                src.copy_from_slice(&header[8..24]);
                dst.copy_from_slice(&header[24..40]);
                let ip = Ip {
                    l3,
                    l4,
                    end,
                    ipv6: true,
                    fragment,
                    whole,
                };
                return parse_tcp(w, &ip, src, dst);
            }
            // Hop-by-hop, routing, destination options: length in 8-byte units past the first 8.
            IPV6_HOP_BY_HOP | IPV6_ROUTING | IPV6_DEST_OPTS => {
                let ext: [u8; 2] = w.read(l4).ok_or(Reason::Truncated)?;
                next = ext[0];
                l4 += (ext[1] as usize + 1) * 8;
            }
            IPV6_FRAGMENT => {
                let ext: [u8; 4] = w.read(l4).ok_or(Reason::Truncated)?;
                let frag = u16::from_be_bytes([ext[2], ext[3]]);
                next = ext[0];
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
                let ext: [u8; 2] = w.read(l4).ok_or(Reason::Truncated)?;
                next = ext[0];
                l4 += (ext[1] as usize + 2) * 4;
            }
            _ => {
                return Err(if fragment {
                    // A first fragment whose chain goes on in a later fragment.
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
    let lo = (0xFFFF_u64 << 32) | u32::from_be_bytes(v4) as u64;
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

/// Where the IP datagram lies in the window.
struct Ip {
    l3: usize,
    /// Where the TCP header starts.
    l4: usize,
    /// Where the datagram ends by its own length (the frame may carry padding past it).
    end: usize,
    ipv6: bool,
    fragment: bool,
    /// See [`parse`].
    whole: bool,
}

#[inline(always)]
fn parse_tcp(w: &Window, ip: &Ip, src: [u8; 16], dst: [u8; 16]) -> Result<Segment, Reason> {
    // A fragment's header cut short is the tiny-fragment attack: its own reason.
    let short = if ip.fragment {
        Reason::Fragment
    } else {
        Reason::Truncated
    };
    // The packet read comes first, so its bounds check stays a check the verifier sees.
    let tcp: [u8; TCP_HLEN] = w.read(ip.l4).ok_or(short)?;
    let doff = (tcp[12] >> 4) as usize * 4;
    // On ingress, the header must lie within the datagram's own length too (padding past it
    // is not TCP header), and the datagram within the frame. The host's own packets on egress
    // are trusted: a GSO packet's IP length may even be zero.
    if ip.whole && (ip.end > w.end - w.start || ip.l4 + doff.max(TCP_HLEN) > ip.end) {
        return Err(short);
    }
    if doff < TCP_HLEN {
        return Err(Reason::Malformed);
    }
    Ok(Segment::new(
        src,
        dst,
        u16::from_be_bytes([tcp[0], tcp[1]]),
        u16::from_be_bytes([tcp[2], tcp[3]]),
        u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]),
        u32::from_be_bytes([tcp[8], tcp[9], tcp[10], tcp[11]]),
        tcp[13],
        ip.ipv6,
        ip.fragment,
        // At most MAX_L3_OFFSET (two VLAN tags), which fits a byte.
        ip.l3 as u8,
    ))
}

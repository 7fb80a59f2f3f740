//! Parses Ethernet (up to two VLAN tags), IPv4 (with options), IPv6 (with a bounded number
//! of extension headers) and TCP, checking every read against the end of the packet.
//!
//! Anything it cannot or need not follow comes back as the [`Reason`] it is passed for, so the
//! caller can count it and let it through untouched.

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
/// IPv6 extension headers followed before giving up (counted as malformed past that).
const MAX_EXT_HEADERS: usize = 6;

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
#[derive(Clone, Copy)]
pub struct Segment {
    /// Source and destination as IPv6 addresses (IPv4 mapped to `::ffff:a.b.c.d`).
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub sport: u16,
    pub dport: u16,
    pub seq: u32,
    pub flags: u8,
    pub ipv6: bool,
    /// Where the IP header starts, after Ethernet and VLAN tags.
    pub l3_offset: usize,
}

impl Segment {
    /// A connection request: SYN without ACK (a SYN-ACK is the server's answer).
    #[inline(always)]
    pub fn is_syn(&self) -> bool {
        self.flags & (TCP_SYN | TCP_ACK | TCP_RST) == TCP_SYN
    }

    #[inline(always)]
    pub fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }
}

#[inline(always)]
pub fn parse(w: &Window) -> Result<Segment, Reason> {
    let mut proto = w.u16_be(12).ok_or(Reason::Malformed)?;
    let mut l3 = ETH_HLEN;
    // Two tags at most (802.1ad outer, 802.1Q inner), unrolled for the verifier.
    for _ in 0..2 {
        if proto != ETH_P_8021Q && proto != ETH_P_8021AD {
            break;
        }
        proto = w.u16_be(l3 + 2).ok_or(Reason::Malformed)?;
        l3 += VLAN_HLEN;
    }
    match proto {
        ETH_P_IP => parse_ipv4(w, l3),
        ETH_P_IPV6 => parse_ipv6(w, l3),
        ETH_P_8021Q | ETH_P_8021AD => Err(Reason::Malformed),
        _ => Err(Reason::NonIp),
    }
}

#[inline(always)]
fn parse_ipv4(w: &Window, l3: usize) -> Result<Segment, Reason> {
    let header: [u8; IPV4_HLEN] = w.read(l3).ok_or(Reason::Malformed)?;
    if header[0] >> 4 != 4 {
        return Err(Reason::Malformed);
    }
    let ihl = ((header[0] & 0x0F) as usize) * 4;
    if ihl < IPV4_HLEN {
        return Err(Reason::Malformed);
    }
    if u16::from_be_bytes([header[6], header[7]]) & 0x1FFF != 0 {
        return Err(Reason::Fragment);
    }
    if header[9] != IPPROTO_TCP {
        return Err(Reason::NonTcp);
    }
    let mut src = [0u8; 16];
    let mut dst = [0u8; 16];
    src[10] = 0xFF;
    src[11] = 0xFF;
    dst[10] = 0xFF;
    dst[11] = 0xFF;
    src[12..16].copy_from_slice(&header[12..16]);
    dst[12..16].copy_from_slice(&header[16..20]);
    parse_tcp(w, l3, l3 + ihl, src, dst, false)
}

#[inline(always)]
fn parse_ipv6(w: &Window, l3: usize) -> Result<Segment, Reason> {
    let header: [u8; IPV6_HLEN] = w.read(l3).ok_or(Reason::Malformed)?;
    if header[0] >> 4 != 6 {
        return Err(Reason::Malformed);
    }
    let mut next = header[6];
    let mut l4 = l3 + IPV6_HLEN;
    for _ in 0..MAX_EXT_HEADERS {
        match next {
            IPPROTO_TCP => {
                let mut src = [0u8; 16];
                let mut dst = [0u8; 16];
                src.copy_from_slice(&header[8..24]);
                dst.copy_from_slice(&header[24..40]);
                return parse_tcp(w, l3, l4, src, dst, true);
            }
            // Hop-by-hop, routing, destination options: length in 8-byte units past the first 8.
            0 | 43 | 60 => {
                let ext: [u8; 2] = w.read(l4).ok_or(Reason::Malformed)?;
                next = ext[0];
                l4 += (ext[1] as usize + 1) * 8;
            }
            // Fragment: only the first fragment carries the TCP header.
            44 => {
                let ext: [u8; 4] = w.read(l4).ok_or(Reason::Malformed)?;
                if u16::from_be_bytes([ext[2], ext[3]]) & 0xFFF8 != 0 {
                    return Err(Reason::Fragment);
                }
                next = ext[0];
                l4 += 8;
            }
            // Authentication header: length in 4-byte units, minus 2.
            51 => {
                let ext: [u8; 2] = w.read(l4).ok_or(Reason::Malformed)?;
                next = ext[0];
                l4 += (ext[1] as usize + 2) * 4;
            }
            _ => return Err(Reason::NonTcp),
        }
    }
    Err(Reason::Malformed)
}

#[inline(always)]
fn parse_tcp(
    w: &Window,
    l3: usize,
    l4: usize,
    src: [u8; 16],
    dst: [u8; 16],
    ipv6: bool,
) -> Result<Segment, Reason> {
    let tcp: [u8; TCP_HLEN] = w.read(l4).ok_or(Reason::Malformed)?;
    if (tcp[12] >> 4) < 5 {
        return Err(Reason::Malformed);
    }
    Ok(Segment {
        src,
        dst,
        sport: u16::from_be_bytes([tcp[0], tcp[1]]),
        dport: u16::from_be_bytes([tcp[2], tcp[3]]),
        seq: u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]),
        flags: tcp[13],
        ipv6,
        l3_offset: l3,
    })
}

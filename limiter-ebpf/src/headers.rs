//! The wire headers limiter reads and writes, one `#[repr(C, packed)]` struct each, read in
//! place through [`Window`]: a field is named where it is used, and a whole header costs one
//! bounds check the verifier sees.
//!
//! Packed, so that a header may start at any offset (packets carry no alignment promise) and a
//! field read is one load: the object is built with misaligned access allowed. Multi-byte
//! fields are in network order, behind [`Be16`] and [`Be32`], so a field cannot be used
//! without its conversion.

use core::mem::size_of;

/// A big-endian 16-bit field.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub struct Be16(u16);

impl Be16 {
    #[inline(always)]
    pub const fn new(value: u16) -> Self {
        Self(value.to_be())
    }

    #[inline(always)]
    pub const fn get(self) -> u16 {
        u16::from_be(self.0)
    }
}

/// A big-endian 32-bit field.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub struct Be32(u32);

impl Be32 {
    #[inline(always)]
    pub const fn new(value: u32) -> Self {
        Self(value.to_be())
    }

    #[inline(always)]
    pub const fn get(self) -> u32 {
        u32::from_be(self.0)
    }
}

pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86DD;
pub const ETH_P_8021Q: u16 = 0x8100;
pub const ETH_P_8021AD: u16 = 0x88A8;
pub const ETH_ALEN: usize = 6;

#[derive(Clone, Copy)]
#[repr(C, packed)]
pub struct EthHdr {
    pub dst: [u8; ETH_ALEN],
    pub src: [u8; ETH_ALEN],
    pub proto: Be16,
}

/// An 802.1Q or 802.1ad tag: the tag control word, then the protocol it carries.
#[derive(Clone, Copy)]
#[repr(C, packed)]
pub struct VlanHdr {
    pub tci: Be16,
    pub proto: Be16,
}

#[derive(Clone, Copy)]
#[repr(C, packed)]
pub struct Ipv4Hdr {
    pub version_ihl: u8,
    pub tos: u8,
    pub total_len: Be16,
    pub id: Be16,
    /// Flags (reserved, don't fragment, more fragments) and the fragment offset.
    pub frag_off: Be16,
    pub ttl: u8,
    pub protocol: u8,
    pub check: Be16,
    pub src: [u8; 4],
    pub dst: [u8; 4],
}

/// More-fragments flag and fragment offset: a datagram with either is a fragment.
pub const IPV4_FRAGMENTED: u16 = 0x3FFF;
/// The fragment offset alone: non-zero past the first fragment.
pub const IPV4_OFFSET: u16 = 0x1FFF;
pub const IPV4_DONT_FRAGMENT: u16 = 0x4000;

impl Ipv4Hdr {
    #[inline(always)]
    pub fn version(&self) -> u8 {
        self.version_ihl >> 4
    }

    /// The header's length in bytes, options included.
    #[inline(always)]
    pub fn header_len(&self) -> usize {
        usize::from(self.version_ihl & 0x0F) * 4
    }

    /// The one's-complement sum of the fixed header's words: `0xFFFF` when its checksum is
    /// right and it has no options (the options' words must be added for a longer header).
    #[inline(always)]
    pub fn word_sum(&self) -> u64 {
        add_words(0, as_bytes::<Self, IPV4_HLEN>(self))
    }
}

#[derive(Clone, Copy)]
#[repr(C, packed)]
pub struct Ipv6Hdr {
    /// Version, traffic class and flow label.
    pub version_class_flow: Be32,
    pub payload_len: Be16,
    pub next_header: u8,
    pub hop_limit: u8,
    pub src: [u8; 16],
    pub dst: [u8; 16],
}

impl Ipv6Hdr {
    #[inline(always)]
    pub fn version(&self) -> u8 {
        (self.version_class_flow.get() >> 28) as u8
    }
}

/// The first two bytes of an IPv6 extension header: what follows it, and its length in
/// units that depend on its type.
#[derive(Clone, Copy)]
#[repr(C, packed)]
pub struct Ipv6ExtHdr {
    pub next_header: u8,
    pub len: u8,
}

#[derive(Clone, Copy)]
#[repr(C, packed)]
pub struct Ipv6FragHdr {
    pub next_header: u8,
    pub reserved: u8,
    /// The fragment offset (in 8-byte units, the top 13 bits) and the more-fragments flag.
    pub offset_flags: Be16,
    pub id: Be32,
}

#[derive(Clone, Copy)]
#[repr(C, packed)]
pub struct TcpHdr {
    pub sport: Be16,
    pub dport: Be16,
    pub seq: Be32,
    pub ack: Be32,
    /// The data offset in its top four bits (in 4-byte words).
    pub data_offset: u8,
    pub flags: u8,
    pub window: Be16,
    pub check: Be16,
    pub urgent: Be16,
}

impl TcpHdr {
    /// The header's length in bytes, options included.
    #[inline(always)]
    pub fn header_len(&self) -> usize {
        usize::from(self.data_offset >> 4) * 4
    }
}

pub const ETH_HLEN: usize = size_of::<EthHdr>();
pub const VLAN_HLEN: usize = size_of::<VlanHdr>();
pub const IPV4_HLEN: usize = size_of::<Ipv4Hdr>();
pub const IPV6_HLEN: usize = size_of::<Ipv6Hdr>();
pub const TCP_HLEN: usize = size_of::<TcpHdr>();

const _: () = assert!(ETH_HLEN == 14 && VLAN_HLEN == 4);
const _: () = assert!(IPV4_HLEN == 20 && IPV6_HLEN == 40 && TCP_HLEN == 20);
const _: () = assert!(size_of::<Ipv6FragHdr>() == 8);

/// The common frame, IPv4: Ethernet, a 20-byte IPv4 header, TCP.
#[derive(Clone, Copy)]
#[repr(C, packed)]
pub struct V4Frame {
    pub eth: EthHdr,
    pub ip: Ipv4Hdr,
    pub tcp: TcpHdr,
}

/// The common frame, IPv6: Ethernet, IPv6 with TCP as its next header, TCP.
#[derive(Clone, Copy)]
#[repr(C, packed)]
pub struct V6Frame {
    pub eth: EthHdr,
    pub ip: Ipv6Hdr,
    pub tcp: TcpHdr,
}

/// A header's bytes, for checksums.
#[inline(always)]
pub fn as_bytes<T: Copy, const N: usize>(header: &T) -> &[u8; N] {
    const { assert!(size_of::<T>() == N) };
    // SAFETY: `T` is a packed header of exactly `N` bytes, every bit pattern of which is a
    // valid byte array, and the array has alignment 1.
    unsafe { &*(header as *const T as *const [u8; N]) }
}

/// Adds big-endian 16-bit words (an even number of bytes) to a one's-complement sum.
#[inline(always)]
pub fn add_words(mut sum: u64, bytes: &[u8]) -> u64 {
    let mut i = 0;
    while i + 1 < bytes.len() {
        sum += u64::from(u16::from_be_bytes([bytes[i], bytes[i + 1]]));
        i += 2;
    }
    sum
}

/// Folds a one's-complement sum to 16 bits.
#[inline(always)]
pub fn fold(mut sum: u64) -> u16 {
    for _ in 0..4 {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    sum as u16
}

/// The bytes a program may read: `[start, end)` of a linear packet buffer.
#[derive(Clone, Copy)]
pub struct Window {
    start: usize,
    end: usize,
}

impl Window {
    /// The whole frame of an XDP program.
    #[inline(always)]
    pub fn of_xdp(ctx: &aya_ebpf::programs::XdpContext) -> Self {
        Self {
            start: ctx.data(),
            end: ctx.data_end(),
        }
    }

    /// The linear part of a TC program's skb (a GSO packet carries most of its payload
    /// elsewhere).
    #[inline(always)]
    pub fn of_tc(ctx: &aya_ebpf::programs::TcContext) -> Self {
        Self {
            start: ctx.data(),
            end: ctx.data_end(),
        }
    }

    /// The bytes in the window.
    #[inline(always)]
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// A pointer to a `T` at `offset`, if the whole `T` lies inside the packet.
    #[inline(always)]
    pub fn ptr<T>(&self, offset: usize) -> Option<*const T> {
        let at = self.start + offset;
        if at + size_of::<T>() > self.end {
            return None;
        }
        Some(at as *const T)
    }

    /// The header at `offset`, in place, if it lies inside the packet.
    #[inline(always)]
    pub fn header<T: Copy>(&self, offset: usize) -> Option<&T> {
        // SAFETY: `ptr` checked the bounds; the headers are packed (alignment 1) and valid for
        // any bit pattern, and the packet outlives the program's use of the reference.
        self.ptr::<T>(offset).map(|p| unsafe { &*p })
    }

    /// A copy of the `T` at `offset`.
    #[inline(always)]
    pub fn read<T: Copy>(&self, offset: usize) -> Option<T> {
        // SAFETY: `ptr` checked the bounds; packets carry no alignment promise.
        self.ptr::<T>(offset)
            .map(|p| unsafe { core::ptr::read_unaligned(p) })
    }

    /// Copies `value` into the packet at `offset`, if it fits.
    #[inline(always)]
    pub fn write<T: Copy>(&self, offset: usize, value: &T) -> Option<()> {
        let p = self.ptr::<T>(offset)?;
        // SAFETY: `ptr` checked that the whole `T` lies inside the packet, which the program
        // may write; unaligned, as packets carry no alignment promise.
        unsafe { core::ptr::write_unaligned(p as *mut T, *value) };
        Some(())
    }
}

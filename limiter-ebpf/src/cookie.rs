//! SYN cookies made and checked with the host's own secret, so that a SYN from a source that
//! has not proven itself costs the host nothing: the programs answer it themselves, keep no
//! state for it, and the host builds the connection from the client's ACK as if it had sent
//! the cookie (`cookie_v4_check` / `cookie_v6_check`).
//!
//! The kernel makes the cookie (`bpf_tcp_gen_syncookie`, from the listener that
//! `bpf_skc_lookup_tcp` finds) and checks it (`bpf_tcp_check_syncookie`); the programs only
//! carry it. For the host to make one for a listener whose queue is not full it must run
//! `net.ipv4.tcp_syncookies = 2`; else the helper refuses and the SYN goes to the host, which
//! answers it itself. The cookie keeps only the MSS: window scaling and SACK ride in the low
//! bits of the SYN-ACK's timestamp, as in the kernel's own cookies (`cookie_init_timestamp`),
//! which the host decodes from the client's echo (see [`Config::cookie_timestamps`]).
//!
//! Only a segment whose TCP header follows the IP header directly is answered: the helpers
//! read both headers in place. Any other SYN (IPv6 extension headers) takes the ordinary path.

use aya_ebpf::{
    bindings::{BPF_F_CURRENT_NETNS, BPF_TCP_LISTEN, bpf_sock, bpf_sock_tuple, tcphdr},
    cty::c_void,
    helpers::{
        bpf_ktime_get_ns, bpf_sk_release, bpf_skc_lookup_tcp, bpf_tcp_check_syncookie,
        bpf_tcp_gen_syncookie,
    },
};
use limiter_common::Config;

use crate::{
    headers::{Be16, Be32, IPV4_HLEN, IPV6_HLEN, Ipv4Hdr, Ipv6Hdr, TCP_HLEN, TcpHdr, Window},
    parsing::{IPPROTO_TCP, MAX_L3_OFFSET, Segment},
};

/// Where a segment's IP and TCP headers lie, for the helpers.
#[derive(Clone, Copy)]
struct Located {
    ip: usize,
    /// The IP header's fixed part only: the helpers read addresses, nothing after them.
    ip_len: u32,
    tcp: usize,
    tcp_len: usize,
}

#[inline(always)]
fn locate(w: &Window, seg: &Segment) -> Option<Located> {
    let ip = usize::from(seg.l3_offset());
    if ip > MAX_L3_OFFSET {
        return None;
    }
    let (ip_len, tcp) = if seg.ipv6() {
        let header = w.header::<Ipv6Hdr>(ip)?;
        if header.next_header != IPPROTO_TCP {
            return None;
        }
        (IPV6_HLEN as u32, ip + IPV6_HLEN)
    } else {
        let len = w.header::<Ipv4Hdr>(ip)?.header_len() & 0x3C;
        if len < IPV4_HLEN {
            return None;
        }
        (IPV4_HLEN as u32, ip + len)
    };
    let tcp_len = w.header::<TcpHdr>(tcp)?.header_len() & 0x3C;
    // Whether the options lie inside the packet is checked byte by byte as they are read:
    // a check of the last byte here would let the compiler drop those, which the verifier,
    // unable to follow it, needs.
    if tcp_len < TCP_HLEN {
        return None;
    }
    Some(Located {
        ip,
        ip_len,
        tcp,
        tcp_len,
    })
}

/// A socket the kernel lent us, given back when dropped (the verifier insists it is).
struct Socket(*mut bpf_sock);

impl Drop for Socket {
    #[inline(always)]
    fn drop(&mut self) {
        // SAFETY: a socket from a successful lookup, released once.
        unsafe { bpf_sk_release(self.0 as *mut c_void) };
    }
}

impl Socket {
    /// The socket the host would deliver `seg` to: an established one of its 4-tuple, else
    /// the listener on its port.
    #[inline(always)]
    fn of(ctx: *mut c_void, seg: &Segment) -> Option<Socket> {
        // SAFETY: a plain C union of integers, every bit pattern valid.
        let mut aligned = Aligned(unsafe { core::mem::zeroed() });
        let tuple = &mut aligned.0;
        let size = if seg.ipv6() {
            // SAFETY: writing the union's IPv6 arm, which the lookup then reads.
            let t = unsafe { &mut tuple.__bindgen_anon_1.ipv6 };
            t.saddr = words(&seg.src);
            t.daddr = words(&seg.dst);
            t.sport = seg.sport.to_be();
            t.dport = seg.dport.to_be();
            core::mem::size_of_val(t)
        } else {
            // SAFETY: writing the union's IPv4 arm, which the lookup then reads.
            let t = unsafe { &mut tuple.__bindgen_anon_1.ipv4 };
            t.saddr = u32::from_ne_bytes([seg.src[12], seg.src[13], seg.src[14], seg.src[15]]);
            t.daddr = u32::from_ne_bytes([seg.dst[12], seg.dst[13], seg.dst[14], seg.dst[15]]);
            t.sport = seg.sport.to_be();
            t.dport = seg.dport.to_be();
            core::mem::size_of_val(t)
        };
        // SAFETY: the context the program was given, and a tuple of the size passed.
        let sk =
            unsafe { bpf_skc_lookup_tcp(ctx, tuple, size as u32, BPF_F_CURRENT_NETNS as u64, 0) };
        // Built only for a socket found: a `Socket` of null would be released on drop.
        if sk.is_null() { None } else { Some(Socket(sk)) }
    }

    #[inline(always)]
    fn listening(&self) -> bool {
        // SAFETY: a field the verifier lets any socket reference read.
        unsafe { (*self.0).state == BPF_TCP_LISTEN }
    }
}

/// A lookup's tuple, eight-byte aligned on the stack: the compiler stores its addresses a
/// word of eight bytes at a time, and the verifier refuses a misaligned stack access.
#[repr(C, align(8))]
struct Aligned(bpf_sock_tuple);

/// An address's four words, in the byte order they have in the packet.
#[inline(always)]
fn words(address: &[u8; 16]) -> [u32; 4] {
    let mut words = [0u32; 4];
    for (i, word) in words.iter_mut().enumerate() {
        *word = u32::from_ne_bytes([
            address[4 * i],
            address[4 * i + 1],
            address[4 * i + 2],
            address[4 * i + 3],
        ]);
    }
    words
}

/// The SYN's options a cookie's SYN-ACK answers. Plain fields, no `Option`s: LLVM spills the
/// payload of a `None` it never initialised, and the verifier refuses reads of it.
#[derive(Clone, Copy)]
pub struct Offered {
    /// The client's timestamp, to echo (with [`Offered::TIMESTAMP`]).
    pub tsval: u32,
    /// The client's window scale (with [`Offered::WSCALE`]).
    pub wscale: u8,
    /// Which options the SYN carried.
    pub flags: u8,
}

impl Offered {
    pub const TIMESTAMP: u8 = 1;
    pub const SACK: u8 = 2;
    pub const WSCALE: u8 = 4;
    pub const NONE: Offered = Offered {
        tsval: 0,
        wscale: 0,
        flags: 0,
    };

    #[inline(always)]
    fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }
}

const OPT_END: u8 = 0;
const OPT_NOP: u8 = 1;
const OPT_WSCALE: u8 = 3;
const OPT_SACK_PERM: u8 = 4;
const OPT_TIMESTAMP: u8 = 8;

/// The bytes of a TCP header's options (at most 40).
const MAX_OPTIONS_LEN: usize = 40;

#[inline(always)]
fn options_of(w: &Window, at: &Located) -> Offered {
    let mut options = [OPT_END; MAX_OPTIONS_LEN];
    // Copied out of the packet with one bounds check of a constant length per header length:
    // the verifier follows a check of a variable offset only as far as the compiler keeps its
    // shape, which it does not through a walk of the options.
    macro_rules! copy {
        ($($len:literal)*) => {
            match at.tcp_len - TCP_HLEN {
                $($len => match w.read::<[u8; $len]>(at.tcp + TCP_HLEN) {
                    Some(bytes) => options[..$len].copy_from_slice(&bytes),
                    None => return Offered::NONE,
                },)*
                _ => return Offered::NONE,
            }
        };
    }
    copy!(4 8 12 16 20 24 28 32 36 40);
    parse_options(&options)
}

/// Walks a SYN's options (on the stack, padded with END) for what a SYN-ACK answers. Unrolled
/// over every position an option may start at, so that each read is at a constant offset:
/// the verifier refuses reads of the stack at a variable one.
#[inline(always)]
fn parse_options(options: &[u8; MAX_OPTIONS_LEN]) -> Offered {
    let mut found = Offered::NONE;
    let mut next = 0;
    macro_rules! walk {
        ($($at:literal)*) => {
            $(if next == $at {
                next = option_at::<$at>(options, &mut found);
            })*
        };
    }
    walk!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31
        32 33 34 35 36 37 38);
    found
}

/// Reads the option starting at `AT` into `found`; returns where the next one starts (past
/// the end when the walk is over).
#[inline(always)]
fn option_at<const AT: usize>(options: &[u8; MAX_OPTIONS_LEN], found: &mut Offered) -> usize {
    const DONE: usize = MAX_OPTIONS_LEN;
    let byte = |i: usize| options.get(i).copied().unwrap_or(OPT_END);
    let kind = byte(AT);
    match kind {
        OPT_END => return DONE,
        OPT_NOP => return AT + 1,
        _ => {}
    }
    let len = usize::from(byte(AT + 1));
    if len < 2 || AT + len > MAX_OPTIONS_LEN {
        return DONE;
    }
    match (kind, len) {
        (OPT_SACK_PERM, 2) => found.flags |= Offered::SACK,
        (OPT_WSCALE, 3) => {
            found.wscale = byte(AT + 2);
            found.flags |= Offered::WSCALE;
        }
        (OPT_TIMESTAMP, 10) => {
            found.tsval =
                u32::from_be_bytes([byte(AT + 2), byte(AT + 3), byte(AT + 4), byte(AT + 5)]);
            found.flags |= Offered::TIMESTAMP;
        }
        _ => {}
    }
    AT + len
}

/// What a SYN cookie's SYN-ACK says.
#[derive(Clone, Copy)]
pub struct Cookie {
    pub isn: u32,
    pub offered: Offered,
}

/// Makes the cookie for a SYN, if its listener takes cookies now: the cookie in the low 32
/// bits, or negative to send the SYN on to the host (no listener, another socket on its
/// 4-tuple, or a host that gives no cookie while its queue has room). A plain integer, not an
/// `Option`, for the reason [`Offered`] has none. Not inlined, nor is [`offered`]: each gets
/// a stack frame of its own beside the SYN-ACK's writer, not under it.
#[inline(never)]
pub fn make(ctx: *mut c_void, w: &Window, seg: &Segment) -> i64 {
    let Some(at) = locate(w, seg) else {
        return -1;
    };
    let Some(socket) = Socket::of(ctx, seg) else {
        return -1;
    };
    if !socket.listening() {
        return -1;
    }
    let Some(ip) = w.ptr::<u8>(at.ip) else {
        return -1;
    };
    gen_cookie(w, &socket, ip as *mut c_void, &at)
}

/// Leaves the cookie made for `syn` in its acknowledgment number, unused in a SYN, for
/// `limiter_tc_ingress` to answer with (see [`limiter_common::COOKIE_MARK`]).
#[inline(always)]
pub fn stash(w: &Window, syn: &Segment, isn: u32) -> bool {
    // Through the whole header, whose bounds the verifier then knows, not at an offset in it.
    let Some(tcp) = locate(w, syn).and_then(|at| w.ptr::<TcpHdr>(at.tcp)) else {
        return false;
    };
    // SAFETY: `ptr` checked that the whole header lies inside the packet, which the program
    // may write; the header is packed, so the field needs no alignment.
    unsafe { (*(tcp as *mut TcpHdr)).ack = Be32::new(isn) };
    true
}

/// The cookie [`stash`] left in `syn`.
#[inline(always)]
pub fn stashed(w: &Window, syn: &Segment) -> Option<u32> {
    let at = locate(w, syn)?;
    Some(w.header::<TcpHdr>(at.tcp)?.ack.get())
}

/// The options `seg` (a SYN) offered.
#[inline(never)]
pub fn offered(w: &Window, seg: &Segment) -> Offered {
    match locate(w, seg) {
        Some(at) => options_of(w, &at),
        None => Offered::NONE,
    }
}

/// `bpf_tcp_gen_syncookie`, whose TCP header length must be the header's own and a constant
/// the verifier can check against the packet: one call per possible length. Negative when no
/// cookie was made.
#[inline(always)]
fn gen_cookie(w: &Window, socket: &Socket, ip: *mut c_void, at: &Located) -> i64 {
    macro_rules! by_length {
        ($($len:literal)*) => {
            match at.tcp_len {
                $($len => {
                    let Some(tcp) = w.ptr::<[u8; $len]>(at.tcp) else {
                        return -1;
                    };
                    let tcp = tcp as *mut tcphdr;
                    // SAFETY: a listener from a successful lookup, and headers inside the
                    // packet of the lengths passed.
                    unsafe {
                        bpf_tcp_gen_syncookie(socket.0 as *mut c_void, ip, at.ip_len, tcp, $len)
                    }
                })*
                _ => -1,
            }
        };
    }
    by_length!(20 24 28 32 36 40 44 48 52 56 60)
}

/// Whether an ACK no half-open handshake expects carries a cookie the host made.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Check {
    Valid,
    /// A listener's ACK whose cookie the host's secret did not make (or made too long ago).
    Invalid,
    /// An ACK of an existing socket, or of no socket at all: the host judges it.
    NotACookie,
}

#[inline(always)]
pub fn check(ctx: *mut c_void, w: &Window, seg: &Segment) -> Check {
    let Some(at) = locate(w, seg) else {
        return Check::NotACookie;
    };
    let Some(socket) = Socket::of(ctx, seg) else {
        return Check::NotACookie;
    };
    if !socket.listening() {
        return Check::NotACookie;
    }
    let (Some(ip), Some(tcp)) = (w.ptr::<u8>(at.ip), w.ptr::<TcpHdr>(at.tcp)) else {
        return Check::NotACookie;
    };
    // SAFETY: a listener from a successful lookup, and headers inside the packet of the
    // lengths passed (the helper reads the fixed TCP header only).
    let checked = unsafe {
        bpf_tcp_check_syncookie(
            socket.0 as *mut c_void,
            ip as *mut c_void,
            at.ip_len,
            tcp as *mut tcphdr,
            TCP_HLEN as u32,
        )
    };
    if checked == 0 {
        Check::Valid
    } else {
        Check::Invalid
    }
}

/// Low bits of a cookie's timestamp (`include/net/tcp.h`): the client's window scale (all ones:
/// none), then SACK.
const TS_OPT_WSCALE_MASK: u32 = 0xF;
const TS_OPT_SACK: u32 = 1 << 4;
const TS_BITS: u32 = 6;
/// The largest window scale TCP allows (RFC 7323).
const MAX_WSCALE: u8 = 14;

/// The options of a cookie's SYN-ACK: always 20 bytes, NOPs where an option is not offered,
/// so that one layout serves every SYN.
#[derive(Clone, Copy)]
#[repr(C, packed)]
pub struct SynAckOptions {
    mss_kind: u8,
    mss_len: u8,
    mss: Be16,
    sack: [u8; 2],
    ts_kind: [u8; 2],
    tsval: Be32,
    tsecr: Be32,
    wscale: [u8; 4],
}

pub const SYN_ACK_OPTIONS_LEN: usize = core::mem::size_of::<SynAckOptions>();
const _: () = assert!(SYN_ACK_OPTIONS_LEN == 20);

impl SynAckOptions {
    #[inline(always)]
    pub fn mss(&self) -> u16 {
        let mss = self.mss;
        mss.get()
    }

    /// What the host will agree to when it builds the connection: the MSS always; SACK and
    /// window scaling only with a timestamp to carry them, and only where the host can read
    /// them back ([`Config::cookie_timestamps`]).
    #[inline(always)]
    pub fn answering(cookie: &Cookie, ipv6: bool, config: &Config) -> SynAckOptions {
        let mss = if ipv6 {
            config.cookie_mss_v6
        } else {
            config.cookie_mss_v4
        };
        let mut options = SynAckOptions {
            mss_kind: 2,
            mss_len: 4,
            mss: Be16::new(mss),
            sack: [OPT_NOP; 2],
            ts_kind: [OPT_NOP; 2],
            tsval: Be32::new(0x0101_0101),
            tsecr: Be32::new(0x0101_0101),
            wscale: [OPT_NOP; 4],
        };
        let offered = cookie.offered;
        if !offered.has(Offered::TIMESTAMP) || config.cookie_timestamps == 0 {
            return options;
        }
        let mut bits = TS_OPT_WSCALE_MASK;
        if offered.has(Offered::WSCALE) {
            bits = u32::from(offered.wscale.min(MAX_WSCALE));
            options.wscale = [OPT_NOP, OPT_WSCALE, 3, config.cookie_wscale.min(MAX_WSCALE)];
        }
        if offered.has(Offered::SACK) {
            bits |= TS_OPT_SACK;
            options.sack = [OPT_SACK_PERM, 2];
        }
        options.ts_kind = [OPT_TIMESTAMP, 10];
        options.tsval = Be32::new(timestamp(bits));
        options.tsecr = Be32::new(offered.tsval);
        options
    }
}

/// The host's TCP clock (milliseconds of `CLOCK_MONOTONIC`, with no offset under
/// `tcp_timestamps = 2`), its low bits replaced by `bits` and never ahead of the clock, so
/// that the host's own later timestamps do not go back.
#[inline(always)]
fn timestamp(bits: u32) -> u32 {
    // SAFETY: the helper has no preconditions.
    let now = (unsafe { bpf_ktime_get_ns() } / 1_000_000) as u32;
    let ts = (now >> TS_BITS << TS_BITS) | bits;
    if ts > now {
        ts.wrapping_sub(1 << TS_BITS)
    } else {
        ts
    }
}

//! Map keys and values shared by the kernel programs and the agent.
//!
//! Every type here crosses the kernel/user boundary byte for byte, so each is `#[repr(C)]`
//! with explicit padding fields: the agent must see exactly what the programs wrote, and the
//! verifier rejects reads of uninitialised stack bytes in map keys.
#![no_std]
#![deny(missing_docs)]
#![warn(missing_debug_implementations)]

pub mod map_catalogue;
pub mod profile;
pub mod source;
pub mod stats;

pub use map_catalogue::map_names;
pub use profile::{Limits, MAX_PROFILES, PROFILE_SLOTS, Profile, ProfileSource};
pub use source::{SourceKey, source_key};
pub use stats::{Direction, Event, Reason, Verdict};

/// How a refused SYN is answered.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Silently dropped: the client retries into a timeout. Right for floods.
    Drop = 0,
    /// Answered with RST|ACK (SYNs only; other refused packets are dropped): the client sees "connection refused" at once.
    Rst = 1,
}

impl Refusal {
    /// Reads a byte the agent wrote into [`Config`]. Anything but `Rst` is `Drop`, so a byte
    /// that is not a valid refusal fails quiet rather than answering floods with RSTs.
    pub const fn from_u8(value: u8) -> Self {
        if value == Refusal::Rst as u8 {
            Refusal::Rst
        } else {
            Refusal::Drop
        }
    }
}

/// The live configuration, the single entry of the `CONFIG` array. The agent rewrites it
/// whenever a setting changes; the programs read it once per packet, so a change applies
/// from the next packet on without reloading anything.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// The top level's limits: those of every protected port no profile names (profile slot
    /// 0). A profile's are in `PROFILES`.
    pub limits: Limits,
    /// Prefix length an IPv4 source is masked to before it becomes a key (32: per address).
    pub ipv4_prefix: u8,
    /// Prefix length an IPv6 source is masked to (e.g. 64, since one host often holds a /64).
    pub ipv6_prefix: u8,
    /// [`Refusal`] for banned sources.
    pub reject_ban: u8,
    /// [`Refusal`] for denylisted sources.
    pub reject_deny: u8,
    /// Non-zero: a new connection that finds the flow table full is refused, not let through.
    pub fail_closed: u8,
    /// Non-zero: every local port is protected; a port `PORTS` leaves at 0 is the top level's.
    pub all_ports: u8,
    /// Non-zero when the allow tries hold entries: lets the fast path skip empty tries.
    pub has_allow: u8,
    /// Non-zero when the deny tries hold entries, for the same reason.
    pub has_deny: u8,
    /// Non-zero when `BANS` may hold entries: without it no packet pays the ban lookup. Whoever
    /// adds a ban (the agent, and the operator commands writing pinned maps when no agent
    /// answers) sets it after the insert; it is cleared only when `BANS` is seen empty.
    pub has_bans: u8,
    /// Zero: a SYN refused with `rst` is marked (its Ethernet type becomes [`RST_MARK`]) and
    /// passed, and `limiter_tc_ingress` turns it into the RST|ACK and redirects it out of the
    /// interface it came in on. That works on every interface, including a veth whose peer
    /// runs no XDP program, but needs `limiter_tc_ingress` attached wherever `limiter_xdp` is
    /// (without it the host's stack drops a marked SYN unanswered). Non-zero: the RST|ACK is
    /// sent with `XDP_TX`, which is cheaper but on a veth reaches the client only if the peer
    /// runs NAPI (an XDP program).
    pub rst_xdp_tx: u8,
    /// Non-zero: a SYN to a protected port from a source holding no connection is answered
    /// by the programs with a SYN cookie's SYN-ACK, made with the host's own secret
    /// (`bpf_tcp_gen_syncookie`), and never reaches the host; its ACK, checked against the
    /// same secret, proves the source, and only then is anything charged. The agent writes
    /// it from `syn-cookies` (`auto` switches it live). [`syn_cookies`] bits.
    pub syn_cookies: u8,
    /// The window scale a cookie's SYN-ACK offers: the one the host will use for the
    /// connection it builds from the cookie (derived, as the kernel does, from
    /// `net.ipv4.tcp_rmem` and `net.core.rmem_max`), so that both ends agree on it.
    pub cookie_wscale: u8,
    /// Non-zero: a cookie's SYN-ACK carries a timestamp whose low bits keep the client's
    /// window scale and SACK (as the kernel's own cookies do). Only when the host runs
    /// `net.ipv4.tcp_timestamps = 2`: with 1, the host adds a per-connection secret offset
    /// to its timestamps, which the programs cannot know, so it would misread those bits.
    pub cookie_timestamps: u8,
    /// Non-zero: tunnelled packets (IPv4 protocol or IPv6 next header 4, 41 or 47) pass on
    /// ingress; zero: they are dropped as [`Reason::Tunnel`], since the SYN inside would
    /// reach the host through its tunnel device unjudged.
    pub tunnels_pass: u8,
    /// Non-zero when the override tries hold entries ([`SourceLimits`]): only then does a
    /// SYN or a completing handshake pay the longest-prefix lookup of its source.
    pub has_overrides: u8,
    /// Non-zero when some port belongs to a profile: only then does a packet to a port
    /// protected by `all_ports` pay the read of its `PORTS` byte.
    pub has_profiles: u8,
    /// The MSS a cookie's SYN-ACK offers over IPv4 (the protected interfaces' smallest MTU
    /// less 40).
    pub cookie_mss_v4: u16,
    /// The MSS a cookie's SYN-ACK offers over IPv6 (the MTU less 60).
    pub cookie_mss_v6: u16,
    /// `SYN_BUCKETS` slots minus one (their count is a power of two): the mask of
    /// [`bucket_place`]. Follows the map the programs run with, which a pinned table keeps.
    pub bucket_mask: u32,
    /// The secret key of [`bucket_place`]: which sources share a slot must not be something a
    /// sender can work out. Chosen once, when the maps are made, and kept with them (a new
    /// seed would move every source to a slot that counted others' connections).
    pub bucket_seed: u64,
    /// Non-zero: kernel escalation is on. A SYN over its source's cap or SYN rate is passed to
    /// the host, to be refused at its handshake's ACK, which proves the source (a forged SYN's
    /// handshake never completes); each such proven refusal, made or (in monitor mode) not,
    /// is recorded in `OFFENDERS` ([`Offense`]), where the agent finds the sources to ban. A
    /// pause longer than this, in nanoseconds, between two refusals starts a new streak.
    pub offense_gap_ns: u64,
}

const _: () = assert!(core::mem::size_of::<Config>() == 104);

impl Config {
    /// What the programs do before the agent writes a configuration: count, limit nothing.
    pub const UNCONFIGURED: Config = Config {
        limits: Limits::UNLIMITED,
        ipv4_prefix: 32,
        ipv6_prefix: 128,
        reject_ban: Refusal::Drop as u8,
        reject_deny: Refusal::Drop as u8,
        fail_closed: 0,
        all_ports: 1,
        has_allow: 0,
        has_deny: 0,
        has_bans: 0,
        rst_xdp_tx: 0,
        syn_cookies: 0,
        cookie_wscale: 0,
        cookie_timestamps: 0,
        tunnels_pass: 1,
        has_overrides: 0,
        has_profiles: 0,
        cookie_mss_v4: 536,
        cookie_mss_v6: 1220,
        bucket_mask: 0,
        bucket_seed: 0,
        offense_gap_ns: 0,
    };
}

/// A source's streak of connection attempts refused at their proven handshake (over its cap
/// or its SYN rate), the value of `OFFENDERS` by source key (see [`Config::offense_gap_ns`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Offense {
    /// `CLOCK_BOOTTIME` nanoseconds of the streak's first refusal.
    pub first_ns: u64,
    /// `CLOCK_BOOTTIME` nanoseconds of its last.
    pub last_ns: u64,
    /// Refusals in the streak.
    pub refusals: u64,
    /// Non-zero when a refusal of the streak was only judged, in monitor mode: such a streak
    /// bans nobody, and counts as a ban monitor mode did not place.
    pub monitored: u64,
}

const _: () = assert!(core::mem::size_of::<Offense>() == 32);

/// A source prefix's own limits (`[[overrides]]`): the value of the override tries, which a
/// source whose key falls in the prefix gets in place of its port profile's per-source cap and
/// SYN rate (the most specific prefix wins). A field the override leaves out holds
/// [`SourceLimits::INHERIT`], and the source keeps its profile's there, so one override reads
/// right on every port.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SourceLimits {
    /// Concurrent connections per source key; 0 = no limit.
    pub max_conn_per_ip: u32,
    /// SYNs per second per source key; 0 = no limit (shown; the programs use the terms).
    pub syn_rate: u32,
    /// SYNs back to back before the rate applies. Given without a rate of its own, it is the
    /// burst of the profile's rate.
    pub syn_burst: u32,
    /// Explicit padding (see the module's doc).
    pub _pad: u32,
    /// The SYN rate's emission interval in nanoseconds, as [`Limits::syn_interval_ns`].
    pub syn_interval_ns: u64,
    /// The SYN rate's burst tolerance in nanoseconds, as [`Limits::syn_tolerance_ns`].
    pub syn_tolerance_ns: u64,
}

const _: () = assert!(core::mem::size_of::<SourceLimits>() == 32);

impl SourceLimits {
    /// A field the override leaves to its port's profile.
    pub const INHERIT: u32 = u32::MAX;

    /// The limits with their GCRA terms derived, as the programs need them; `None`: the
    /// profile's. A rate without a burst brings its default burst, twice the rate.
    pub fn new(
        max_conn_per_ip: Option<u32>,
        syn_rate: Option<u32>,
        syn_burst: Option<u32>,
    ) -> Self {
        let burst = match (syn_rate, syn_burst) {
            (_, Some(burst)) => burst,
            (Some(rate), None) => rate.saturating_mul(2),
            (None, None) => Self::INHERIT,
        };
        let (syn_interval_ns, syn_tolerance_ns) =
            syn_rate.map_or((0, 0), |rate| gcra_terms(rate, burst));
        Self {
            max_conn_per_ip: max_conn_per_ip.unwrap_or(Self::INHERIT),
            syn_rate: syn_rate.unwrap_or(Self::INHERIT),
            syn_burst: burst,
            _pad: 0,
            syn_interval_ns,
            syn_tolerance_ns,
        }
    }

    /// A field as the operator set it; `None` where the profile's applies.
    pub fn own(field: u32) -> Option<u32> {
        (field != Self::INHERIT).then_some(field)
    }
}

/// A rate's emission interval and burst tolerance in nanoseconds; (0, 0) for no limit.
pub(crate) fn gcra_terms(rate: u32, burst: u32) -> (u64, u64) {
    let interval = 1_000_000_000u64.checked_div(u64::from(rate)).unwrap_or(0);
    (interval, interval * u64::from(burst.max(1)))
}

/// The bits of [`Config::syn_cookies`].
pub mod syn_cookies {
    /// Answer an unproven source's SYN with a cookie.
    pub const ANSWER: u8 = 1;
    /// Check an ACK that no half-open handshake expects for a cookie. Set with [`ANSWER`], and
    /// kept for a while after it is cleared, so that the ACKs of cookies already sent are
    /// still charged.
    pub const CHECK: u8 = 2;
}

/// A connection seen from the client's side: `remote` is the address that sent the SYN,
/// `local` the protected address. Egress packets are keyed in the same orientation.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlowKey {
    /// The client's address, IPv4-mapped for IPv4, unmasked.
    pub remote: [u8; 16],
    /// The protected address the client connected to.
    pub local: [u8; 16],
    /// The client's port, host byte order.
    pub remote_port: u16,
    /// The protected port, host byte order.
    pub local_port: u16,
    /// Explicit padding, always zero: a key's every byte is hashed.
    pub _pad: u32,
}

const _: () = assert!(core::mem::size_of::<FlowKey>() == 40);

/// Flow state bits, set with atomic OR so ingress and egress never lose each other's bit.
pub mod flow_state {
    /// The client acknowledged the SYN-ACK. Every flow enters `FLOWS` with it set (half-open
    /// connections live in `HALF_OPEN`); it stays a bit so the agent can read it as before.
    pub const ESTABLISHED: u32 = 1;
    /// A FIN came from the client.
    pub const FIN_IN: u32 = 2;
    /// A FIN went to the client.
    pub const FIN_OUT: u32 = 4;
    /// Both FINs seen.
    pub const FIN_BOTH: u32 = FIN_IN | FIN_OUT;
    /// A RST came from the client. Only marked: XDP cannot tell a RST the host will accept
    /// from one it will discard (outside the window, a bad checksum), so a RST from outside
    /// never releases a flow. The agent's sweeper releases it once the host's socket table
    /// no longer has the connection.
    pub const RST_IN: u32 = 8;
}

/// An admitted connection: its handshake completed (the client acknowledged the server's ISN).
/// It holds one slot of its source's count and one of the global count from that ACK until
/// whoever deletes it from `FLOWS` releases them.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flow {
    /// `CLOCK_BOOTTIME` nanoseconds of the connection's SYN.
    pub first_seen_ns: u64,
    /// `CLOCK_BOOTTIME` nanoseconds of the handshake's completion. Not refreshed per packet:
    /// that would be a map write on the fast path. Whether a connection still lives is the
    /// host's socket table's to say, not an idle timer's.
    pub last_seen_ns: u64,
    /// The source key and profile slot the slots were charged to, so that release finds them
    /// even if the prefix changed or a reload moved the port to another profile. Kept whole,
    /// so the programs hand it to the count table as it is, without a copy on the stack.
    pub counted: ProfileSource,
    /// [`flow_state`] bits.
    pub state: u32,
    /// Explicit padding, always zero.
    pub _pad: u32,
}

const _: () = assert!(core::mem::size_of::<Flow>() == 48);

/// A connection between the server's SYN-ACK and the client's ACK of it, in the LRU
/// `HALF_OPEN` map keyed by its [`FlowKey`]. Written when the SYN-ACK leaves the host, not
/// when the SYN arrives, so that admitting a SYN writes no hash table. It holds no slot: a
/// source that never completes a handshake (a spoofed one cannot) costs the caps nothing, and
/// the LRU forgets it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HalfOpen {
    /// The source key the connection will be charged to, in the profile of the port the
    /// SYN-ACK left from.
    pub counted: ProfileSource,
    /// `CLOCK_BOOTTIME` nanoseconds of the SYN-ACK.
    pub first_seen_ns: u64,
    /// The server's initial sequence number: the client's ACK must acknowledge it plus one.
    pub server_isn: u32,
    /// Explicit padding, always zero.
    pub _pad: u32,
}

const _: () = assert!(core::mem::size_of::<HalfOpen>() == 40);

/// How many of a source's last refused SYNs it remembers, to tell a new connection attempt
/// from a retransmission of a refused one.
pub const SEEN_ATTEMPTS: usize = 4;

/// Signatures of a source's last refused SYNs (a hash of the 4-tuple and sequence number,
/// never 0; a slot per signature's top bits). A refused SYN whose signature is there is a
/// retransmission: a client retries a refused `connect` with the same SYN, and a new
/// `connect` has a new ISN. Kept in the record the refusal already reads, so telling the two
/// apart costs no lookup of its own; a source with more refused attempts in flight than
/// slots may see a retransmission counted again.
pub type SeenAttempts = [u32; SEEN_ATTEMPTS];

/// The signature of a refused SYN in [`SeenAttempts`]: a 32-bit hash of its 4-tuple and
/// sequence number, never 0 (the mark of a slot never written). Multiply-xorshift rounds:
/// cheap in the kernel, and spread over the high bits that pick the slot.
#[inline(always)]
pub fn attempt_signature(src: &[u8; 16], dst: &[u8; 16], sport: u16, dport: u16, seq: u32) -> u32 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let src = u128::from_ne_bytes(*src);
    let dst = u128::from_ne_bytes(*dst);
    let mut h = (u64::from(sport) << 48 | u64::from(dport) << 32 | u64::from(seq)).wrapping_mul(K);
    for word in [
        src as u64,
        (src >> 64) as u64,
        dst as u64,
        (dst >> 64) as u64,
    ] {
        h = (h ^ word).wrapping_mul(K);
        h ^= h >> 29;
    }
    (h >> 32) as u32 | 1
}

/// The [`SeenAttempts`] slot of a signature.
#[inline(always)]
pub fn seen_slot(signature: u32) -> usize {
    (signature >> 30) as usize % SEEN_ATTEMPTS
}

/// One slot of the `SYN_BUCKETS` array: the SYN rate's GCRA state of the source that last
/// claimed it. A source's slot is [`bucket_place`] of its key, so finding it is one array
/// access, and admitting a SYN writes nothing. A token is taken only when a handshake
/// completes (the client's ACK of the server's ISN proves the source), never by a SYN: a
/// sender forging a victim's address cannot spend the victim's allowance, and a SYN is
/// refused for its rate only while its source's proven handshakes have emptied the bucket. A source that finds another in its slot
/// takes the slot over with a fresh bucket, as if an LRU had evicted the other's: a flood of
/// many sources can hand the sources it collides with a fresh burst, never lock them out.
/// The bucket is full (idle) once its TAT is not after now.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SynBucket {
    /// The source whose bucket this is, for the top-blocked lists and retransmissions; all
    /// zero in a slot never claimed. Written after a claim, so readers may see it late.
    pub source: SourceKey,
    /// The theoretical arrival time, `CLOCK_MONOTONIC_COARSE` nanoseconds (the SYN rate's
    /// clock), with its low [`BUCKET_TAG_BITS`] bits replaced by the claiming source's tag
    /// ([`BucketPlace::tag`]). One word, so that telling whose bucket it is and taking a token
    /// are one compare-and-swap: two CPUs claiming a slot for one source at once cannot both
    /// start it full. The TAT is kept to 256 ns, rounded down: a source may get up to 255 ns
    /// of its rate more per SYN, a quarter more at a million SYNs a second, 0.03% at 1,000.
    pub tat_tag: u64,
    /// Connection attempts of this source refused for its SYN rate, for the top-blocked lists.
    /// Kept here rather than in `BLOCKED` so that a SYN refused for its rate, the one refusal
    /// a flood is made of, costs one array access: the bucket's, whose cache line it shares.
    pub refused: u64,
    /// The source's last SYNs refused for its rate.
    pub seen: SeenAttempts,
    /// Explicit padding, always zero: keeps `holders` and the bucket in one cache line.
    pub _pad: u64,
    /// Connections held, between them, by every source whose key maps to this slot: a SYN
    /// looks its source's count up in `SOURCE_CONNS` (a cold hash lookup) only when this is
    /// non-zero. Belongs to the slot, not to the source that last claimed it, so a takeover
    /// leaves it as it is.
    pub holders: u64,
}

const _: () = assert!(core::mem::size_of::<SynBucket>() == 64);

/// Bits of [`SynBucket::tat_tag`] that hold the claiming source's tag.
pub const BUCKET_TAG_BITS: u32 = 8;
/// The mask of those bits.
pub const BUCKET_TAG_MASK: u64 = (1 << BUCKET_TAG_BITS) - 1;

/// Where a source's SYN bucket lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketPlace {
    /// Its slot of `SYN_BUCKETS`.
    pub slot: u32,
    /// What marks the slot as this source's in [`SynBucket::tat_tag`]: other bits of the same
    /// hash, never 0, so a slot never claimed (all zero) is no source's. Sources sharing a
    /// slot and a tag (one pair in 255 of those sharing a slot) share one bucket.
    pub tag: u64,
}

/// The `SYN_BUCKETS` place of a source key in a profile: a hash keyed with the secret `seed`,
/// its high half masked to the array (`mask`: its size, a power of two, minus one) for the
/// slot, its low bits for the tag. Each of the key's two words is mixed in with a half of the
/// seed by a full avalanche (murmur3's finaliser), so every bit of the slot and of the tag
/// depends on every bit of the key: sources sharing a first octet or a /104 spread over all
/// slots and tags, and without the seed a sender learns which of its addresses share a bucket
/// only by probing about as many addresses as there are slots times tags. The profile slot
/// moves the seed (profile 0 keeps it), so a source's rate in one profile is a bucket apart
/// from its rate in another.
#[inline(always)]
pub fn bucket_place(key: &ProfileSource, seed: u64, mask: u32) -> BucketPlace {
    let seed = seed ^ u64::from(key.profile).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let addr = u128::from_ne_bytes(key.source.addr);
    let h = avalanche(seed ^ addr as u64);
    let h = avalanche(h ^ (addr >> 64) as u64 ^ seed.rotate_left(32));
    BucketPlace {
        slot: (h >> 32) as u32 & mask,
        tag: (h & BUCKET_TAG_MASK).max(1),
    }
}

/// murmur3's 64-bit finaliser: a bijection in which each output bit depends on every input
/// bit. Two multiplies and three shifts, cheap in the kernel.
#[inline(always)]
const fn avalanche(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x ^= x >> 33;
    x = x.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    x ^ (x >> 33)
}

/// A ban set by the agent; it stops applying by itself at `expires_ns` (`CLOCK_BOOTTIME`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ban {
    /// `CLOCK_BOOTTIME` nanoseconds at which the ban ends.
    pub expires_ns: u64,
}

const _: () = assert!(core::mem::size_of::<Ban>() == 8);

/// Key of the IPv4 allow / deny LPM tries' data part (the prefix length is aya's `Key`
/// wrapper), in network byte order as the trie compares bits from the first byte.
pub type Ipv4Bits = [u8; 4];
/// Key of the IPv6 allow / deny LPM tries' data part.
pub type Ipv6Bits = [u8; 16];

/// Per-source refused connection attempts, for the agent's top-blocked lists; one slot per
/// refusal reason, indexed by [`Reason::blocked_slot`]. The `syn_rate` slot stays zero: those
/// refusals are counted in the source's [`SynBucket`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Blocked {
    /// Refusals, per [`Reason::blocked_slot`].
    pub counts: [u64; Reason::REFUSAL_COUNT],
    /// The source's last SYNs refused for any reason counted here.
    pub seen: SeenAttempts,
}

const _: () =
    assert!(core::mem::size_of::<Blocked>() == 8 * Reason::REFUSAL_COUNT + 4 * SEEN_ATTEMPTS);

/// Input of the `limiter_release` and `limiter_adopt` programs, run by the agent through
/// `BPF_PROG_TEST_RUN`: the kernel side deletes a flow and releases its slots, or enters one
/// and takes them, with the same atomics the datapath uses, which a map update from userspace
/// could not do without racing it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowRequest {
    /// The flow to release or adopt.
    pub flow: FlowKey,
}

const _: () = assert!(core::mem::size_of::<FlowRequest>() == 40);

/// Input of the `limiter_adjust` program, run by the agent through `BPF_PROG_TEST_RUN` to
/// repair a counter that drifted from the flow table: the kernel adds `delta` atomically, so
/// the repair cannot lose a concurrent admission or release.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdjustRequest {
    /// The source whose counter drifted (ignored when `global` is set).
    pub source: SourceKey,
    /// Added to the counter (two's complement: negative lowers it). Zero, for a source:
    /// remove its entry if it holds zero, the sweeper's idle sources (a read from user space
    /// and a delete after it would race a handshake taking a slot in between).
    pub delta: i64,
    /// Non-zero: adjust the profile's global counter, not `source`'s.
    pub global: u8,
    /// The profile slot whose counter drifted.
    pub profile: u8,
    /// Explicit padding, always zero.
    pub _pad: [u8; 6],
}

const _: () = assert!(core::mem::size_of::<AdjustRequest>() == 32);

impl AdjustRequest {
    /// Adds `delta` to a source's count in its profile (0: remove its entry if it holds 0).
    pub fn source(counted: &ProfileSource, delta: i64) -> Self {
        Self {
            source: counted.source,
            delta,
            global: 0,
            profile: counted.profile as u8,
            _pad: [0; 6],
        }
    }

    /// Adds `delta` to a profile's global count.
    pub fn global(profile: u32, delta: i64) -> Self {
        Self {
            source: SourceKey { addr: [0; 16] },
            delta,
            global: 1,
            profile: profile as u8,
            _pad: [0; 6],
        }
    }
}

/// The Ethernet type XDP gives a SYN refused with `rst`, in place of its own (the innermost,
/// after any VLAN tags), for `limiter_tc_ingress` to answer (see [`Config::rst_xdp_tx`]): an
/// IEEE 802 local experimental type. A mark in the frame, not in XDP metadata, because some
/// kernels refuse `bpf_xdp_adjust_meta` to XDP programs, and because a frame marked so never
/// reaches the host's IP stack, which has no handler for the type, even where no TC program
/// answers it. XDP drops frames that arrive carrying it (as `malformed`), so no sender can
/// forge a mark.
pub const RST_MARK: u16 = 0x88B5;

/// The bit of a source's count in `SOURCE_CONNS` that marks its entry as being removed (the
/// count reached zero): readers take it for zero, and a new slot waits for a fresh entry.
pub const SOURCE_RETIRED: u64 = 1 << 63;

/// The `skb->mark` of the RST|ACKs `limiter_tc_ingress` redirects out of the interface, so
/// that the egress program, which they pass through, never takes the limiter's own answer
/// for the host's RST closing a tracked connection (a spoofed SYN on a victim's 4-tuple
/// would otherwise release the victim's flow).
pub const REPLY_MARK: u32 = 0x4C52_5250;

/// The Ethernet type that marks a SYN for `limiter_tc_ingress` to answer with a SYN cookie's
/// SYN-ACK, as [`RST_MARK`] marks one to answer with a RST (the other local experimental
/// type). XDP made the cookie and left it in the SYN's acknowledgment number, which a SYN
/// does not use.
pub const COOKIE_MARK: u16 = 0x88B6;

/// What the helper programs (`limiter_release`, `limiter_adjust`, `limiter_adopt`) return.
pub mod helper {
    /// Done by this call: the flow released, the counter adjusted, the flow adopted.
    pub const DONE: u32 = 2;
    /// Nothing to do: the flow to release was gone, the one to adopt was tracked already (or
    /// is not limiter's to count), or the table had no room.
    pub const ABSENT: u32 = 1;
    /// The request was malformed.
    pub const INVALID: u32 = 3;
    /// Adopted, and its slots took its source or the host past a cap.
    pub const OVER_CAP: u32 = 4;
}

#[cfg(feature = "user")]
mod pod {
    use super::*;

    /// `aya::Pod` for each of the map types, under the one argument that holds for them all.
    macro_rules! pod {
        ($($ty:ty),* $(,)?) => {$(
            // SAFETY: each type is `repr(C)`, `Copy`, has no padding the compiler adds
            // (padding is spelled out as fields) and is valid for any bit pattern.
            unsafe impl aya::Pod for $ty {}
        )*};
    }

    pod!(
        Config,
        Limits,
        Profile,
        ProfileSource,
        SourceKey,
        SourceLimits,
        FlowKey,
        Flow,
        HalfOpen,
        SynBucket,
        Ban,
        Blocked,
        FlowRequest,
        AdjustRequest,
        Offense,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sources sharing everything but a few bits: a /8's addresses (IPv4-mapped) or a /104's
    /// (IPv6 /128 keys), as an attacker inside a victim's network would pick them.
    fn keys(ipv6: bool) -> impl Iterator<Item = SourceKey> {
        (0..65_536u32).map(move |i| {
            let mut addr = if ipv6 {
                [0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
            } else {
                [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, 10, 0, 0, 0]
            };
            addr[13..16].copy_from_slice(&(i * 97).to_be_bytes()[1..]);
            SourceKey { addr }
        })
    }

    /// Pearson's chi-squared statistic of `counts` against a uniform spread.
    fn chi_squared(counts: &[u64]) -> f64 {
        let total: u64 = counts.iter().sum();
        let expected = total as f64 / counts.len() as f64;
        counts
            .iter()
            .map(|&n| (n as f64 - expected).powi(2) / expected)
            .sum()
    }

    #[test]
    fn slots_and_tags_spread_uniformly_over_one_network() {
        let seed = 0x0123_4567_89AB_CDEF;
        for ipv6 in [false, true] {
            let mut slots = [0u64; 256];
            let mut tags = [0u64; 256];
            for key in keys(ipv6) {
                let place = bucket_place(&ProfileSource::new(key, 0), seed, 255);
                slots[place.slot as usize] += 1;
                tags[place.tag as usize] += 1;
            }
            // 255 degrees of freedom: the 0.999 quantile is about 330. The old hash's tag
            // took one value for a whole /8.
            assert!(chi_squared(&slots) < 330.0, "slots, ipv6 {ipv6}");
            // Tag 0 is never used (it marks a slot never claimed) and 1 takes its share: the
            // other 254 values must be even.
            assert!(chi_squared(&tags[2..]) < 330.0, "tags, ipv6 {ipv6}");
        }
    }

    #[test]
    fn sharing_a_bucket_takes_about_slots_times_tags_probes() {
        // An attacker probing addresses of one /8 for one that shares the victim's slot and
        // tag (and so its bucket): about 256 * 255 probes for a 256-slot table.
        let seed = 0x5EED_0000_5EED_0001;
        let mut keys = keys(false);
        let victim = bucket_place(&ProfileSource::new(keys.next().unwrap(), 0), seed, 255);
        let sharing = keys
            .take(65_535)
            .filter(|key| bucket_place(&ProfileSource::new(*key, 0), seed, 255) == victim)
            .count();
        assert!(
            sharing <= 4,
            "{sharing} of 65,535 share the victim's bucket"
        );
    }

    #[test]
    fn a_source_has_a_bucket_of_its_own_in_each_profile() {
        let seed = 0x5EED_0000_5EED_0001;
        let same = keys(false)
            .filter(|key| {
                bucket_place(&ProfileSource::new(*key, 0), seed, 255)
                    == bucket_place(&ProfileSource::new(*key, 1), seed, 255)
            })
            .count();
        // One in 256 * 255 by chance: about one of 65,536.
        assert!(
            same <= 4,
            "{same} of 65,536 share their two profiles' bucket"
        );
    }
}

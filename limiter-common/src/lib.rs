//! Map keys and values shared by the kernel programs and the agent.
//!
//! Every type here crosses the kernel/user boundary byte for byte, so each is `#[repr(C)]`
//! with explicit padding fields: the agent must see exactly what the programs wrote, and the
//! verifier rejects reads of uninitialised stack bytes in map keys.
#![no_std]
#![deny(missing_docs)]
#![warn(missing_debug_implementations)]

pub mod stats;

pub use stats::{Direction, Event, Reason, Verdict};

/// Names of the maps, shared so that a rename breaks the build rather than the agent.
pub mod map_names {
    /// The one [`Config`](crate::Config), rewritten by the agent on every settings change.
    pub const CONFIG: &str = "CONFIG";
    /// One byte per local port, non-zero for a protected port (unless `all_ports` is set).
    pub const PORTS: &str = "PORTS";
    /// Admitted connections: [`FlowKey`](crate::FlowKey) to [`Flow`](crate::Flow).
    pub const FLOWS: &str = "FLOWS";
    /// Open connections per [`SourceKey`](crate::SourceKey), for the per-source cap.
    pub const SOURCE_CONNS: &str = "SOURCE_CONNS";
    /// Open connections to the host, for the total cap: a single counter.
    pub const GLOBAL_CONNS: &str = "GLOBAL_CONNS";
    /// The SYN rate's [`SynBucket`](crate::SynBucket) per source.
    pub const SYN_BUCKETS: &str = "SYN_BUCKETS";
    /// Banned sources and when each ban ends.
    pub const BANS: &str = "BANS";
    /// IPv4 prefixes that bypass every limit.
    pub const ALLOW_V4: &str = "ALLOW_V4";
    /// IPv6 prefixes that bypass every limit.
    pub const ALLOW_V6: &str = "ALLOW_V6";
    /// IPv4 prefixes whose SYNs are always refused.
    pub const DENY_V4: &str = "DENY_V4";
    /// IPv6 prefixes whose SYNs are always refused.
    pub const DENY_V6: &str = "DENY_V6";
    /// Per-CPU packet counters, indexed by [`stat_slot`](crate::stats::stat_slot).
    pub const STATS: &str = "STATS";
    /// Per-CPU flow event counters, indexed by [`Event`](crate::Event).
    pub const EVENTS: &str = "EVENTS";
    /// Refusals per source and reason ([`Blocked`](crate::Blocked)), for the top-blocked lists.
    pub const BLOCKED: &str = "BLOCKED";
}

/// How a refused SYN is answered.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Silently dropped: the client retries into a timeout. Right for floods.
    Drop = 0,
    /// Answered with RST|ACK from XDP: the client sees "connection refused" at once.
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
    /// Concurrent connections per source key; 0 = no limit.
    pub max_conn_per_ip: u32,
    /// Concurrent connections to the host; 0 = no limit.
    pub max_conn_total: u32,
    /// New connections (SYNs) per second per source key; 0 = no limit.
    pub syn_rate: u32,
    /// SYNs a source may send back to back before the rate applies.
    pub syn_burst: u32,
    /// Prefix length an IPv4 source is masked to before it becomes a key (32: per address).
    pub ipv4_prefix: u8,
    /// Prefix length an IPv6 source is masked to (e.g. 64, since one host often holds a /64).
    pub ipv6_prefix: u8,
    /// [`Refusal`] for the connection caps and a full flow table, as `u8` so that any byte
    /// the agent writes is valid.
    pub reject_conn: u8,
    /// [`Refusal`] for the SYN rate.
    pub reject_rate: u8,
    /// [`Refusal`] for banned sources.
    pub reject_ban: u8,
    /// [`Refusal`] for denylisted sources.
    pub reject_deny: u8,
    /// Non-zero: a new connection that finds the flow table full is refused, not let through.
    pub fail_closed: u8,
    /// Non-zero: every local port is protected and `PORTS` is not consulted.
    pub all_ports: u8,
    /// Non-zero when the allow / deny tries hold entries: lets the fast path skip empty tries.
    pub has_allow: u8,
    /// Non-zero when the deny tries hold entries.
    pub has_deny: u8,
    /// Explicit padding, always zero, so the layout has no bytes the compiler chose.
    pub _pad: [u8; 2],
}

impl Config {
    /// What the programs do before the agent writes a configuration: count, limit nothing.
    pub const UNCONFIGURED: Config = Config {
        max_conn_per_ip: 0,
        max_conn_total: 0,
        syn_rate: 0,
        syn_burst: 0,
        ipv4_prefix: 32,
        ipv6_prefix: 128,
        reject_conn: Refusal::Rst as u8,
        reject_rate: Refusal::Drop as u8,
        reject_ban: Refusal::Drop as u8,
        reject_deny: Refusal::Drop as u8,
        fail_closed: 0,
        all_ports: 1,
        has_allow: 0,
        has_deny: 0,
        _pad: [0; 2],
    };
}

/// A source address masked to its configured prefix. IPv4 addresses are stored IPv4-mapped
/// (`::ffff:a.b.c.d`) so that one set of maps serves both families.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SourceKey {
    /// The masked address, IPv6 byte order; bits beyond the prefix are zero.
    pub addr: [u8; 16],
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

/// Flow state bits, set with atomic OR so ingress and egress never lose each other's bit.
pub mod flow_state {
    /// The client acknowledged the SYN-ACK: no longer half-open.
    pub const ESTABLISHED: u32 = 1;
    /// A FIN came from the client.
    pub const FIN_IN: u32 = 2;
    /// A FIN went to the client.
    pub const FIN_OUT: u32 = 4;
    /// Both FINs seen: whoever sets the second bit deletes the flow.
    pub const FIN_BOTH: u32 = FIN_IN | FIN_OUT;
}

/// An admitted connection. It holds one slot of its source's count and one of the global count
/// from its SYN until whoever deletes it from `FLOWS` releases them.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flow {
    /// `CLOCK_BOOTTIME` nanoseconds of the admitted SYN.
    pub first_seen_ns: u64,
    /// `CLOCK_BOOTTIME` nanoseconds of the last packet either way (coarse: refreshed at most
    /// every [`LAST_SEEN_GRANULARITY_NS`], to spare the cache line).
    pub last_seen_ns: u64,
    /// The source key the slot was charged to, so release finds it even if the prefix changed.
    pub source: SourceKey,
    /// [`flow_state`] bits.
    pub state: u32,
    /// Explicit padding, always zero.
    pub _pad: u32,
}

/// How stale [`Flow::last_seen_ns`] may be. Writing it on every packet would bounce the
/// flow's cache line between cores; idle timeouts are many seconds, so a second is plenty.
pub const LAST_SEEN_GRANULARITY_NS: u64 = 1_000_000_000;

/// GCRA state of one source's SYN rate: the theoretical arrival time of the next SYN.
/// The bucket is full (idle) once `tat_ns <= now`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SynBucket {
    /// Theoretical arrival time, `CLOCK_BOOTTIME` nanoseconds.
    pub tat_ns: u64,
}

/// A ban set by the agent; it stops applying by itself at `expires_ns` (`CLOCK_BOOTTIME`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ban {
    /// `CLOCK_BOOTTIME` nanoseconds at which the ban ends.
    pub expires_ns: u64,
}

/// Key of the IPv4 allow / deny LPM tries' data part (the prefix length is aya's `Key`
/// wrapper), in network byte order as the trie compares bits from the first byte.
pub type Ipv4Bits = [u8; 4];
/// Key of the IPv6 allow / deny LPM tries' data part.
pub type Ipv6Bits = [u8; 16];

/// Per-source refusal counts, for the agent's top-blocked lists; one slot per refusal reason,
/// indexed by [`Reason::blocked_slot`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Blocked {
    /// Refused SYNs, per [`Reason::blocked_slot`].
    pub counts: [u64; Reason::REFUSAL_COUNT],
}

/// Input of the `limiter_release` program, run by the agent through `BPF_PROG_TEST_RUN`:
/// the kernel side deletes the flow and releases its slots with the same atomics the
/// datapath uses, which a map update from userspace could not do without racing it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReleaseRequest {
    /// The flow to delete and release.
    pub flow: FlowKey,
}

/// Input of the `limiter_adjust` program, run by the agent through `BPF_PROG_TEST_RUN` to
/// repair a counter that drifted from the flow table: the kernel adds `delta` atomically, so
/// the repair cannot lose a concurrent admission or release.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdjustRequest {
    /// The source whose counter drifted (ignored when `global` is set).
    pub source: SourceKey,
    /// Added to the counter (two's complement: negative lowers it).
    pub delta: i64,
    /// Non-zero: adjust the global counter, not `source`'s.
    pub global: u32,
    /// Explicit padding, always zero.
    pub _pad: u32,
}

/// What `limiter_release` returns.
pub mod release {
    /// The flow was in the table and this call removed it and released its slots.
    pub const RELEASED: u32 = 2;
    /// The flow was not there (already closed or released by someone else).
    pub const ABSENT: u32 = 1;
    /// The request was malformed.
    pub const INVALID: u32 = 3;
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: each type is `repr(C)`, `Copy`, has no padding the compiler adds (padding is
    // spelled out as fields) and is valid for any bit pattern.
    unsafe impl aya::Pod for Config {}
    unsafe impl aya::Pod for SourceKey {}
    unsafe impl aya::Pod for FlowKey {}
    unsafe impl aya::Pod for Flow {}
    unsafe impl aya::Pod for SynBucket {}
    unsafe impl aya::Pod for Ban {}
    unsafe impl aya::Pod for Blocked {}
    unsafe impl aya::Pod for ReleaseRequest {}
    unsafe impl aya::Pod for AdjustRequest {}
}

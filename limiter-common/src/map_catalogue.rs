//! The catalogue of the kernel programs' maps: the one place their names, kinds, key and value
//! types and default sizes are written down. The eBPF statics take their sizes from here, the
//! agent its names (through [`map_names`]) and its default table sizes.
//!
//! Kinds are chosen per map, and each entry says why: a plain hash where an eviction would
//! leak a slot or lift a limit, an LRU where losing an entry only loses history.

/// The BPF map type, as far as the catalogue needs to say it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapKind {
    /// `BPF_MAP_TYPE_ARRAY`: fixed slots, a lookup that cannot miss.
    Array,
    /// `BPF_MAP_TYPE_PERCPU_ARRAY`: counters each CPU bumps without atomics.
    PerCpuArray,
    /// `BPF_MAP_TYPE_HASH`: never evicts, so an entry that holds a slot or a limit stays.
    Hash,
    /// `BPF_MAP_TYPE_LRU_HASH`: evicts the oldest entry when full, for history only.
    LruHash,
    /// `BPF_MAP_TYPE_LPM_TRIE`: longest-prefix match, for the allow / deny prefixes.
    LpmTrie,
}

/// One map: `key` and `value` name the `limiter-common` types (documentation: the kernel and
/// the agent both use the types themselves).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapDef {
    /// The name in the kernel object, which the agent finds (and pins) the map by.
    pub name: &'static str,
    /// The map type, chosen for what losing an entry would cost.
    pub kind: MapKind,
    /// The key type's name.
    pub key: &'static str,
    /// The value type's name.
    pub value: &'static str,
    /// Entries when the agent sets no size of its own.
    pub default_entries: u32,
}

/// Size of the ban table.
const LIST_ENTRIES: u32 = 16_384;

/// Size of each allow / deny trie: room for an operator's list files (100,000 CIDRs that do not
/// merge) twice over. An LPM trie allocates per entry, so the room costs nothing until used.
const TRIE_ENTRIES: u32 = 1 << 18;

/// The live [`crate::Config`], one entry.
pub const CONFIG: MapDef = MapDef {
    name: "CONFIG",
    kind: MapKind::Array,
    key: "u32",
    value: "Config",
    default_entries: 1,
};

/// One byte per local port: 0 unprotected (or, with `all_ports`, the top level's), else the
/// port's profile slot plus one. The check is one array lookup.
pub const PORTS: MapDef = MapDef {
    name: "PORTS",
    kind: MapKind::Array,
    key: "u32",
    value: "u8",
    default_entries: 65_536,
};

/// Admitted (handshake-completed) connections. A plain hash: an LRU would silently evict live
/// flows and their slots would leak. When full, an insert fails and policy decides (fail-open
/// or fail-closed) in the open. Sized by the agent's flow-table setting.
pub const FLOWS: MapDef = MapDef {
    name: "FLOWS",
    kind: MapKind::Hash,
    key: "FlowKey",
    value: "Flow",
    default_entries: 131_072,
};

/// Connections between SYN and handshake-completing ACK. An LRU: its entries hold no slot, so
/// a flood that evicts them costs nothing but those handshakes' tracking, and it never fills.
pub const HALF_OPEN: MapDef = MapDef {
    name: "HALF_OPEN",
    kind: MapKind::LruHash,
    key: "FlowKey",
    value: "HalfOpen",
    default_entries: 65_536,
};

/// The ingress pre-filter for handshake-completing ACKs: per hash of (server ISN + 1), the
/// coarse time of the last SYN-ACK that carried such an ISN, and in one more slot at the end
/// the coarse time of the last SYN-ACK of all (see the kernel's `decide.rs`).
pub const ACK_HINTS: MapDef = MapDef {
    name: "ACK_HINTS",
    kind: MapKind::Array,
    key: "u32",
    value: "u32",
    default_entries: (1 << ACK_HINT_BITS) + 1,
};

/// `ACK_HINTS` has `2^ACK_HINT_BITS` hint slots.
pub const ACK_HINT_BITS: u32 = 16;

/// Admitted connections per source key and profile. A plain hash for the same reason as
/// `FLOWS`; entries are created only when a slot is taken, so a flood of sources that never
/// complete a handshake creates none. Sized like `FLOWS`.
pub const SOURCE_CONNS: MapDef = MapDef {
    name: "SOURCE_CONNS",
    kind: MapKind::Hash,
    key: "ProfileSource",
    value: "u64",
    default_entries: FLOWS.default_entries,
};

/// Admitted connections to the host, a slot per profile, changed only with atomics.
pub const GLOBAL_CONNS: MapDef = MapDef {
    name: "GLOBAL_CONNS",
    kind: MapKind::Array,
    key: "u32",
    value: "u64",
    default_entries: crate::PROFILE_SLOTS,
};

/// The connection rate's GCRA state, a slot per profile: the theoretical arrival time of the
/// next connection admitted from any source, one word moved by compare-and-swap.
pub const CONN_RATE: MapDef = MapDef {
    name: "CONN_RATE",
    kind: MapKind::Array,
    key: "u32",
    value: "u64",
    default_entries: crate::PROFILE_SLOTS,
};

/// The profiles' limits and names by slot (slot 0, the top level, lives in `CONFIG`). An
/// array: a port's profile is found with one more array read.
pub const PROFILES: MapDef = MapDef {
    name: "PROFILES",
    kind: MapKind::Array,
    key: "u32",
    value: "Profile",
    default_entries: crate::PROFILE_SLOTS,
};

/// SYN-rate GCRA state, one cache line per slot, a source's slot a keyed hash of its key
/// ([`crate::bucket_place`]). An array, direct-mapped: admitting a SYN must not cost a hash
/// insert, and a source that collides with another takes the slot over with a fresh bucket,
/// so a flood of sources never stops new ones from being metered nor locks them out. The
/// agent sizes it to the power of two at or above the flow table's size.
pub const SYN_BUCKETS: MapDef = MapDef {
    name: "SYN_BUCKETS",
    kind: MapKind::Array,
    key: "u32",
    value: "SynBucket",
    default_entries: FLOWS.default_entries.next_power_of_two(),
};

/// Bans by source key. A plain hash: an evicted ban would be lifted early.
pub const BANS: MapDef = MapDef {
    name: "BANS",
    kind: MapKind::Hash,
    key: "SourceKey",
    value: "Ban",
    default_entries: LIST_ENTRIES,
};

/// IPv4 prefixes that bypass every limit: an LPM trie, so one entry covers a network.
pub const ALLOW_V4: MapDef = MapDef {
    name: "ALLOW_V4",
    kind: MapKind::LpmTrie,
    key: "Key<Ipv4Bits>",
    value: "u8",
    default_entries: TRIE_ENTRIES,
};

/// IPv6 prefixes that bypass every limit.
pub const ALLOW_V6: MapDef = MapDef {
    name: "ALLOW_V6",
    kind: MapKind::LpmTrie,
    key: "Key<Ipv6Bits>",
    value: "u8",
    default_entries: TRIE_ENTRIES,
};

/// IPv4 prefixes whose packets to protected ports are always refused.
pub const DENY_V4: MapDef = MapDef {
    name: "DENY_V4",
    kind: MapKind::LpmTrie,
    key: "Key<Ipv4Bits>",
    value: "u8",
    default_entries: TRIE_ENTRIES,
};

/// IPv6 prefixes whose packets to protected ports are always refused.
pub const DENY_V6: MapDef = MapDef {
    name: "DENY_V6",
    kind: MapKind::LpmTrie,
    key: "Key<Ipv6Bits>",
    value: "u8",
    default_entries: TRIE_ENTRIES,
};

/// Room for the per-prefix overrides: an operator's exceptions (NAT gateways, known scanners),
/// tens to thousands, not a list file's worth.
const OVERRIDE_ENTRIES: u32 = 16_384;

/// IPv4 prefixes with per-source limits of their own (`[[overrides]]`): an LPM trie, so the
/// most specific prefix wins in one lookup, made only while it holds entries.
pub const OVERRIDES_V4: MapDef = MapDef {
    name: "OVERRIDES_V4",
    kind: MapKind::LpmTrie,
    key: "Key<Ipv4Bits>",
    value: "SourceLimits",
    default_entries: OVERRIDE_ENTRIES,
};

/// IPv6 prefixes with per-source limits of their own.
pub const OVERRIDES_V6: MapDef = MapDef {
    name: "OVERRIDES_V6",
    kind: MapKind::LpmTrie,
    key: "Key<Ipv6Bits>",
    value: "SourceLimits",
    default_entries: OVERRIDE_ENTRIES,
};

/// Packets by (direction, verdict, reason): per CPU, so counting is a plain add.
pub const STATS: MapDef = MapDef {
    name: "STATS",
    kind: MapKind::PerCpuArray,
    key: "u32",
    value: "u64",
    default_entries: crate::stats::STATS_SLOTS,
};

/// Flow events by [`crate::Event`], per CPU.
pub const EVENTS: MapDef = MapDef {
    name: "EVENTS",
    kind: MapKind::PerCpuArray,
    key: "u32",
    value: "u64",
    default_entries: crate::stats::Event::COUNT as u32,
};

/// Refused connection attempts per source key, for the top-blocked lists. An LRU: losing an
/// entry only shortens a list. Sized like `FLOWS`.
pub const BLOCKED: MapDef = MapDef {
    name: "BLOCKED",
    kind: MapKind::LruHash,
    key: "SourceKey",
    value: "Blocked",
    default_entries: FLOWS.default_entries,
};

/// Refused connection attempts (a refused SYN that is not a retransmission of one of its
/// source's last refused SYNs, see [`crate::SeenAttempts`], or a handshake refused at its
/// ACK) by profile and refusal reason, and the packets monitor mode would have refused, per
/// CPU ([`crate::profile::refusal_slot`]).
pub const REFUSED_CONNS: MapDef = MapDef {
    name: "REFUSED_CONNS",
    kind: MapKind::PerCpuArray,
    key: "u32",
    value: "u64",
    default_entries: crate::profile::REFUSAL_SLOTS,
};

/// Sources refused at their proven handshakes, for kernel escalation
/// ([`crate::Config::offense_gap_ns`]): their streaks, which the agent reads to ban. An LRU:
/// losing an entry only delays a ban. Sized like `FLOWS`.
pub const OFFENDERS: MapDef = MapDef {
    name: "OFFENDERS",
    kind: MapKind::LruHash,
    key: "SourceKey",
    value: "Offense",
    default_entries: FLOWS.default_entries,
};

/// Every map of the kernel object.
pub const ALL: [MapDef; 22] = [
    CONFIG,
    PORTS,
    PROFILES,
    FLOWS,
    HALF_OPEN,
    ACK_HINTS,
    SOURCE_CONNS,
    GLOBAL_CONNS,
    CONN_RATE,
    SYN_BUCKETS,
    BANS,
    ALLOW_V4,
    ALLOW_V6,
    DENY_V4,
    DENY_V6,
    OVERRIDES_V4,
    OVERRIDES_V6,
    STATS,
    EVENTS,
    BLOCKED,
    REFUSED_CONNS,
    OFFENDERS,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_distinct() {
        for (i, a) in ALL.iter().enumerate() {
            for b in &ALL[i + 1..] {
                assert_ne!(a.name, b.name);
            }
        }
    }
}

/// Names of the maps, from this catalogue, so that a rename breaks the build rather
/// than the agent.
pub mod map_names {
    /// The one [`Config`](crate::Config), rewritten by the agent on every settings change.
    pub const CONFIG: &str = super::CONFIG.name;
    /// One byte per local port: its profile slot plus one, 0 for none.
    pub const PORTS: &str = super::PORTS.name;
    /// The profiles' [`Profile`](crate::Profile)s, by slot.
    pub const PROFILES: &str = super::PROFILES.name;
    /// Admitted connections: [`FlowKey`](crate::FlowKey) to [`Flow`](crate::Flow).
    pub const FLOWS: &str = super::FLOWS.name;
    /// Connections awaiting their handshake's last ACK, which hold no slot until it comes.
    pub const HALF_OPEN: &str = super::HALF_OPEN.name;
    /// Recent SYN-ACK ISNs, so that only an ACK that may complete a handshake pays a lookup.
    pub const ACK_HINTS: &str = super::ACK_HINTS.name;
    /// Open connections per [`ProfileSource`](crate::ProfileSource), for the per-source cap.
    pub const SOURCE_CONNS: &str = super::SOURCE_CONNS.name;
    /// Open connections to the host, for the total cap: a counter per profile.
    pub const GLOBAL_CONNS: &str = super::GLOBAL_CONNS.name;
    /// The connection rate's GCRA words, per profile: the theoretical arrival time of the
    /// next connection.
    pub const CONN_RATE: &str = super::CONN_RATE.name;
    /// The SYN rate's [`SynBucket`](crate::SynBucket)s, a slot per keyed hash of a source.
    pub const SYN_BUCKETS: &str = super::SYN_BUCKETS.name;
    /// Banned sources and when each ban ends.
    pub const BANS: &str = super::BANS.name;
    /// IPv4 prefixes with limits of their own ([`SourceLimits`](crate::SourceLimits)).
    pub const OVERRIDES_V4: &str = super::OVERRIDES_V4.name;
    /// IPv6 prefixes with limits of their own.
    pub const OVERRIDES_V6: &str = super::OVERRIDES_V6.name;
    /// IPv4 prefixes that bypass every limit.
    pub const ALLOW_V4: &str = super::ALLOW_V4.name;
    /// IPv6 prefixes that bypass every limit.
    pub const ALLOW_V6: &str = super::ALLOW_V6.name;
    /// IPv4 prefixes whose packets to protected ports are always refused.
    pub const DENY_V4: &str = super::DENY_V4.name;
    /// IPv6 prefixes whose packets to protected ports are always refused.
    pub const DENY_V6: &str = super::DENY_V6.name;
    /// Per-CPU packet counters, indexed by [`stat_slot`](crate::stats::stat_slot).
    pub const STATS: &str = super::STATS.name;
    /// Per-CPU flow event counters, indexed by [`Event`](crate::Event).
    pub const EVENTS: &str = super::EVENTS.name;
    /// Refused connection attempts per source and reason ([`Blocked`](crate::Blocked)), for
    /// the top-blocked lists (those refused for their SYN rate count in their bucket).
    pub const BLOCKED: &str = super::BLOCKED.name;
    /// Per-CPU refused connection attempts by profile and refusal reason, and monitor
    /// mode's would-be refusals.
    pub const REFUSED_CONNS: &str = super::REFUSED_CONNS.name;
    /// Sources' streaks of refusals at their proven handshakes ([`Offense`](crate::Offense)).
    pub const OFFENDERS: &str = super::OFFENDERS.name;
}

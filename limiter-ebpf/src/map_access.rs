//! The programs' maps, and the small accessors every path uses.
//!
//! Names, kinds and default sizes come from `limiter_common::map_catalogue`, which says per map why it
//! has its type; the agent sets the real sizes of the sized ones before loading.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray},
};
use limiter_common::{
    Ban, Blocked, Config, Flow, FlowKey, HalfOpen, Ipv4Bits, Ipv6Bits, Limits, Offense, Profile,
    ProfileSource, SourceKey, SourceLimits, SynBucket, map_catalogue as catalogue,
};

#[map]
pub static CONFIG: Array<Config> = Array::with_max_entries(catalogue::CONFIG.default_entries, 0);

#[map]
pub static PORTS: Array<u8> = Array::with_max_entries(catalogue::PORTS.default_entries, 0);

#[map]
pub static PROFILES: Array<Profile> =
    Array::with_max_entries(catalogue::PROFILES.default_entries, 0);

#[map]
pub static FLOWS: HashMap<FlowKey, Flow> =
    HashMap::with_max_entries(catalogue::FLOWS.default_entries, 0);

#[map]
pub static HALF_OPEN: LruHashMap<FlowKey, HalfOpen> =
    LruHashMap::with_max_entries(catalogue::HALF_OPEN.default_entries, 0);

#[map]
pub static ACK_HINTS: Array<u32> = Array::with_max_entries(catalogue::ACK_HINTS.default_entries, 0);

/// Preallocated, so an insert fails only when the table is full (see `source_counts`).
#[map]
pub static SOURCE_CONNS: HashMap<ProfileSource, u64> =
    HashMap::with_max_entries(catalogue::SOURCE_CONNS.default_entries, 0);

#[map]
pub static GLOBAL_CONNS: Array<u64> =
    Array::with_max_entries(catalogue::GLOBAL_CONNS.default_entries, 0);

#[map]
pub static CONN_RATE: Array<u64> = Array::with_max_entries(catalogue::CONN_RATE.default_entries, 0);

/// Mappable only for the layout that buys: the values start page-aligned, so each 64-byte
/// bucket is one cache line, where a plain array's values start 16 bytes into a line and
/// every bucket straddled two, a second cold miss per new source's SYN.
#[map]
pub static SYN_BUCKETS: Array<SynBucket> = Array::with_max_entries(
    catalogue::SYN_BUCKETS.default_entries,
    aya_ebpf::bindings::BPF_F_MMAPABLE,
);

#[map]
pub static BANS: HashMap<SourceKey, Ban> =
    HashMap::with_max_entries(catalogue::BANS.default_entries, 0);

#[map]
pub static ALLOW_V4: LpmTrie<Ipv4Bits, u8> =
    LpmTrie::with_max_entries(catalogue::ALLOW_V4.default_entries, 0);
#[map]
pub static ALLOW_V6: LpmTrie<Ipv6Bits, u8> =
    LpmTrie::with_max_entries(catalogue::ALLOW_V6.default_entries, 0);
#[map]
pub static DENY_V4: LpmTrie<Ipv4Bits, u8> =
    LpmTrie::with_max_entries(catalogue::DENY_V4.default_entries, 0);
#[map]
pub static DENY_V6: LpmTrie<Ipv6Bits, u8> =
    LpmTrie::with_max_entries(catalogue::DENY_V6.default_entries, 0);

#[map]
pub static OVERRIDES_V4: LpmTrie<Ipv4Bits, SourceLimits> =
    LpmTrie::with_max_entries(catalogue::OVERRIDES_V4.default_entries, 0);
#[map]
pub static OVERRIDES_V6: LpmTrie<Ipv6Bits, SourceLimits> =
    LpmTrie::with_max_entries(catalogue::OVERRIDES_V6.default_entries, 0);

#[map]
pub static STATS: PerCpuArray<u64> =
    PerCpuArray::with_max_entries(catalogue::STATS.default_entries, 0);

#[map]
pub static EVENTS: PerCpuArray<u64> =
    PerCpuArray::with_max_entries(catalogue::EVENTS.default_entries, 0);

#[map]
pub static BLOCKED: LruHashMap<SourceKey, Blocked> =
    LruHashMap::with_max_entries(catalogue::BLOCKED.default_entries, 0);

#[map]
pub static OFFENDERS: LruHashMap<SourceKey, Offense> =
    LruHashMap::with_max_entries(catalogue::OFFENDERS.default_entries, 0);

#[map]
pub static REFUSED_CONNS: PerCpuArray<u64> =
    PerCpuArray::with_max_entries(catalogue::REFUSED_CONNS.default_entries, 0);

static UNCONFIGURED: Config = Config::UNCONFIGURED;

/// The live configuration, or the unconfigured default before the agent writes one. A
/// reference into the map: the programs read the few fields they need, not a copy of all.
#[inline(always)]
pub fn config() -> &'static Config {
    CONFIG.get(0).unwrap_or(&UNCONFIGURED)
}

static UNLIMITED: Limits = Limits::UNLIMITED;

/// The limits of profile slot `profile`: the top level's, in the config, for slot 0, else the
/// profile's (no limit for a slot no profile holds, whose last connections are closing).
#[inline(always)]
pub fn limits(config: &'static Config, profile: u32) -> &'static Limits {
    if profile == 0 {
        &config.limits
    } else {
        PROFILES.get(profile).map_or(&UNLIMITED, |p| &p.limits)
    }
}

/// Adds one to a per-CPU slot. No other CPU writes it, so a plain add is exact.
#[inline(always)]
pub fn bump(map: &PerCpuArray<u64>, slot: u32) {
    if let Some(counter) = map.get_ptr_mut(slot) {
        // SAFETY: the pointer comes from a successful lookup of this CPU's slot.
        unsafe { *counter += 1 };
    }
}

/// The hash maps [`get_or_insert`] works on: the plain and the LRU kind.
pub trait KeyedMap<K, V> {
    fn lookup(&self, key: &K) -> Option<*mut V>;
    /// Inserts `value` unless `key` is there already (`BPF_NOEXIST`).
    fn insert_new(&self, key: &K, value: &V);
}

/// The two kinds answer the same calls with the same flags.
macro_rules! keyed_map {
    ($($kind:ident),*) => {$(
        impl<K, V> KeyedMap<K, V> for $kind<K, V> {
            #[inline(always)]
            fn lookup(&self, key: &K) -> Option<*mut V> {
                self.get_ptr_mut(key)
            }

            #[inline(always)]
            fn insert_new(&self, key: &K, value: &V) {
                let _ = self.insert(key, value, aya_ebpf::bindings::BPF_NOEXIST.into());
            }
        }
    )*};
}

keyed_map!(HashMap, LruHashMap);

/// Looks a key up in a hash map, inserting `initial` first if it is absent. Two CPUs racing
/// to insert both end up with the same entry: the loser's `BPF_NOEXIST` insert fails and its
/// second lookup finds the winner's.
#[inline(always)]
pub fn get_or_insert<K, V>(map: &impl KeyedMap<K, V>, key: &K, initial: &V) -> Option<*mut V> {
    if let Some(ptr) = map.lookup(key) {
        return Some(ptr);
    }
    map.insert_new(key, initial);
    map.lookup(key)
}

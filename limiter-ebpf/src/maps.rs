//! The programs' maps, and the small accessors every path uses.
//!
//! Map types are chosen per map:
//! - `FLOWS` and `SOURCE_CONNS` are plain hashes: an LRU would silently evict live flows and
//!   their slots would leak. When `FLOWS` is full an insert fails, and policy decides (fail-open
//!   or fail-closed) in the open.
//! - `SYN_BUCKETS` and `BLOCKED` are LRU hashes: losing an idle bucket only hands its source a
//!   fresh burst, losing a statistic only shortens a top-blocked list, and neither may ever stop
//!   new sources from being tracked.
//!
//! Sizes here are defaults; the agent sets the real ones (`--flow-table-size`) before loading.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray},
};
use limiter_common::{
    Ban, Blocked, Config, Event, Flow, FlowKey, Ipv4Bits, Ipv6Bits, SourceKey, SynBucket,
    stats::STATS_SLOTS,
};

pub const DEFAULT_TABLE_SIZE: u32 = 65_536;
pub const LIST_SIZE: u32 = 16_384;

#[map]
pub static CONFIG: Array<Config> = Array::with_max_entries(1, 0);

/// One byte per local port: non-zero means protected. An array makes the check one lookup.
#[map]
pub static PORTS: Array<u8> = Array::with_max_entries(65_536, 0);

#[map]
pub static FLOWS: HashMap<FlowKey, Flow> = HashMap::with_max_entries(DEFAULT_TABLE_SIZE, 0);

/// Open connections per source key.
#[map]
pub static SOURCE_CONNS: HashMap<SourceKey, u64> = HashMap::with_max_entries(DEFAULT_TABLE_SIZE, 0);

/// Open connections to the host: one shared slot, changed only with atomics.
#[map]
pub static GLOBAL_CONNS: Array<u64> = Array::with_max_entries(1, 0);

#[map]
pub static SYN_BUCKETS: LruHashMap<SourceKey, SynBucket> =
    LruHashMap::with_max_entries(DEFAULT_TABLE_SIZE, 0);

#[map]
pub static BANS: HashMap<SourceKey, Ban> = HashMap::with_max_entries(LIST_SIZE, 0);

#[map]
pub static ALLOW_V4: LpmTrie<Ipv4Bits, u8> = LpmTrie::with_max_entries(LIST_SIZE, 0);
#[map]
pub static ALLOW_V6: LpmTrie<Ipv6Bits, u8> = LpmTrie::with_max_entries(LIST_SIZE, 0);
#[map]
pub static DENY_V4: LpmTrie<Ipv4Bits, u8> = LpmTrie::with_max_entries(LIST_SIZE, 0);
#[map]
pub static DENY_V6: LpmTrie<Ipv6Bits, u8> = LpmTrie::with_max_entries(LIST_SIZE, 0);

#[map]
pub static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(STATS_SLOTS, 0);

#[map]
pub static EVENTS: PerCpuArray<u64> = PerCpuArray::with_max_entries(Event::COUNT as u32, 0);

#[map]
pub static BLOCKED: LruHashMap<SourceKey, Blocked> =
    LruHashMap::with_max_entries(DEFAULT_TABLE_SIZE, 0);

/// The live configuration, or the unconfigured default before the agent writes one.
#[inline(always)]
pub fn config() -> Config {
    match CONFIG.get(0) {
        Some(config) => *config,
        None => Config::UNCONFIGURED,
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

/// Looks a key up in a hash map, inserting `initial` first if it is absent. Two CPUs racing
/// to insert both end up with the same entry: the loser's `BPF_NOEXIST` insert fails and its
/// second lookup finds the winner's.
#[inline(always)]
pub fn get_or_insert<K, V>(map: &HashMap<K, V>, key: &K, initial: &V) -> Option<*mut V> {
    if let Some(ptr) = map.get_ptr_mut(key) {
        return Some(ptr);
    }
    let _ = map.insert(key, initial, aya_ebpf::bindings::BPF_NOEXIST.into());
    map.get_ptr_mut(key)
}

/// [`get_or_insert`] for LRU maps.
#[inline(always)]
pub fn lru_get_or_insert<K, V>(map: &LruHashMap<K, V>, key: &K, initial: &V) -> Option<*mut V> {
    if let Some(ptr) = map.get_ptr_mut(key) {
        return Some(ptr);
    }
    let _ = map.insert(key, initial, aya_ebpf::bindings::BPF_NOEXIST.into());
    map.get_ptr_mut(key)
}

//! Typed access to the kernel programs' maps: writing settings, lists and bans, and reading
//! counters, flows and per-source state. Keys and values are `limiter-common`'s types.

use std::{
    net::{IpAddr, Ipv6Addr},
    time::Duration,
};

use aya::{
    Ebpf, Pod,
    maps::{Array, HashMap, IterableMap, LpmTrie, MapData, MapError, PerCpuArray, lpm_trie::Key},
};
use ipnet::IpNet;
use limiter_common::{
    Ban, Blocked, Config, Direction, Event, Flow, FlowKey, Reason, SourceKey, SynBucket, Verdict,
    map_names, stats::stat_slot,
};
use thiserror::Error;

use crate::config::{KernelSettings, mapped};

#[derive(Debug, Error)]
pub enum MapsError {
    #[error("map {0} is missing from the eBPF object")]
    Missing(&'static str),
    #[error("map {name}")]
    Map {
        name: &'static str,
        #[source]
        source: MapError,
    },
    #[error("reading the boot-time clock")]
    Clock(#[source] std::io::Error),
}

fn map_error(name: &'static str) -> impl FnOnce(MapError) -> MapsError {
    move |source| MapsError::Map { name, source }
}

fn walk_error(name: &'static str) -> impl FnOnce(std::io::Error) -> MapsError {
    move |io_error| MapsError::Map {
        name,
        source: MapError::SyscallError(aya::sys::SyscallError {
            call: "bpf_map_get_next_key",
            io_error,
        }),
    }
}

/// The maps, taken out of the loaded object so they can be shared apart from the programs.
pub struct Maps {
    config: Array<MapData, Config>,
    ports: Array<MapData, u8>,
    flows: HashMap<MapData, FlowKey, Flow>,
    source_conns: HashMap<MapData, SourceKey, u64>,
    global_conns: Array<MapData, u64>,
    syn_buckets: HashMap<MapData, SourceKey, SynBucket>,
    bans: HashMap<MapData, SourceKey, Ban>,
    allow_v4: LpmTrie<MapData, [u8; 4], u8>,
    allow_v6: LpmTrie<MapData, [u8; 16], u8>,
    deny_v4: LpmTrie<MapData, [u8; 4], u8>,
    deny_v6: LpmTrie<MapData, [u8; 16], u8>,
    stats: PerCpuArray<MapData, u64>,
    events: PerCpuArray<MapData, u64>,
    blocked: HashMap<MapData, SourceKey, Blocked>,
    /// The ports this handle last wrote: the port table is 64 Ki entries, so it is compared
    /// with the kernel's only when the wanted set changes, not on every list change.
    ports_written: Option<Vec<u16>>,
}

fn take<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, MapsError>
where
    T: TryFrom<aya::maps::Map, Error = MapError>,
{
    let map = ebpf.take_map(name).ok_or(MapsError::Missing(name))?;
    T::try_from(map).map_err(map_error(name))
}

/// Packets counted under one (direction, verdict, reason).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PacketCount {
    pub direction: Direction,
    pub verdict: Verdict,
    pub reason: Reason,
    pub packets: u64,
}

impl Maps {
    pub fn take(ebpf: &mut Ebpf) -> Result<Self, MapsError> {
        use map_names::*;
        Ok(Self {
            config: take(ebpf, CONFIG)?,
            ports: take(ebpf, PORTS)?,
            flows: take(ebpf, FLOWS)?,
            source_conns: take(ebpf, SOURCE_CONNS)?,
            global_conns: take(ebpf, GLOBAL_CONNS)?,
            syn_buckets: take(ebpf, SYN_BUCKETS)?,
            bans: take(ebpf, BANS)?,
            allow_v4: take(ebpf, ALLOW_V4)?,
            allow_v6: take(ebpf, ALLOW_V6)?,
            deny_v4: take(ebpf, DENY_V4)?,
            deny_v6: take(ebpf, DENY_V6)?,
            stats: take(ebpf, STATS)?,
            events: take(ebpf, EVENTS)?,
            blocked: take(ebpf, BLOCKED)?,
            ports_written: None,
        })
    }

    /// The maps another agent pinned under `pin_dir`: how the operator commands read and
    /// change enforcement when no agent runs.
    pub fn open_pinned(pin_dir: &std::path::Path) -> Result<Self, MapsError> {
        fn open<T>(pin_dir: &std::path::Path, name: &'static str) -> Result<T, MapsError>
        where
            T: TryFrom<aya::maps::Map, Error = MapError>,
        {
            let data = MapData::from_pin(crate::loader::pins::map(pin_dir, name))
                .map_err(map_error(name))?;
            let map = aya::maps::Map::from_map_data(data).map_err(map_error(name))?;
            T::try_from(map).map_err(map_error(name))
        }
        use map_names::*;
        Ok(Self {
            config: open(pin_dir, CONFIG)?,
            ports: open(pin_dir, PORTS)?,
            flows: open(pin_dir, FLOWS)?,
            source_conns: open(pin_dir, SOURCE_CONNS)?,
            global_conns: open(pin_dir, GLOBAL_CONNS)?,
            syn_buckets: open(pin_dir, SYN_BUCKETS)?,
            bans: open(pin_dir, BANS)?,
            allow_v4: open(pin_dir, ALLOW_V4)?,
            allow_v6: open(pin_dir, ALLOW_V6)?,
            deny_v4: open(pin_dir, DENY_V4)?,
            deny_v6: open(pin_dir, DENY_V6)?,
            stats: open(pin_dir, STATS)?,
            events: open(pin_dir, EVENTS)?,
            blocked: open(pin_dir, BLOCKED)?,
            ports_written: None,
        })
    }

    /// Applies settings to the live maps. Lists and ports go in before the config that tells
    /// the programs to consult them, so no packet sees a half-written policy.
    pub fn apply(&mut self, settings: &KernelSettings) -> Result<(), MapsError> {
        if self.ports_written.as_ref() != Some(&settings.ports) {
            self.write_ports(&settings.ports)?;
            self.ports_written = Some(settings.ports.clone());
        }
        sync_list(
            &mut self.allow_v4,
            &mut self.allow_v6,
            &settings.allow,
            "allow",
        )?;
        sync_list(&mut self.deny_v4, &mut self.deny_v6, &settings.deny, "deny")?;
        let mut config = settings.config;
        config.has_bans = self.bans.keys().next().is_some().into();
        self.config
            .set(0, config, 0)
            .map_err(map_error(map_names::CONFIG))
    }

    /// Makes the kernel's port table hold exactly `ports`, writing only what differs.
    fn write_ports(&mut self, ports: &[u16]) -> Result<(), MapsError> {
        let mut wanted = [0u8; 65_536];
        for port in ports {
            wanted[*port as usize] = 1;
        }
        for (port, want) in wanted.iter().enumerate() {
            let port = port as u32;
            if self
                .ports
                .get(&port, 0)
                .map_err(map_error(map_names::PORTS))?
                != *want
            {
                self.ports
                    .set(port, want, 0)
                    .map_err(map_error(map_names::PORTS))?;
            }
        }
        Ok(())
    }

    pub fn config(&self) -> Result<Config, MapsError> {
        self.config.get(&0, 0).map_err(map_error(map_names::CONFIG))
    }

    /// Bans `addr`'s source key (masked with the live prefix) for `ttl`.
    pub fn ban(&mut self, addr: IpAddr, ttl: Duration) -> Result<SourceKey, MapsError> {
        let key = source_key(addr, &self.config()?);
        let expires_ns =
            boot_time_ns()?.saturating_add(ttl.as_nanos().min(u64::MAX as u128) as u64);
        self.bans
            .insert(key, Ban { expires_ns }, 0)
            .map_err(map_error(map_names::BANS))?;
        // After the insert: the programs look bans up only once this is set.
        let mut config = self.config()?;
        if config.has_bans == 0 {
            config.has_bans = 1;
            self.config
                .set(0, config, 0)
                .map_err(map_error(map_names::CONFIG))?;
        }
        Ok(key)
    }

    /// Lifts the ban on `addr`'s source key; false if there was none.
    pub fn unban(&mut self, addr: IpAddr) -> Result<bool, MapsError> {
        let key = source_key(addr, &self.config()?);
        match self.bans.remove(&key) {
            Ok(()) => Ok(true),
            Err(MapError::KeyNotFound) => Ok(false),
            // aya's `remove` reports a missing key as the syscall's ENOENT.
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {
                Ok(false)
            }
            Err(error) => Err(map_error(map_names::BANS)(error)),
        }
    }

    /// Bans still in force, with the time each has left.
    pub fn bans(&self) -> Result<Vec<(SourceKey, Duration)>, MapsError> {
        let now = boot_time_ns()?;
        let mut out = Vec::new();
        for entry in self.bans.iter() {
            let (key, ban) = entry.map_err(map_error(map_names::BANS))?;
            if ban.expires_ns > now {
                out.push((key, Duration::from_nanos(ban.expires_ns - now)));
            }
        }
        Ok(out)
    }

    pub fn packet_counts(&self) -> Result<Vec<PacketCount>, MapsError> {
        let mut out = Vec::new();
        for direction in Direction::ALL {
            for verdict in Verdict::ALL {
                for reason in Reason::ALL {
                    let slot = stat_slot(direction, verdict, reason);
                    let packets = self
                        .stats
                        .get(&slot, 0)
                        .map_err(map_error(map_names::STATS))?
                        .iter()
                        .sum();
                    out.push(PacketCount {
                        direction,
                        verdict,
                        reason,
                        packets,
                    });
                }
            }
        }
        Ok(out)
    }

    /// Packets of one (direction, verdict, reason), summed over CPUs.
    pub fn packets(
        &self,
        direction: Direction,
        verdict: Verdict,
        reason: Reason,
    ) -> Result<u64, MapsError> {
        let slot = stat_slot(direction, verdict, reason);
        Ok(self
            .stats
            .get(&slot, 0)
            .map_err(map_error(map_names::STATS))?
            .iter()
            .sum())
    }

    pub fn events(&self, event: Event) -> Result<u64, MapsError> {
        Ok(self
            .events
            .get(&(event as u32), 0)
            .map_err(map_error(map_names::EVENTS))?
            .iter()
            .sum())
    }

    /// Open connections to the host, as the kernel counts them.
    pub fn global_connections(&self) -> Result<u64, MapsError> {
        self.global_conns
            .get(&0, 0)
            .map_err(map_error(map_names::GLOBAL_CONNS))
    }

    /// Open connections of one source (`addr` masked with the live prefix).
    pub fn source_connections(&self, addr: IpAddr) -> Result<u64, MapsError> {
        let key = source_key(addr, &self.config()?);
        match self.source_conns.get(&key, 0) {
            Ok(n) => Ok(n),
            Err(MapError::KeyNotFound) => Ok(0),
            Err(error) => Err(map_error(map_names::SOURCE_CONNS)(error)),
        }
    }

    /// Every source's open connections, including sources at zero not yet swept.
    pub fn all_source_connections(&self) -> Result<Vec<(SourceKey, u64)>, MapsError> {
        self.source_conns
            .iter()
            .map(|entry| entry.map_err(map_error(map_names::SOURCE_CONNS)))
            .collect()
    }

    pub fn flows(&self) -> Result<Vec<(FlowKey, Flow)>, MapsError> {
        self.flows
            .iter()
            .map(|entry| entry.map_err(map_error(map_names::FLOWS)))
            .collect()
    }

    /// Refusals per source, for top-blocked lists.
    pub fn blocked(&self) -> Result<Vec<(SourceKey, Blocked)>, MapsError> {
        self.blocked
            .iter()
            .map(|entry| entry.map_err(map_error(map_names::BLOCKED)))
            .collect()
    }
}

/// Makes a pair of LPM tries hold exactly `nets`: stale entries out, missing ones in.
fn sync_list(
    v4: &mut LpmTrie<MapData, [u8; 4], u8>,
    v6: &mut LpmTrie<MapData, [u8; 16], u8>,
    nets: &[IpNet],
    what: &'static str,
) -> Result<(), MapsError> {
    let name = if what == "allow" {
        map_names::ALLOW_V4
    } else {
        map_names::DENY_V4
    };
    let name6 = if what == "allow" {
        map_names::ALLOW_V6
    } else {
        map_names::DENY_V6
    };
    let want4: Vec<(u32, [u8; 4])> = nets
        .iter()
        .filter_map(|n| match n {
            IpNet::V4(n) => Some((n.prefix_len() as u32, n.network().octets())),
            IpNet::V6(_) => None,
        })
        .collect();
    let want6: Vec<(u32, [u8; 16])> = nets
        .iter()
        .filter_map(|n| match n {
            IpNet::V6(n) => Some((n.prefix_len() as u32, n.network().octets())),
            IpNet::V4(_) => None,
        })
        .collect();
    // Collect first: deleting while walking GET_NEXT_KEY restarts the walk.
    let have4: Vec<Key<[u8; 4]>> = v4
        .keys()
        .collect::<Result<_, _>>()
        .map_err(map_error(name))?;
    for key in have4 {
        if !want4.contains(&(key.prefix_len(), key.data())) {
            v4.remove(&key).map_err(map_error(name))?;
        }
    }
    for (len, data) in want4 {
        v4.insert(&Key::new(len, data), 1, 0)
            .map_err(map_error(name))?;
    }
    let have6: Vec<Key<[u8; 16]>> = v6
        .keys()
        .collect::<Result<_, _>>()
        .map_err(map_error(name6))?;
    for key in have6 {
        if !want6.contains(&(key.prefix_len(), key.data())) {
            v6.remove(&key).map_err(map_error(name6))?;
        }
    }
    for (len, data) in want6 {
        v6.insert(&Key::new(len, data), 1, 0)
            .map_err(map_error(name6))?;
    }
    Ok(())
}

/// The key the kernel charges `addr` to: mapped to IPv6 and masked to the live prefix, by the
/// kernel's own masking function.
pub fn source_key(addr: IpAddr, config: &Config) -> SourceKey {
    // `::ffff:a.b.c.d` is the IPv4 client it maps, and takes the IPv4 prefix.
    let v6 = mapped(addr.to_canonical());
    limiter_common::source_key(&v6.octets(), config.ipv4_prefix, config.ipv6_prefix)
}

/// A source key as an address, IPv4-mapped keys shown as plain IPv4.
pub fn key_address(key: &SourceKey) -> IpAddr {
    let v6 = Ipv6Addr::from(key.addr);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

/// `CLOCK_BOOTTIME` in nanoseconds, the clock the kernel programs stamp with.
pub fn boot_time_ns() -> Result<u64, MapsError> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer for the call's duration.
    if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) } != 0 {
        return Err(MapsError::Clock(std::io::Error::last_os_error()));
    }
    Ok(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_keys_mask_to_the_prefix() {
        let mut config = Config::UNCONFIGURED;
        config.ipv4_prefix = 24;
        config.ipv6_prefix = 64;
        let k = source_key("10.1.2.3".parse().unwrap(), &config);
        assert_eq!(key_address(&k).to_string(), "10.1.2.0");
        let k = source_key("::ffff:10.1.2.3".parse().unwrap(), &config);
        assert_eq!(key_address(&k).to_string(), "10.1.2.0");
        let k = source_key("2001:db8:1:2:3:4:5:6".parse().unwrap(), &config);
        assert_eq!(key_address(&k).to_string(), "2001:db8:1:2::");
        config.ipv6_prefix = 0;
        let k = source_key("2001:db8::1".parse().unwrap(), &config);
        assert_eq!(k.addr, [0; 16]);
    }
}

/// Up to `max` keys of `map` after `cursor` (from the start when `None`), and whether the walk
/// reached the end. The sweeper resumes from the last key it saw, so each pass does bounded
/// work however large the map; if that key was deleted meanwhile, the kernel restarts the walk
/// from the first key, which costs a re-read, never a missed entry.
fn keys_after<K: Pod>(
    map: &MapData,
    cursor: Option<K>,
    max: usize,
) -> Result<(Vec<K>, bool), std::io::Error> {
    let mut keys = Vec::with_capacity(max.min(4096));
    let mut at = cursor;
    while keys.len() < max {
        match next_key(map, at.as_ref())? {
            Some(key) => {
                keys.push(key);
                at = Some(key);
            }
            None => return Ok((keys, true)),
        }
    }
    Ok((keys, false))
}

/// `BPF_MAP_GET_NEXT_KEY`, which aya uses internally but does not expose with a start key.
fn next_key<K: Pod>(map: &MapData, key: Option<&K>) -> Result<Option<K>, std::io::Error> {
    use std::os::fd::{AsFd, AsRawFd};
    // The `bpf_attr` layout of the map element commands.
    #[repr(C)]
    struct Attr {
        map_fd: u32,
        _pad: u32,
        key: u64,
        next_key: u64,
        flags: u64,
    }
    const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
    let mut next = std::mem::MaybeUninit::<K>::uninit();
    let attr = Attr {
        map_fd: map.fd().as_fd().as_raw_fd() as u32,
        _pad: 0,
        key: key.map_or(0, |k| k as *const K as u64),
        next_key: next.as_mut_ptr() as u64,
        flags: 0,
    };
    // SAFETY: `attr` is a valid bpf_attr prefix for this command; the kernel writes one key of
    // the map's key size (that of `K`, checked when the typed map was made) into `next`.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_GET_NEXT_KEY,
            &attr as *const Attr,
            std::mem::size_of::<Attr>() as u32,
        )
    };
    if rc == 0 {
        // SAFETY: the call succeeded, so the kernel wrote the key.
        return Ok(Some(unsafe { next.assume_init() }));
    }
    let error = std::io::Error::last_os_error();
    if error.raw_os_error() == Some(libc::ENOENT) {
        Ok(None)
    } else {
        Err(error)
    }
}

/// Where each map's sweep walk stands between passes.
#[derive(Default)]
pub struct SweepCursor {
    flows: Option<FlowKey>,
    buckets: Option<SourceKey>,
    bans: Option<SourceKey>,
}

/// One batch of the flow table, read for the sweeper.
pub struct FlowBatch {
    pub flows: Vec<(FlowKey, Flow)>,
    /// The walk reached the end of the table: the next batch starts a new cycle.
    pub wrapped: bool,
}

impl Maps {
    pub fn flow_batch(&self, cursor: &mut SweepCursor, max: usize) -> Result<FlowBatch, MapsError> {
        let (keys, wrapped) = keys_after(self.flows.map(), cursor.flows, max)
            .map_err(walk_error(map_names::FLOWS))?;
        cursor.flows = if wrapped { None } else { keys.last().copied() };
        let mut flows = Vec::with_capacity(keys.len());
        for key in keys {
            match self.flows.get(&key, 0) {
                Ok(flow) => flows.push((key, flow)),
                Err(MapError::KeyNotFound) => {} // closed meanwhile
                Err(e) => return Err(map_error(map_names::FLOWS)(e)),
            }
        }
        Ok(FlowBatch { flows, wrapped })
    }

    /// Deletes SYN-rate buckets that are full again (idle) among the next `max`; returns how
    /// many. A bucket deleted as a SYN races it costs that source at most one token.
    pub fn sweep_buckets(
        &mut self,
        cursor: &mut SweepCursor,
        max: usize,
        now: u64,
    ) -> Result<u64, MapsError> {
        let (keys, wrapped) = keys_after(self.syn_buckets.map(), cursor.buckets, max)
            .map_err(walk_error(map_names::SYN_BUCKETS))?;
        cursor.buckets = if wrapped { None } else { keys.last().copied() };
        let mut removed = 0;
        for key in keys {
            if let Ok(bucket) = self.syn_buckets.get(&key, 0)
                && bucket.tat_ns <= now
                && self.syn_buckets.remove(&key).is_ok()
            {
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// Deletes expired bans among the next `max`; returns how many.
    pub fn sweep_bans(
        &mut self,
        cursor: &mut SweepCursor,
        max: usize,
        now: u64,
    ) -> Result<u64, MapsError> {
        let (keys, wrapped) =
            keys_after(self.bans.map(), cursor.bans, max).map_err(walk_error(map_names::BANS))?;
        cursor.bans = if wrapped { None } else { keys.last().copied() };
        let mut removed = 0;
        for key in keys {
            if let Ok(ban) = self.bans.get(&key, 0)
                && ban.expires_ns <= now
                && self.bans.remove(&key).is_ok()
            {
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// Deletes a source's counter entry if it still reads zero.
    pub fn remove_idle_source(&mut self, key: &SourceKey) -> Result<bool, MapsError> {
        match self.source_conns.get(key, 0) {
            Ok(0) => Ok(self.source_conns.remove(key).is_ok()),
            Ok(_) | Err(MapError::KeyNotFound) => Ok(false),
            Err(e) => Err(map_error(map_names::SOURCE_CONNS)(e)),
        }
    }

    /// Slots the flow table was created with (an adopted table keeps its original size).
    pub fn flow_capacity(&self) -> Result<u32, MapsError> {
        self.flows
            .map()
            .info()
            .map(|info| info.max_entries())
            .map_err(map_error(map_names::FLOWS))
    }

    /// Entries in the flow table, counted by walking keys only (half the syscalls of
    /// [`Maps::flows`], which a metrics scrape of a full table would feel).
    pub fn flow_count(&self) -> Result<usize, MapsError> {
        let mut n = 0;
        for key in self.flows.keys() {
            key.map_err(map_error(map_names::FLOWS))?;
            n += 1;
        }
        Ok(n)
    }
}

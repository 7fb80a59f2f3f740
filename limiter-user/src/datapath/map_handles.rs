//! Typed access to the kernel programs' maps: writing the policy, lists and bans, and reading
//! counters, flows and per-source state. Keys and values are `limiter-common`'s types.

use std::{net::IpAddr, path::Path, time::Duration};

use aya::{
    Ebpf,
    maps::{Array, HashMap, IterableMap, LpmTrie, MapData, MapError, PerCpuArray, lpm_trie::Key},
};
use ipnet::IpNet;
use limiter_common::{
    Ban, Blocked, Config, Direction, Event, Flow, FlowKey, HalfOpen, Limits, Offense,
    PROFILE_SLOTS, Profile, ProfileSource, Reason, SOURCE_RETIRED, SourceKey, SourceLimits,
    SynBucket, Verdict, map_names,
    profile::{PROFILE_NAME_BYTES, refusal_slot},
    stats::stat_slot,
    syn_cookies,
};
use thiserror::Error;

use super::{
    CookieMode, CookieTerms, Policy, TOP_LEVEL_PROFILE,
    kernel_keys::{boot_time_ns, bucket_seed, source_key},
    mmap_array::MmapArray,
    pins,
};

use crate::duration_units::duration_ns;

#[derive(Debug, Error)]
pub enum MapsError {
    #[error("map {0} is missing from the eBPF object")]
    Missing(&'static str),
    #[error("map {0} holds a prefix longer than its addresses")]
    BadPrefix(&'static str),
    #[error("map {name}")]
    Map {
        name: &'static str,
        #[source]
        source: MapError,
    },
    #[error("reading the boot-time clock")]
    Clock(#[source] std::io::Error),
    #[error("drawing the SYN buckets' hash seed from the kernel's random source")]
    Random(#[source] std::io::Error),
    #[error("map {name} holds at most {capacity} entries, not the {wanted} the lists need")]
    Full {
        name: &'static str,
        wanted: usize,
        capacity: u32,
    },
    #[error("mapping map {name} into memory")]
    Mapping {
        name: &'static str,
        #[source]
        source: nix::Error,
    },
    #[error("{wanted} profiles do not fit the {} slots of map PROFILES", PROFILE_SLOTS - 1)]
    TooManyProfiles { wanted: usize },
}

pub(super) fn map_error(name: &'static str) -> impl FnOnce(MapError) -> MapsError {
    move |source| MapsError::Map { name, source }
}

/// A map found by name (or the error of looking), on its way to its typed wrapper.
struct FoundMap {
    map: Result<aya::maps::Map, MapsError>,
    name: &'static str,
}

impl FoundMap {
    /// The map as its typed wrapper, an error naming the map if it is of another kind.
    fn typed<T: TryFrom<aya::maps::Map, Error = MapError>>(self) -> Result<T, MapsError> {
        T::try_from(self.map?).map_err(map_error(self.name))
    }
}

/// One family-split set of prefixes: its IPv4 and IPv6 LPM tries, which the programs consult
/// by family, each prefix with a value (`1` for the allow and deny lists, the limits for the
/// overrides).
pub(super) struct Trie<V: aya::Pod = u8> {
    v4: LpmTrie<MapData, [u8; 4], V>,
    v6: LpmTrie<MapData, [u8; 16], V>,
    names: (&'static str, &'static str),
}

impl Trie<u8> {
    /// Makes the tries hold exactly `nets`, as a list (value 1).
    fn sync_list(&mut self, nets: &[IpNet]) -> Result<(), MapsError> {
        let entries: Vec<(IpNet, u8)> = nets.iter().map(|net| (*net, 1)).collect();
        self.sync(&entries)
    }
}

impl<V: aya::Pod + PartialEq> Trie<V> {
    /// Every prefix the tries hold, with its value: IPv4 first.
    fn entries(&self) -> Result<Vec<(IpNet, V)>, MapsError> {
        let mut out = Vec::new();
        for entry in &self.v4 {
            let (key, value) = entry.map_err(map_error(self.names.0))?;
            let net = ipnet::Ipv4Net::new(key.data().into(), key.prefix_len() as u8)
                .map_err(|_| MapsError::BadPrefix(self.names.0))?;
            out.push((IpNet::V4(net), value));
        }
        for entry in &self.v6 {
            let (key, value) = entry.map_err(map_error(self.names.1))?;
            let net = ipnet::Ipv6Net::new(key.data().into(), key.prefix_len() as u8)
                .map_err(|_| MapsError::BadPrefix(self.names.1))?;
            out.push((IpNet::V6(net), value));
        }
        out.sort_by_key(|(net, _)| *net);
        Ok(out)
    }

    /// Makes the tries hold exactly `entries`: stale prefixes out, missing or changed ones in.
    /// A set larger than a trie is refused before either is touched, so what is enforced
    /// stays whole.
    fn sync(&mut self, entries: &[(IpNet, V)]) -> Result<(), MapsError> {
        let mut want4 = Vec::new();
        let mut want6 = Vec::new();
        for (net, value) in entries {
            match net {
                IpNet::V4(n) => {
                    want4.push(((u32::from(n.prefix_len()), n.network().octets()), *value));
                }
                IpNet::V6(n) => {
                    want6.push(((u32::from(n.prefix_len()), n.network().octets()), *value));
                }
            }
        }
        for (wanted, map, name) in [
            (want4.len(), self.v4.map(), self.names.0),
            (want6.len(), self.v6.map(), self.names.1),
        ] {
            let capacity = map.info().map_err(map_error(name))?.max_entries();
            if wanted > capacity as usize {
                return Err(MapsError::Full {
                    name,
                    wanted,
                    capacity,
                });
            }
        }
        sync_trie(&mut self.v4, want4, self.names.0)?;
        sync_trie(&mut self.v6, want6, self.names.1)
    }
}

fn sync_trie<const N: usize, V: aya::Pod + PartialEq>(
    trie: &mut LpmTrie<MapData, [u8; N], V>,
    want: Vec<((u32, [u8; N]), V)>,
    name: &'static str,
) -> Result<(), MapsError>
where
    [u8; N]: aya::Pod,
{
    // Collect first: deleting while walking GET_NEXT_KEY restarts the walk. Maps, so a list
    // of 100,000 entries is compared in linear time and only the difference is written.
    let have: std::collections::HashMap<(u32, [u8; N]), V> = trie
        .iter()
        .map(|entry| entry.map(|(k, v)| ((k.prefix_len(), k.data()), v)))
        .collect::<Result<_, _>>()
        .map_err(map_error(name))?;
    let want: std::collections::HashMap<(u32, [u8; N]), V> = want.into_iter().collect();
    for (len, data) in have.keys().filter(|key| !want.contains_key(key)) {
        trie.remove(&Key::new(*len, *data))
            .map_err(map_error(name))?;
    }
    for ((len, data), value) in want
        .iter()
        .filter(|(key, value)| have.get(key) != Some(value))
    {
        trie.insert(&Key::new(*len, *data), *value, 0)
            .map_err(map_error(name))?;
    }
    Ok(())
}

/// The maps, taken out of the loaded object (or opened from their pins) so they can be shared
/// apart from the programs.
pub struct Maps {
    config: Array<MapData, Config>,
    ports: Array<MapData, u8>,
    profiles: Array<MapData, Profile>,
    pub(super) flows: HashMap<MapData, FlowKey, Flow>,
    pub(super) half_open: HashMap<MapData, FlowKey, HalfOpen>,
    source_conns: HashMap<MapData, ProfileSource, u64>,
    global_conns: Array<MapData, u64>,
    conn_rate: Array<MapData, u64>,
    syn_buckets: Array<MapData, SynBucket>,
    pub(super) bans: HashMap<MapData, SourceKey, Ban>,
    allow: Trie,
    deny: Trie,
    overrides: Trie<SourceLimits>,
    stats: PerCpuArray<MapData, u64>,
    events: PerCpuArray<MapData, u64>,
    blocked: HashMap<MapData, SourceKey, Blocked>,
    refused_conns: PerCpuArray<MapData, u64>,
    offenders: HashMap<MapData, SourceKey, Offense>,
    /// The port bytes this handle last wrote (port, profile slot + 1): the port table is
    /// 64 Ki entries, so it is compared with the kernel's only when the wanted set changes,
    /// not on every list change.
    ports_written: Option<Vec<(u16, u8)>>,
    /// What a cookie's SYN-ACK may offer on this host (see `host_tcp`), once an interface
    /// is attached.
    cookie_terms: CookieTerms,
    /// The [`syn_cookies`] bits `syn-cookies = auto` has switched to.
    auto_cookies: u8,
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
    /// Takes the maps out of a freshly loaded object.
    pub fn take(ebpf: &mut Ebpf) -> Result<Self, MapsError> {
        Self::build(|name| ebpf.take_map(name).ok_or(MapsError::Missing(name)))
    }

    /// The maps another agent pinned under `pin_dir`: how the operator commands read and
    /// change enforcement when no agent runs.
    pub fn open_pinned(pin_dir: &Path) -> Result<Self, MapsError> {
        Self::build(|name| {
            let data = MapData::from_pin(pins::map(pin_dir, name)).map_err(map_error(name))?;
            aya::maps::Map::from_map_data(data).map_err(map_error(name))
        })
    }

    /// Every map, each found by name through `find`, typed once here.
    fn build(
        mut find: impl FnMut(&'static str) -> Result<aya::maps::Map, MapsError>,
    ) -> Result<Self, MapsError> {
        let mut found = |name: &'static str| FoundMap {
            map: find(name),
            name,
        };
        use map_names::*;
        Ok(Self {
            config: found(CONFIG).typed()?,
            ports: found(PORTS).typed()?,
            profiles: found(PROFILES).typed()?,
            flows: found(FLOWS).typed()?,
            half_open: found(HALF_OPEN).typed()?,
            source_conns: found(SOURCE_CONNS).typed()?,
            global_conns: found(GLOBAL_CONNS).typed()?,
            conn_rate: found(CONN_RATE).typed()?,
            syn_buckets: found(SYN_BUCKETS).typed()?,
            bans: found(BANS).typed()?,
            allow: Trie {
                v4: found(ALLOW_V4).typed()?,
                v6: found(ALLOW_V6).typed()?,
                names: (ALLOW_V4, ALLOW_V6),
            },
            deny: Trie {
                v4: found(DENY_V4).typed()?,
                v6: found(DENY_V6).typed()?,
                names: (DENY_V4, DENY_V6),
            },
            overrides: Trie {
                v4: found(OVERRIDES_V4).typed()?,
                v6: found(OVERRIDES_V6).typed()?,
                names: (OVERRIDES_V4, OVERRIDES_V6),
            },
            stats: found(STATS).typed()?,
            events: found(EVENTS).typed()?,
            blocked: found(BLOCKED).typed()?,
            refused_conns: found(REFUSED_CONNS).typed()?,
            offenders: found(OFFENDERS).typed()?,
            ports_written: None,
            cookie_terms: CookieTerms::default(),
            auto_cookies: 0,
        })
    }

    /// Applies a policy to the live maps. Profiles, lists and ports go in before the config
    /// that tells the programs to consult them, and a profile's slot is emptied only once no
    /// port points at it, so no packet sees a half-written policy.
    pub fn apply(&mut self, policy: &Policy) -> Result<(), MapsError> {
        let held = self.profile_slots()?;
        let slots = assign_slots(&held, policy)?;
        for (profile, slot) in policy.profiles.iter().zip(&slots) {
            let mut entry = Profile {
                limits: profile.limits,
                name: [0; PROFILE_NAME_BYTES],
            };
            let name = profile.name.as_bytes();
            entry.name[..name.len().min(PROFILE_NAME_BYTES)]
                .copy_from_slice(&name[..name.len().min(PROFILE_NAME_BYTES)]);
            self.profiles
                .set(*slot, entry, 0)
                .map_err(map_error(map_names::PROFILES))?;
        }
        let mut bytes: Vec<(u16, u8)> = policy.ports.iter().map(|port| (*port, 1)).collect();
        for (profile, slot) in policy.profiles.iter().zip(&slots) {
            bytes.extend(profile.ports.iter().map(|port| (*port, *slot as u8 + 1)));
        }
        if self.ports_written.as_ref() != Some(&bytes) {
            self.write_ports(&bytes)?;
            self.ports_written = Some(bytes);
        }
        self.allow.sync_list(&policy.allow)?;
        self.deny.sync_list(&policy.deny)?;
        let overrides: Vec<(IpNet, SourceLimits)> =
            policy.overrides.iter().map(|o| (o.net, o.limits)).collect();
        self.overrides.sync(&overrides)?;
        let mut config = policy.config();
        // The ban table's, not the policy's: bans come and go apart from settings.
        config.has_bans = self.bans.keys().next().is_some().into();
        // The bucket array's, which a pinned table keeps, and its seed with it.
        config.bucket_mask = self.syn_buckets.len().saturating_sub(1);
        config.bucket_seed = match self.config()?.bucket_seed {
            0 => bucket_seed()?,
            kept => kept,
        };
        config.syn_cookies = match policy.cookies {
            CookieMode::Off => 0,
            CookieMode::Auto { .. } => self.auto_cookies,
            CookieMode::Always => syn_cookies::ANSWER | syn_cookies::CHECK,
        };
        self.write_config(config)?;
        // Slots no profile holds any more: their last connections close with no limit, and
        // the slot is free for a new profile.
        for (slot, _, _) in held {
            if !slots.contains(&slot) {
                self.profiles
                    .set(slot, Profile::EMPTY, 0)
                    .map_err(map_error(map_names::PROFILES))?;
            }
        }
        Ok(())
    }

    /// The profiles the maps hold: (slot, name, limits) of each slot with a name.
    pub fn profile_slots(&self) -> Result<Vec<(u32, String, Limits)>, MapsError> {
        let mut out = Vec::new();
        for slot in 1..PROFILE_SLOTS {
            let profile = self
                .profiles
                .get(&slot, 0)
                .map_err(map_error(map_names::PROFILES))?;
            let len = profile
                .name
                .iter()
                .position(|b| *b == 0)
                .unwrap_or(PROFILE_NAME_BYTES);
            if len > 0 {
                let name = String::from_utf8_lossy(&profile.name[..len]).into_owned();
                out.push((slot, name, profile.limits));
            }
        }
        Ok(out)
    }

    /// Each profile slot's name where counts are named (metrics, status): the top level's
    /// [`TOP_LEVEL_PROFILE`] for slot 0, then every profile the maps hold.
    pub fn profile_labels(&self) -> Result<Vec<(u32, String)>, MapsError> {
        let mut out = vec![(0, TOP_LEVEL_PROFILE.to_owned())];
        out.extend(
            self.profile_slots()?
                .into_iter()
                .map(|(slot, name, _)| (slot, name)),
        );
        Ok(out)
    }

    /// Each protected port's profile slot, as the port table holds it (0, the top level's,
    /// for a port protected at the top level): as this handle wrote it, else read from the
    /// map (pinned maps, with no agent), a lookup per port.
    pub fn port_slots(&self) -> Result<Vec<(u16, u32)>, MapsError> {
        if let Some(written) = &self.ports_written {
            return Ok(written
                .iter()
                .map(|(port, byte)| (*port, u32::from(*byte) - 1))
                .collect());
        }
        let mut out = Vec::new();
        for port in 0..=u16::MAX {
            let byte = self
                .ports
                .get(&u32::from(port), 0)
                .map_err(map_error(map_names::PORTS))?;
            if byte != 0 {
                out.push((port, u32::from(byte) - 1));
            }
        }
        Ok(out)
    }

    /// Writes the config with the cookie terms this handle holds.
    fn write_config(&mut self, mut config: Config) -> Result<(), MapsError> {
        let terms = self.cookie_terms;
        config.cookie_mss_v4 = terms.mss_v4;
        config.cookie_mss_v6 = terms.mss_v6;
        config.cookie_wscale = terms.wscale;
        config.cookie_timestamps = terms.timestamps.into();
        self.config
            .set(0, config, 0)
            .map_err(map_error(map_names::CONFIG))
    }

    /// Sets what cookies may offer (an interface was attached) and writes it.
    pub fn set_cookie_terms(&mut self, terms: CookieTerms) -> Result<(), MapsError> {
        self.cookie_terms = terms;
        let config = self.config()?;
        self.write_config(config)
    }

    /// Switches `syn-cookies = auto`'s [`syn_cookies`] bits; the policy's mode decides whether
    /// they apply (the caller passes it, as the policy in force).
    pub fn set_auto_cookies(&mut self, bits: u8, policy: &Policy) -> Result<(), MapsError> {
        self.auto_cookies = bits;
        if let CookieMode::Auto { .. } = policy.cookies {
            let config = Config {
                syn_cookies: bits,
                ..self.config()?
            };
            self.write_config(config)?;
        }
        Ok(())
    }

    /// Makes the kernel's port table hold exactly `ports` (port, byte), writing only what
    /// differs.
    fn write_ports(&mut self, ports: &[(u16, u8)]) -> Result<(), MapsError> {
        let mut wanted = [0u8; 65_536];
        for (port, byte) in ports {
            wanted[*port as usize] = *byte;
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
        let expires_ns = boot_time_ns()?.saturating_add(duration_ns(ttl));
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
        for entry in &self.bans {
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

    /// Open connections to the host, as the kernel counts them, every profile's together.
    pub fn global_connections(&self) -> Result<u64, MapsError> {
        Ok(self.profile_connections()?.iter().sum())
    }

    /// Open connections per profile slot, as the kernel counts them.
    pub fn profile_connections(&self) -> Result<[u64; PROFILE_SLOTS as usize], MapsError> {
        let mut out = [0; PROFILE_SLOTS as usize];
        for (slot, count) in (0..).zip(out.iter_mut()) {
            *count = self
                .global_conns
                .get(&slot, 0)
                .map_err(map_error(map_names::GLOBAL_CONNS))?;
        }
        Ok(out)
    }

    /// A profile slot's connection rate: the theoretical arrival time of its next connection
    /// (rate clock ns; 0 before the first), as the programs left it.
    pub fn connection_rate_tat(&self, profile: u32) -> Result<u64, MapsError> {
        self.conn_rate
            .get(&profile, 0)
            .map_err(map_error(map_names::CONN_RATE))
    }

    /// The source prefixes with limits of their own, as the override tries hold them.
    pub fn overrides(&self) -> Result<Vec<(IpNet, SourceLimits)>, MapsError> {
        self.overrides.entries()
    }

    /// Open connections of one source (`addr` masked with the live prefix), in every profile.
    pub fn source_connections(&self, addr: IpAddr) -> Result<u64, MapsError> {
        let mut total = 0;
        for profile in 0..PROFILE_SLOTS {
            total += self.source_connections_in(addr, profile)?;
        }
        Ok(total)
    }

    /// Open connections of one source in one profile slot.
    pub fn source_connections_in(&self, addr: IpAddr, profile: u32) -> Result<u64, MapsError> {
        let key = ProfileSource::new(source_key(addr, &self.config()?), profile);
        match self.source_conns.get(&key, 0) {
            Ok(n) if n & SOURCE_RETIRED != 0 => Ok(0),
            Ok(n) => Ok(n),
            Err(MapError::KeyNotFound) => Ok(0),
            Err(error) => Err(map_error(map_names::SOURCE_CONNS)(error)),
        }
    }

    /// Every source's open connections, by profile slot (an entry the kernel is removing, at
    /// zero, is left out).
    pub fn all_source_connections(&self) -> Result<Vec<(ProfileSource, u64)>, MapsError> {
        self.source_conns
            .iter()
            .filter(|entry| {
                entry
                    .as_ref()
                    .map_or(true, |(_, n)| n & SOURCE_RETIRED == 0)
            })
            .map(|entry| entry.map_err(map_error(map_names::SOURCE_CONNS)))
            .collect()
    }

    /// Connections between their SYN and the handshake's last ACK.
    pub fn half_open(&self) -> Result<Vec<(FlowKey, HalfOpen)>, MapsError> {
        self.half_open
            .iter()
            .map(|entry| entry.map_err(map_error(map_names::HALF_OPEN)))
            .collect()
    }

    pub fn flows(&self) -> Result<Vec<(FlowKey, Flow)>, MapsError> {
        self.flows
            .iter()
            .map(|entry| entry.map_err(map_error(map_names::FLOWS)))
            .collect()
    }

    /// Refused connection attempts of one refusal reason, every profile's, summed over CPUs
    /// (0 for a reason that is not a refusal).
    pub fn refused_connections(&self, reason: Reason) -> Result<u64, MapsError> {
        let mut total = 0;
        for profile in 0..PROFILE_SLOTS {
            total += self.refusals_in(profile, false, reason)?;
        }
        Ok(total)
    }

    /// In one profile slot: refused connection attempts of one refusal reason, or with
    /// `would` the packets monitor mode let through that enforce mode would have refused for
    /// it, summed over CPUs.
    pub fn refusals_in(&self, profile: u32, would: bool, reason: Reason) -> Result<u64, MapsError> {
        let Some(slot) = refusal_slot(profile, would, reason) else {
            return Ok(0);
        };
        Ok(self
            .refused_conns
            .get(&slot, 0)
            .map_err(map_error(map_names::REFUSED_CONNS))?
            .iter()
            .sum())
    }

    /// Refused connection attempts per source and reason, for top-blocked lists: `BLOCKED`,
    /// and the SYN-rate refusals each source's bucket counts, in the `syn_rate` slot.
    pub fn blocked(&self) -> Result<Vec<(SourceKey, Blocked)>, MapsError> {
        let mut all = std::collections::BTreeMap::<SourceKey, Blocked>::new();
        for entry in &self.blocked {
            let (key, blocked) = entry.map_err(map_error(map_names::BLOCKED))?;
            all.insert(key, blocked);
        }
        if let Some(rate) = Reason::SynRate.blocked_slot() {
            for bucket in self.mmap_buckets()?.iter() {
                if bucket.refused > 0 {
                    all.entry(bucket.source).or_default().counts[rate] += bucket.refused;
                }
            }
        }
        Ok(all.into_iter().collect())
    }

    /// Every source's streak of refusals at its proven handshakes (kernel escalation).
    pub fn offenders(&self) -> Result<Vec<(SourceKey, Offense)>, MapsError> {
        self.offenders
            .iter()
            .map(|entry| entry.map_err(map_error(map_names::OFFENDERS)))
            .collect()
    }

    /// Forgets a source's streak (banned, or over); false if it had none.
    pub fn forget_offender(&mut self, source: &SourceKey) -> Result<bool, MapsError> {
        match self.offenders.remove(source) {
            Ok(()) => Ok(true),
            Err(MapError::KeyNotFound) => Ok(false),
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => {
                Ok(false)
            }
            Err(error) => Err(map_error(map_names::OFFENDERS)(error)),
        }
    }

    /// Every SYN bucket slot that a source claimed or whose sources hold connections, by slot:
    /// what the differential test holds against its model.
    pub fn syn_buckets(&self) -> Result<Vec<(u32, SynBucket)>, MapsError> {
        Ok((0..)
            .zip(self.mmap_buckets()?.iter())
            .filter(|(_, bucket)| bucket.tat_tag != 0 || bucket.holders != 0)
            .collect())
    }

    /// The SYN bucket array, mapped read-only: one pass over it costs no syscall per slot.
    fn mmap_buckets(&self) -> Result<MmapArray<SynBucket>, MapsError> {
        MmapArray::new(self.syn_buckets.map().fd(), self.syn_buckets.len()).map_err(|source| {
            MapsError::Mapping {
                name: map_names::SYN_BUCKETS,
                source,
            }
        })
    }

    /// Entries one source list's tries hold, IPv4 and IPv6 together.
    pub fn list_entries(&self, kind: crate::api::ListKind) -> Result<usize, MapsError> {
        let trie = match kind {
            crate::api::ListKind::Allow => &self.allow,
            crate::api::ListKind::Deny => &self.deny,
        };
        let mut n = 0;
        for key in trie.v4.keys() {
            key.map_err(map_error(trie.names.0))?;
            n += 1;
        }
        for key in trie.v6.keys() {
            key.map_err(map_error(trie.names.1))?;
            n += 1;
        }
        Ok(n)
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

/// The slot of each of `policy`'s profiles, in order: the slot the maps hold its name in
/// (`held`), so that its connections' counts stay where they are across reloads and restarts;
/// else the lowest slot held by no name, or failing that one whose profile is gone.
fn assign_slots(held: &[(u32, String, Limits)], policy: &Policy) -> Result<Vec<u32>, MapsError> {
    let kept = |name: &str| {
        held.iter()
            .find(|(_, n, _)| n == name)
            .map(|(slot, _, _)| *slot)
    };
    let mut taken: Vec<u32> = policy
        .profiles
        .iter()
        .filter_map(|p| kept(&p.name))
        .collect();
    let named: Vec<u32> = held.iter().map(|(slot, _, _)| *slot).collect();
    let mut out = Vec::with_capacity(policy.profiles.len());
    for profile in &policy.profiles {
        let slot = match kept(&profile.name) {
            Some(slot) => slot,
            None => {
                let free = |slot: &u32| !taken.contains(slot);
                let slot = (1..PROFILE_SLOTS)
                    .find(|slot| free(slot) && !named.contains(slot))
                    .or_else(|| (1..PROFILE_SLOTS).find(free))
                    .ok_or(MapsError::TooManyProfiles {
                        wanted: policy.profiles.len(),
                    })?;
                taken.push(slot);
                slot
            }
        };
        out.push(slot);
    }
    Ok(out)
}

//! Builds the API's JSON documents from the kernel maps and the broker limiter, for the HTTP
//! listener and, from pinned maps when no agent runs, for the operator commands.

use std::collections::BTreeMap;

use limiter_common::{Reason, Verdict as PacketVerdict};

use crate::{
    api::{
        ActionView, BanEntry, BlockedSource, BrokerRateLimits, Connections, EscalationView,
        KernelLimits, KernelRateLimits, ProfileLimits, ProfileView, SourceConnections, Status,
    },
    buckets::{Limiter, actions::Mode},
    datapath::{Enforcer, Maps, MapsError, kernel_keys::key_text},
    duration_units::duration_ms,
};

/// Where views read the kernel maps from: the running datapath (a short lock per read) or
/// pinned maps.
pub trait ReadMaps {
    fn read<T>(&self, f: impl FnOnce(&Maps) -> T) -> T;
}

impl ReadMaps for Enforcer {
    fn read<T>(&self, f: impl FnOnce(&Maps) -> T) -> T {
        self.with_maps(|m| f(m))
    }
}

impl ReadMaps for Maps {
    fn read<T>(&self, f: impl FnOnce(&Maps) -> T) -> T {
        f(self)
    }
}

/// Builds the status from the maps; `version` and `ready` are the agent's to add.
pub fn kernel_status(maps: &impl ReadMaps) -> Result<Status, MapsError> {
    let config = maps.read(Maps::config)?;
    let counts = maps.read(Maps::packet_counts)?;
    let mut refused = BTreeMap::new();
    let mut refused_packets = BTreeMap::new();
    for &reason in &Reason::ALL[..Reason::REFUSAL_COUNT] {
        let packets = counts
            .iter()
            .filter(|c| c.reason == reason && c.verdict != PacketVerdict::Pass)
            .map(|c| c.packets)
            .sum::<u64>();
        refused_packets.insert(reason.label().to_owned(), packets);
        let attempts = maps.read(|m| m.refused_connections(reason))?;
        refused.insert(reason.label().to_owned(), attempts);
    }
    let sources = maps.read(Maps::all_source_connections)?;
    Ok(Status {
        version: None,
        ready: None,
        connections: maps.read(Maps::global_connections)?,
        tracked_sources: sources.iter().filter(|(_, n)| *n > 0).count(),
        flow_table_entries: maps.read(Maps::flow_count)?,
        flow_table_capacity: maps.read(Maps::flow_capacity)?,
        bans_active: maps.read(Maps::bans)?.len(),
        refused,
        refused_packets,
        limits: KernelLimits::new(&config, &maps.read(Maps::overrides)?),
        profiles: profiles_view(maps)?,
        pinned: None,
        restart_required: None,
        fleet: None,
        syn_cookies: None,
    })
}

/// Every port profile with its limits and counts, `default` first; empty while the maps hold
/// no profile.
fn profiles_view(maps: &impl ReadMaps) -> Result<Vec<ProfileView>, MapsError> {
    let held = maps.read(Maps::profile_slots)?;
    if held.is_empty() {
        return Ok(Vec::new());
    }
    let config = maps.read(Maps::config)?;
    let connections = maps.read(Maps::profile_connections)?;
    let ports = maps.read(Maps::port_slots)?;
    let top = (
        0,
        crate::datapath::TOP_LEVEL_PROFILE.to_owned(),
        config.limits,
    );
    let mut out = Vec::with_capacity(held.len() + 1);
    for (slot, name, limits) in std::iter::once(top).chain(held) {
        let mut refused = BTreeMap::new();
        let mut would_refuse = BTreeMap::new();
        for &reason in &Reason::ALL[..Reason::REFUSAL_COUNT] {
            let label = reason.label().to_owned();
            refused.insert(
                label.clone(),
                maps.read(|m| m.refusals_in(slot, false, reason))?,
            );
            would_refuse.insert(label, maps.read(|m| m.refusals_in(slot, true, reason))?);
        }
        out.push(ProfileView {
            name,
            ports: ports
                .iter()
                .filter(|(_, s)| *s == slot)
                .map(|(port, _)| *port)
                .collect(),
            limits: ProfileLimits::new(&limits),
            connections: connections[slot as usize],
            refused,
            would_refuse,
        });
    }
    Ok(out)
}

/// `GET /connections`: open connections per source and profile, largest first.
pub fn connections_view(maps: &impl ReadMaps, limit: usize) -> Result<Connections, MapsError> {
    let global = maps.read(Maps::global_connections)?;
    let config = maps.read(Maps::config)?;
    let names = maps.read(Maps::profile_labels)?;
    let name = |slot: u32| {
        names
            .iter()
            .find(|(s, _)| *s == slot)
            .map_or_else(|| format!("slot-{slot}"), |(_, name)| name.clone())
    };
    let per_profile = maps.read(Maps::profile_connections)?;
    let profiles = (0..)
        .zip(per_profile)
        .filter(|(slot, n)| *slot == 0 || *n > 0 || names.iter().any(|(s, _)| s == slot))
        .map(|(slot, n)| (name(slot), n))
        .collect();
    let mut sources: Vec<_> = maps
        .read(Maps::all_source_connections)?
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .collect();
    let tracked_sources = sources.len();
    sources.sort_unstable_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Ok(Connections {
        connections: global,
        profiles,
        tracked_sources,
        sources: sources
            .into_iter()
            .take(limit)
            .map(|(key, connections)| SourceConnections {
                source: key_text(&key.source, &config),
                profile: name(key.profile),
                connections,
            })
            .collect(),
    })
}

/// The kernel part of `/rate_limits`, from the maps alone.
pub fn kernel_rate_limits(
    maps: &impl ReadMaps,
    limit: usize,
) -> Result<KernelRateLimits, MapsError> {
    let config = maps.read(Maps::config)?;
    let blocked = maps.read(Maps::blocked)?;
    let mut top_blocked = BTreeMap::new();
    for &reason in &Reason::ALL[..Reason::REFUSAL_COUNT] {
        let Some(slot) = reason.blocked_slot() else {
            continue;
        };
        let mut top: Vec<_> = blocked
            .iter()
            .filter(|(_, b)| b.counts[slot] > 0)
            .map(|(key, b)| (b.counts[slot], *key))
            .collect();
        top.sort_unstable_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        top_blocked.insert(
            reason.label().to_owned(),
            top.into_iter()
                .take(limit)
                .map(|(blocked, key)| BlockedSource {
                    source: key_text(&key, &config),
                    blocked,
                })
                .collect(),
        );
    }
    let mut bans = maps.read(Maps::bans)?;
    bans.sort_unstable_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Ok(KernelRateLimits {
        limits: KernelLimits::new(&config, &maps.read(Maps::overrides)?),
        ports: None,
        allow: None,
        deny: None,
        top_blocked,
        bans_active: bans.len(),
        bans: bans
            .into_iter()
            .take(limit)
            .map(|(key, left)| BanEntry {
                source: key_text(&key, &config),
                expires_in_ms: duration_ms(left),
            })
            .collect(),
    })
}

pub fn broker_rate_limits(limiter: &Limiter, limit: usize) -> BrokerRateLimits {
    let stats = limiter.stats();
    let actions = limiter
        .actions()
        .into_iter()
        .map(|spec| {
            let counts = stats
                .iter()
                .find(|s| s.action == spec.name)
                .map(|s| s.counts.clone())
                .unwrap_or_default();
            ActionView {
                name: spec.name.clone(),
                kind: spec.kind.as_str().to_owned(),
                mode: match spec.mode() {
                    Mode::Limited(_) | Mode::Quota(_) | Mode::Sessions(_) => "limited",
                    Mode::Unlimited => "unlimited",
                    Mode::Closed => "closed",
                }
                .to_owned(),
                limit: spec.limit,
                overrides: spec.overrides.len(),
                enforcement: spec.mode.unwrap_or(limiter.mode()).as_str().to_owned(),
                window_ms: duration_ms(spec.window),
                burst: spec.burst,
                key: spec.key.as_str().to_owned(),
                max_keys: spec.max_keys,
                escalate: spec.escalate,
                security: spec.security,
                counts,
                top_blocked: limiter.top_blocked(&spec.name, limit).unwrap_or_default(),
            }
        })
        .collect();
    let escalation = limiter.escalation_config().map(|config| {
        let stats = limiter.escalation_stats().unwrap_or_default();
        EscalationView {
            after: config.after,
            refused_for_ms: config.refused_for.map(duration_ms),
            window_ms: duration_ms(config.window),
            ban_ms: duration_ms(config.ban),
            ban_factor: config.increment.factor,
            max_ban_ms: duration_ms(config.increment.max_ban),
            memory_ms: duration_ms(config.increment.memory),
            tracked_addresses: stats.tracked_addresses,
            bans: stats.bans,
            ban_failures: stats.ban_failures,
            untracked: stats.untracked,
        }
    });
    BrokerRateLimits {
        actions,
        escalation,
    }
}

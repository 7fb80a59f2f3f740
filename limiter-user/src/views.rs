//! The JSON documents the agent serves (`/v1/status`, `/connections`, `/rate_limits`), built
//! from the kernel maps and the broker limiter. They are shared with the operator commands
//! (`ops`), which read exactly what the agent writes and build the same views from pinned maps
//! when no agent runs.

use std::{collections::BTreeMap, time::Duration};

use limiter_common::{Config, Reason, Refusal, Verdict as PacketVerdict};
use serde::{Deserialize, Serialize};

use crate::{
    agent::Agent,
    buckets::{BlockedKey, KeyKind, actions::Mode},
    maps::{Maps, MapsError, key_address},
};

/// Where views read the kernel maps from: the agent (a short lock per read) or pinned maps.
pub trait ReadMaps {
    fn read<T>(&self, f: impl FnOnce(&Maps) -> T) -> T;
}

impl ReadMaps for Agent {
    fn read<T>(&self, f: impl FnOnce(&Maps) -> T) -> T {
        self.with_maps(|m| f(m))
    }
}

impl ReadMaps for Maps {
    fn read<T>(&self, f: impl FnOnce(&Maps) -> T) -> T {
        f(self)
    }
}

/// `GET /v1/status`: the agent at a glance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// The agent's version; `None` when read from pinned maps with no agent running.
    pub version: Option<String>,
    /// Programs attached and maps answering; `None` when read from pinned maps.
    pub ready: Option<bool>,
    pub connections: u64,
    pub tracked_sources: usize,
    pub flow_table_entries: usize,
    pub flow_table_capacity: u32,
    pub bans_active: usize,
    /// Refused SYNs and packets by refusal reason, since the maps were created.
    pub refused: BTreeMap<String, u64>,
    pub limits: KernelLimits,
}

/// The kernel's limits as the programs read them (the `CONFIG` map).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelLimits {
    /// 0 = no limit (the same for the other limits).
    pub max_conn_per_ip: u32,
    pub max_conn_total: u32,
    pub syn_rate: u32,
    pub syn_burst: u32,
    pub ipv4_prefix: u8,
    pub ipv6_prefix: u8,
    pub fail_closed: bool,
    pub all_ports: bool,
    /// How each refusal is answered: `rst` or `drop`.
    pub reject_conn: String,
    pub reject_rate: String,
    pub reject_ban: String,
    pub reject_deny: String,
}

impl KernelLimits {
    pub fn from_config(config: &Config) -> Self {
        let refusal = |value: u8| match Refusal::from_u8(value) {
            Refusal::Rst => "rst".to_owned(),
            Refusal::Drop => "drop".to_owned(),
        };
        Self {
            max_conn_per_ip: config.max_conn_per_ip,
            max_conn_total: config.max_conn_total,
            syn_rate: config.syn_rate,
            syn_burst: config.syn_burst,
            ipv4_prefix: config.ipv4_prefix,
            ipv6_prefix: config.ipv6_prefix,
            fail_closed: config.fail_closed != 0,
            all_ports: config.all_ports != 0,
            reject_conn: refusal(config.reject_conn),
            reject_rate: refusal(config.reject_rate),
            reject_ban: refusal(config.reject_ban),
            reject_deny: refusal(config.reject_deny),
        }
    }

    /// Whether the kernel limits anything: a per-source cap, a global cap or a SYN rate.
    pub fn enabled(&self) -> bool {
        self.max_conn_per_ip != 0 || self.max_conn_total != 0 || self.syn_rate != 0
    }
}

/// Builds the status from the maps; `version` and `ready` are the agent's to add.
pub fn kernel_status(maps: &impl ReadMaps) -> Result<Status, MapsError> {
    let config = maps.read(|m| m.config())?;
    let counts = maps.read(|m| m.packet_counts())?;
    let mut refused = BTreeMap::new();
    for &reason in &Reason::ALL[..Reason::REFUSAL_COUNT] {
        let n = counts
            .iter()
            .filter(|c| c.reason == reason && c.verdict != PacketVerdict::Pass)
            .map(|c| c.packets)
            .sum::<u64>();
        refused.insert(reason.label().to_owned(), n);
    }
    let sources = maps.read(|m| m.all_source_connections())?;
    Ok(Status {
        version: None,
        ready: None,
        connections: maps.read(|m| m.global_connections())?,
        tracked_sources: sources.iter().filter(|(_, n)| *n > 0).count(),
        flow_table_entries: maps.read(|m| m.flow_count())?,
        flow_table_capacity: maps.read(|m| m.flow_capacity())?,
        bans_active: maps.read(|m| m.bans())?.len(),
        refused,
        limits: KernelLimits::from_config(&config),
    })
}

/// `GET /connections`: open connections per source, largest first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Connections {
    /// Open connections to the host (the global count).
    pub connections: u64,
    /// Sources holding at least one connection (the list below may be cut at `limit`).
    pub tracked_sources: usize,
    pub sources: Vec<SourceConnections>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceConnections {
    /// The source key: the address masked to its prefix (IPv4 shown as IPv4).
    pub source: String,
    pub connections: u64,
}

pub fn connections_view(maps: &impl ReadMaps, limit: usize) -> Result<Connections, MapsError> {
    let global = maps.read(|m| m.global_connections())?;
    let mut sources: Vec<_> = maps
        .read(|m| m.all_source_connections())?
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .collect();
    let tracked_sources = sources.len();
    sources.sort_unstable_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Ok(Connections {
        connections: global,
        tracked_sources,
        sources: sources
            .into_iter()
            .take(limit)
            .map(|(key, connections)| SourceConnections {
                source: key_address(&key).to_string(),
                connections,
            })
            .collect(),
    })
}

/// `GET /rate_limits`: what is limited, how, and who is refused most.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RateLimits {
    /// True when the kernel limits anything (a per-source cap, a global cap or a SYN rate).
    pub enabled: bool,
    pub kernel: KernelRateLimits,
    /// The broker's token buckets; `None` when read from pinned maps with no agent running.
    pub broker: Option<BrokerRateLimits>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelRateLimits {
    pub limits: KernelLimits,
    /// Protected ports; empty when every port is protected. `None` from pinned maps.
    pub ports: Option<Vec<u16>>,
    /// The allow and deny lists in force (configuration and admin API); `None` from pinned
    /// maps.
    pub allow: Option<Vec<String>>,
    pub deny: Option<Vec<String>>,
    /// The sources refused most, per refusal reason.
    pub top_blocked: BTreeMap<String, Vec<BlockedSource>>,
    pub bans_active: usize,
    /// Bans with the longest time left first, cut at `limit`.
    pub bans: Vec<BanEntry>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockedSource {
    pub source: String,
    pub blocked: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BanEntry {
    pub source: String,
    pub expires_in_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BrokerRateLimits {
    pub actions: Vec<ActionView>,
    /// Bans on repeated authentication failures; `None` when escalation is off.
    pub escalation: Option<EscalationView>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ActionView {
    pub name: String,
    /// `limited`, `unlimited` (limit 0 on an ordinary action) or `closed` (limit 0 on a
    /// security action: everything refused).
    pub mode: String,
    pub limit: u32,
    pub window_ms: u64,
    pub burst: u32,
    pub key: KeyKind,
    pub max_keys: usize,
    pub escalate: bool,
    pub security: bool,
    pub allowed: u64,
    pub unlimited: u64,
    pub limited: u64,
    pub cost_exceeds_burst: u64,
    pub closed: u64,
    pub blocked: u64,
    pub tracked_keys: usize,
    pub overflow_checks: u64,
    /// The keys refused most while their buckets were live (sessions as digests).
    pub top_blocked: Vec<BlockedKey>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EscalationView {
    /// Failures tolerated within the window; one more bans.
    pub after: u32,
    pub window_ms: u64,
    pub ban_ms: u64,
    pub tracked_addresses: usize,
    pub bans: u64,
    pub ban_failures: u64,
    pub untracked: u64,
}

pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The kernel part of `/rate_limits`, from the maps alone.
pub fn kernel_rate_limits(
    maps: &impl ReadMaps,
    limit: usize,
) -> Result<KernelRateLimits, MapsError> {
    let config = maps.read(|m| m.config())?;
    let blocked = maps.read(|m| m.blocked())?;
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
                    source: key_address(&key).to_string(),
                    blocked,
                })
                .collect(),
        );
    }
    let mut bans = maps.read(|m| m.bans())?;
    bans.sort_unstable_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Ok(KernelRateLimits {
        limits: KernelLimits::from_config(&config),
        ports: None,
        allow: None,
        deny: None,
        top_blocked,
        bans_active: bans.len(),
        bans: bans
            .into_iter()
            .take(limit)
            .map(|(key, left)| BanEntry {
                source: key_address(&key).to_string(),
                expires_in_ms: millis(left),
            })
            .collect(),
    })
}

pub fn broker_rate_limits(agent: &Agent, limit: usize) -> BrokerRateLimits {
    let limiter = &agent.limiter;
    let stats = limiter.stats();
    let actions = limiter
        .actions()
        .map(|spec| {
            let s = stats.iter().find(|s| s.action == spec.name);
            let count = |f: fn(&crate::buckets::ActionStats) -> u64| s.map_or(0, f);
            ActionView {
                name: spec.name.clone(),
                mode: match spec.mode() {
                    Mode::Limited(_) => "limited",
                    Mode::Unlimited => "unlimited",
                    Mode::Closed => "closed",
                }
                .to_owned(),
                limit: spec.limit,
                window_ms: millis(spec.window),
                burst: spec.burst,
                key: spec.key,
                max_keys: spec.max_keys,
                escalate: spec.escalate,
                security: spec.security,
                allowed: count(|s| s.allowed),
                unlimited: count(|s| s.unlimited),
                limited: count(|s| s.limited),
                cost_exceeds_burst: count(|s| s.cost_exceeds_burst),
                closed: count(|s| s.closed),
                blocked: count(|s| s.blocked),
                tracked_keys: s.map_or(0, |s| s.tracked_keys),
                overflow_checks: count(|s| s.overflow_checks),
                top_blocked: limiter.top_blocked(&spec.name, limit).unwrap_or_default(),
            }
        })
        .collect();
    let escalation = limiter.escalation_config().map(|config| {
        let stats = limiter.escalation_stats().unwrap_or_default();
        EscalationView {
            after: config.after,
            window_ms: millis(config.window),
            ban_ms: millis(config.ban),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_render_refusals_and_the_enabled_flag() {
        let limits = KernelLimits::from_config(&Config::UNCONFIGURED);
        assert!(!limits.enabled());
        assert_eq!(
            (limits.reject_conn.as_str(), limits.reject_rate.as_str()),
            ("rst", "drop")
        );
        let mut config = Config::UNCONFIGURED;
        config.syn_rate = 5;
        assert!(KernelLimits::from_config(&config).enabled());
    }
}

//! The JSON documents the agent serves (`/v1/status`, `/connections`, `/rate_limits`). The
//! operator commands read them from the agent, or build the same documents from pinned maps
//! when no agent runs.

use std::collections::BTreeMap;

use ipnet::IpNet;
use limiter_common::{Config, Limits, Refusal, SourceLimits};
use serde::{Deserialize, Serialize};

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
    /// Refused connection attempts by refusal reason, since the maps were created: a SYN
    /// retransmitted after its refusal counts once, a handshake refused at its ACK once.
    pub refused: BTreeMap<String, u64>,
    /// Refused packets by refusal reason (every retransmitted SYN, and packets other than
    /// SYNs from banned or denylisted sources), since the maps were created.
    #[serde(default)]
    pub refused_packets: BTreeMap<String, u64>,
    pub limits: KernelLimits,
    /// The port profiles (`[profiles.NAME]`), each with its limits and counts; `default`, the
    /// top level's ports, first. Empty without profiles.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub profiles: Vec<ProfileView>,
    /// Settings a flag or `LIMITER_*` variable sets, which the file cannot change; `None`
    /// when read from pinned maps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned: Option<Vec<String>>,
    /// Settings the file changed since the start that apply only on a restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_required: Option<Vec<String>>,
    /// The fleet's shared buckets; `None` without a fleet (or from pinned maps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fleet: Option<FleetStatus>,
    /// SYN cookies; `None` from pinned maps (whether they are on is in `limits`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub syn_cookies: Option<SynCookiesStatus>,
}

/// SYN cookies as the agent runs them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SynCookiesStatus {
    /// `off`, `auto` or `always`.
    pub mode: String,
    /// Whether the programs answer unproven sources' SYNs with cookies now.
    pub active: bool,
    /// With `auto`: the SYNs a second that turn them on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threshold: Option<u32>,
    pub switched_on: u64,
    pub switched_off: u64,
}

/// Fleet mode at a glance: where the shared buckets are and whether they answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetStatus {
    /// The Redis, without credentials.
    pub redis: String,
    /// Shared checks go to Redis (true) or are decided locally at limit / expected replicas.
    pub redis_up: bool,
    pub expected_replicas: u32,
    /// Shared checks decided locally because Redis failed, was too slow, or was down.
    pub fallback_checks: u64,
    /// Switches from Redis to local decisions, and back.
    pub switches_to_local: u64,
    pub switches_to_redis: u64,
}

/// The kernel's limits as the programs read them (the `CONFIG` map).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelLimits {
    /// The top level's caps, rates and refusals: those of every protected port no profile
    /// names.
    #[serde(flatten)]
    pub top: ProfileLimits,
    pub ipv4_prefix: u8,
    pub ipv6_prefix: u8,
    pub fail_closed: bool,
    pub all_ports: bool,
    /// How a banned or denylisted source's SYN is answered: `rst` or `drop`.
    pub reject_ban: String,
    pub reject_deny: String,
    /// Whether unproven sources' SYNs are answered with cookies now.
    #[serde(default)]
    pub syn_cookies: bool,
    /// Source prefixes held to limits of their own (`[[overrides]]`), as the tries hold them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overrides: Vec<OverrideView>,
}

/// One port profile in `/v1/status`: its ports, what they are held to, and its counts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProfileView {
    pub name: String,
    /// Its ports; for `default`, the top level's (empty: every port no profile names).
    pub ports: Vec<u16>,
    #[serde(flatten)]
    pub limits: ProfileLimits,
    /// Open connections to its ports.
    pub connections: u64,
    /// Refused connection attempts by refusal reason.
    pub refused: BTreeMap<String, u64>,
    /// Packets monitor mode let through that enforce mode would have refused, by reason.
    pub would_refuse: BTreeMap<String, u64>,
}

/// The limits a group of ports is held to (0 = no limit).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProfileLimits {
    pub max_conn_per_ip: u32,
    pub max_conn_total: u32,
    pub syn_rate: u32,
    pub syn_burst: u32,
    /// New connections a second from all sources together.
    #[serde(default)]
    pub conn_rate: u32,
    #[serde(default)]
    pub conn_burst: u32,
    /// How a SYN over a cap, or over a rate, is answered: `rst` or `drop`.
    pub reject_conn: String,
    pub reject_rate: String,
    /// `enforce`, or `monitor`: the limits are judged and counted, and refuse nothing.
    #[serde(default = "enforce")]
    pub mode: String,
}

impl ProfileLimits {
    pub fn new(limits: &Limits) -> Self {
        Self {
            max_conn_per_ip: limits.max_conn_per_ip,
            max_conn_total: limits.max_conn_total,
            syn_rate: limits.syn_rate,
            syn_burst: limits.syn_burst,
            conn_rate: limits.conn_rate,
            conn_burst: limits.conn_burst,
            reject_conn: refusal_text(limits.reject_conn),
            reject_rate: refusal_text(limits.reject_rate),
            mode: if limits.monitor != 0 {
                "monitor"
            } else {
                "enforce"
            }
            .to_owned(),
        }
    }

    /// Whether these limits limit anything: a cap or a rate.
    pub fn enabled(&self) -> bool {
        self.max_conn_per_ip != 0
            || self.max_conn_total != 0
            || self.syn_rate != 0
            || self.conn_rate != 0
    }
}

fn refusal_text(value: u8) -> String {
    match Refusal::from_u8(value) {
        Refusal::Rst => "rst".to_owned(),
        Refusal::Drop => "drop".to_owned(),
    }
}

/// What an agent too old to say its mode runs.
fn enforce() -> String {
    "enforce".to_owned()
}

/// One override: its prefix and the per-source limits its sources get; a limit it leaves out
/// (`null`) is their port profile's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OverrideView {
    pub cidr: String,
    pub max_conn_per_ip: Option<u32>,
    pub syn_rate: Option<u32>,
    pub syn_burst: Option<u32>,
}

impl KernelLimits {
    /// The limits of `config` and the `overrides` the tries hold.
    pub fn new(config: &Config, overrides: &[(IpNet, SourceLimits)]) -> Self {
        Self {
            top: ProfileLimits::new(&config.limits),
            ipv4_prefix: config.ipv4_prefix,
            ipv6_prefix: config.ipv6_prefix,
            fail_closed: config.fail_closed != 0,
            all_ports: config.all_ports != 0,
            reject_ban: refusal_text(config.reject_ban),
            reject_deny: refusal_text(config.reject_deny),
            syn_cookies: config.syn_cookies & limiter_common::syn_cookies::ANSWER != 0,
            overrides: overrides
                .iter()
                .map(|(net, limits)| OverrideView {
                    cidr: net.to_string(),
                    max_conn_per_ip: SourceLimits::own(limits.max_conn_per_ip),
                    syn_rate: SourceLimits::own(limits.syn_rate),
                    syn_burst: SourceLimits::own(limits.syn_burst),
                })
                .collect(),
        }
    }

    /// Whether the kernel limits anything at the top level: a cap or a rate.
    pub fn enabled(&self) -> bool {
        self.top.enabled()
    }
}

/// `GET /connections`: open connections per source and port profile, largest first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Connections {
    /// Open connections to the host (the global counts, every profile's).
    pub connections: u64,
    /// Open connections per port profile (`default`: the top level's ports).
    #[serde(default)]
    pub profiles: BTreeMap<String, u64>,
    /// Sources holding at least one connection in a profile, each profile's counted apart
    /// (the list below may be cut at `limit`).
    pub tracked_sources: usize,
    pub sources: Vec<SourceConnections>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceConnections {
    /// The source key: the address masked to its prefix (IPv4 shown as IPv4).
    pub source: String,
    /// The port profile the connections are counted in.
    #[serde(default = "top_level_profile")]
    pub profile: String,
    pub connections: u64,
}

/// What an agent from before the profiles counted every connection in.
fn top_level_profile() -> String {
    crate::datapath::TOP_LEVEL_PROFILE.to_owned()
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
    /// `rate` (a GCRA bucket) or `quota` (a fixed allowance per period, `window_ms`).
    pub kind: String,
    /// `limited`, `unlimited` (limit 0 on an ordinary action) or `closed` (limit 0 on a
    /// security action: everything refused).
    pub mode: String,
    pub limit: u32,
    /// Keys with a limit of their own (their names are not shown: a session key is a secret).
    #[serde(default)]
    pub overrides: usize,
    /// `enforce`, or `monitor` (refusals counted as `would_refuse` and answered as
    /// allowances).
    #[serde(default)]
    pub enforcement: String,
    /// A rate's window, or a quota's period.
    pub window_ms: u64,
    /// A rate's bucket capacity; for a quota, its limit.
    pub burst: u32,
    /// What the keys identify: `ip`, `session`, `user`, `other` or `connection`.
    pub key: String,
    pub max_keys: usize,
    pub escalate: bool,
    pub security: bool,
    #[serde(flatten)]
    pub counts: ActionCounts,
    /// The keys refused most while their buckets were live (sessions as digests).
    pub top_blocked: Vec<BlockedKey>,
}

/// An action's checks by outcome and its keys, as the broker limiter counts them: one
/// definition for the limiter's snapshot, the JSON views and the metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActionCounts {
    pub allowed: u64,
    pub unlimited: u64,
    pub limited: u64,
    pub cost_exceeds_burst: u64,
    pub cost_exceeds_limit: u64,
    pub closed: u64,
    /// Checks of connections their strikes closed (the one that closed it included).
    #[serde(default)]
    pub disconnect: u64,
    #[serde(default)]
    pub payload_too_large: u64,
    /// Every refusal: limited + cost_exceeds_burst + cost_exceeds_limit + closed + disconnect
    /// + payload_too_large.
    pub blocked: u64,
    pub tracked_keys: usize,
    /// Checks for new keys made while the action was at its key cap with every bucket still
    /// spending (the degraded mode): answered as a fresh bucket, untracked.
    pub overflow_checks: u64,
    /// Refusals monitor mode answered as allowances (counted in `blocked` too, as judged).
    #[serde(default)]
    pub would_refuse: u64,
    /// Connections with strikes on record (within their window, or closed by them).
    #[serde(default)]
    pub struck_connections: usize,
    /// Keys holding at least one session (a concurrency action).
    #[serde(default)]
    pub session_keys: usize,
    /// Sessions held through this agent now (a concurrency action; in a fleet, its brokers'
    /// share of the fleet's).
    #[serde(default)]
    pub sessions_held: u64,
    /// Connections closed by their strikes (each counted once, when it reached the threshold).
    #[serde(default)]
    pub strike_disconnects: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EscalationView {
    /// Failures tolerated within the window; one more bans. `None`: failures never ban.
    pub after: Option<u32>,
    /// Kernel escalation: how long a source's connection attempts are refused at their
    /// proven handshakes before it is banned. `None`: off.
    #[serde(default)]
    pub refused_for_ms: Option<u64>,
    pub window_ms: u64,
    /// The first ban's length.
    pub ban_ms: u64,
    /// Each repeat ban within `memory_ms` of the last one's end lasts this many times longer,
    /// up to `max_ban_ms`; 1: every ban lasts `ban_ms`.
    pub ban_factor: u32,
    pub max_ban_ms: u64,
    pub memory_ms: u64,
    pub tracked_addresses: usize,
    pub bans: u64,
    pub ban_failures: u64,
    pub untracked: u64,
}

/// One of the most-blocked keys of an action, shown as an operator may see it (a session is
/// a digest, never the token).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockedKey {
    pub key: String,
    pub blocked: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_render_refusals_and_the_enabled_flag() {
        let limits = KernelLimits::new(&Config::UNCONFIGURED, &[]);
        assert!(!limits.enabled());
        assert_eq!(
            (
                limits.top.reject_conn.as_str(),
                limits.top.reject_rate.as_str()
            ),
            ("rst", "drop")
        );
        let mut config = Config::UNCONFIGURED;
        config.limits.syn_rate = 5;
        assert!(KernelLimits::new(&config, &[]).enabled());
    }
}

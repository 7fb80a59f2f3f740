//! The agent's Prometheus metrics. Kernel counters live in per-CPU BPF maps and the broker
//! limiter keeps its own striped counters, so both are read at scrape time by custom collectors
//! instead of being mirrored into registered metrics that could drift from the truth. The
//! sweeper's metrics are ordinary registered ones: it updates them as it works.

use std::sync::{Arc, Mutex};

use limiter_client::Outcome;
use limiter_common::{
    Event,
    stats::{Direction, Reason, Verdict},
};
use prometheus::{
    IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
    core::{Collector, Desc},
    proto::MetricFamily,
};
use thiserror::Error;

use super::sweeper::SweepStats;
use crate::{
    buckets::{Enforcement, Limiter},
    datapath::{Enforcer, MapsError, PacketCount},
};

#[derive(Debug, Error)]
pub enum MetricsError {
    #[error("registering the metrics")]
    Register(#[source] prometheus::Error),
    #[error("encoding the metrics")]
    Encode(#[source] prometheus::Error),
}

/// The registry `/metrics` renders.
pub struct Metrics {
    registry: Registry,
}

/// The content type of the text exposition format.
pub const CONTENT_TYPE: &str = prometheus::TEXT_FORMAT;

impl Metrics {
    pub fn new(
        enforcer: &Arc<Enforcer>,
        limiter: &Arc<Limiter>,
        sweep: &SweepStats,
    ) -> Result<Self, MetricsError> {
        let registry = Registry::new();
        let collectors: [Box<dyn Collector>; 8] = [
            Box::new(sweep.evictions.clone()),
            Box::new(sweep.repairs.clone()),
            Box::new(sweep.adoptions.clone()),
            Box::new(sweep.duration.clone()),
            Box::new(build_info()?),
            Box::new(AtScrape::new(KernelMetrics::new(Arc::clone(enforcer))?)),
            Box::new(AtScrape::new(BrokerMetrics::new(Arc::clone(limiter))?)),
            Box::new(AtScrape::new(MonitorMetrics::new(
                Some(Arc::clone(enforcer)),
                Arc::clone(limiter),
            )?)),
        ];
        for collector in collectors {
            registry
                .register(collector)
                .map_err(MetricsError::Register)?;
        }
        Ok(Self { registry })
    }

    /// The text exposition. Reads the kernel maps: call it off the async runtime's threads.
    pub fn render(&self) -> Result<String, MetricsError> {
        TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .map_err(MetricsError::Encode)
    }
}

fn build_info() -> Result<IntGaugeVec, MetricsError> {
    let info = IntGaugeVec::new(
        Opts::new(
            "limiter_build_info",
            "Always 1; the labels say which build of the agent is running.",
        ),
        &["version"],
    )
    .map_err(MetricsError::Register)?;
    info.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
    Ok(info)
}

/// Metric families rebuilt from their source at every scrape.
trait Scraped: Send + Sync {
    /// Every family, for the registry's descriptions.
    fn families(&self) -> Vec<&dyn Collector>;
    /// Resets and refills the families from the source; returns those to expose.
    fn refill(&self) -> Vec<&dyn Collector>;
}

/// A [`Scraped`] source as a registered collector. The lock serialises scrapes, since each one
/// resets and refills the same families.
struct AtScrape<T> {
    lock: Mutex<()>,
    source: T,
    descs: Vec<Desc>,
}

impl<T: Scraped> AtScrape<T> {
    fn new(source: T) -> Self {
        let descs = source
            .families()
            .iter()
            .flat_map(|c| c.desc().into_iter().cloned())
            .collect();
        Self {
            lock: Mutex::new(()),
            source,
            descs,
        }
    }
}

impl<T: Scraped> Collector for AtScrape<T> {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let _serial = self
            .lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.source
            .refill()
            .into_iter()
            .flat_map(prometheus::core::Collector::collect)
            .collect()
    }
}

struct Kernel {
    packets: IntCounterVec,
    refused_connections: IntCounterVec,
    events: IntCounterVec,
    connections: IntGaugeVec,
    tracked_sources: IntGauge,
    flow_entries: IntGauge,
    flow_capacity: IntGauge,
    bans: IntGauge,
    cookies_active: IntGauge,
    cookie_switches: IntCounterVec,
    readable: IntGauge,
}

/// Reads the kernel maps at scrape time.
struct KernelMetrics {
    enforcer: Arc<Enforcer>,
    families: Kernel,
}

impl KernelMetrics {
    fn new(enforcer: Arc<Enforcer>) -> Result<Self, MetricsError> {
        let r = MetricsError::Register;
        let gauge = |name: &str, help: &str| IntGauge::new(name, help).map_err(r);
        let families = Kernel {
            packets: IntCounterVec::new(
                Opts::new(
                    "limiter_packets_total",
                    "Packets the kernel programs handled, by direction, verdict and reason.",
                ),
                &["direction", "verdict", "reason"],
            )
            .map_err(r)?,
            refused_connections: IntCounterVec::new(
                Opts::new(
                    "limiter_refused_connections_total",
                    "Connection attempts the kernel refused, by reason and port profile (\"default\": the top level's ports): a refused SYN counts once however often it is retransmitted, and a handshake refused at its ACK counts once.",
                ),
                &["reason", "profile"],
            )
            .map_err(r)?,
            events: IntCounterVec::new(
                Opts::new(
                    "limiter_flow_events_total",
                    "Flow table events: opened, closed by RST, closed by FINs, released by the agent.",
                ),
                &["event"],
            )
            .map_err(r)?,
            connections: IntGaugeVec::new(
                Opts::new(
                    "limiter_connections",
                    "Open connections to the host, as the kernel counts them, by port profile (\"default\": the top level's ports).",
                ),
                &["profile"],
            )
            .map_err(r)?,
            tracked_sources: gauge(
                "limiter_tracked_sources",
                "Sources (addresses masked to their prefix) holding at least one connection.",
            )?,
            flow_entries: gauge(
                "limiter_flow_table_entries",
                "Connections in the kernel flow table.",
            )?,
            flow_capacity: gauge(
                "limiter_flow_table_capacity",
                "Connections the kernel flow table can hold.",
            )?,
            bans: gauge("limiter_bans_active", "Bans in force.")?,
            cookies_active: gauge(
                "limiter_syn_cookies_active",
                "1 while the kernel programs answer unproven sources' SYNs with cookies.",
            )?,
            cookie_switches: IntCounterVec::new(
                Opts::new(
                    "limiter_syn_cookie_switches_total",
                    "Times syn-cookies = auto switched cookies on or off.",
                ),
                &["to"],
            )
            .map_err(r)?,
            readable: gauge(
                "limiter_maps_readable",
                "1 when every kernel map read of this scrape succeeded; 0 when the kernel metrics are missing or partial.",
            )?,
        };
        Ok(Self { enforcer, families })
    }

    /// Fills the families; each map is read under its own short hold of the datapath lock so
    /// that a scrape never stalls the sweeper or an admin call for the whole read.
    fn fill(&self, k: &Kernel) -> Result<(), MapsError> {
        let enforcer = &self.enforcer;
        let config = enforcer.with_maps(|m| m.config())?;
        let monitoring = config.limits.monitor != 0
            || enforcer
                .with_maps(|m| m.profile_slots())?
                .iter()
                .any(|(_, _, limits)| limits.monitor != 0);
        // Monitor mode's series only once it has run, so an enforcing host's do not grow.
        let monitored =
            |c: &PacketCount| c.verdict != Verdict::WouldRefuse || monitoring || c.packets > 0;
        for count in enforcer
            .with_maps(|m| m.packet_counts())?
            .into_iter()
            .filter(|c| possible(c.direction, c.verdict, c.reason) && monitored(c))
        {
            k.packets
                .with_label_values(&[
                    count.direction.label(),
                    count.verdict.label(),
                    count.reason.label(),
                ])
                .inc_by(count.packets);
        }
        let profiles = enforcer.with_maps(|m| m.profile_labels())?;
        let connections = enforcer.with_maps(|m| m.profile_connections())?;
        for (slot, profile) in &profiles {
            for &reason in &Reason::ALL[..Reason::REFUSAL_COUNT] {
                let n = enforcer.with_maps(|m| m.refusals_in(*slot, false, reason))?;
                k.refused_connections
                    .with_label_values(&[reason.label(), profile])
                    .inc_by(n);
            }
            k.connections
                .with_label_values(&[profile])
                .set(gauge_value(connections[*slot as usize]));
        }
        for event in Event::ALL {
            let n = enforcer.with_maps(|m| m.events(event))?;
            k.events.with_label_values(&[event.label()]).inc_by(n);
        }
        let sources = enforcer.with_maps(|m| m.all_source_connections())?;
        k.tracked_sources.set(gauge_value(
            sources.iter().filter(|(_, n)| *n > 0).count() as u64
        ));
        k.flow_entries
            .set(gauge_value(enforcer.with_maps(|m| m.flow_count())? as u64));
        k.flow_capacity
            .set(i64::from(enforcer.with_maps(|m| m.flow_capacity())?));
        k.bans
            .set(gauge_value(enforcer.with_maps(|m| m.bans())?.len() as u64));
        k.cookies_active
            .set((config.syn_cookies & limiter_common::syn_cookies::ANSWER != 0).into());
        let (on, off) = enforcer.cookie_switches();
        k.cookie_switches.with_label_values(&["on"]).inc_by(on);
        k.cookie_switches.with_label_values(&["off"]).inc_by(off);
        Ok(())
    }
}

fn gauge_value(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Scraped for KernelMetrics {
    fn families(&self) -> Vec<&dyn Collector> {
        let k = &self.families;
        vec![
            &k.packets,
            &k.refused_connections,
            &k.events,
            &k.connections,
            &k.tracked_sources,
            &k.flow_entries,
            &k.flow_capacity,
            &k.bans,
            &k.cookies_active,
            &k.cookie_switches,
            &k.readable,
        ]
    }

    fn refill(&self) -> Vec<&dyn Collector> {
        let k = &self.families;
        k.packets.reset();
        k.refused_connections.reset();
        k.connections.reset();
        k.events.reset();
        k.cookie_switches.reset();
        let readable = match self.fill(k) {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(error = %crate::errors::error_chain(&error), "metrics: reading the kernel maps");
                false
            }
        };
        k.readable.set(readable.into());
        if readable {
            self.families()
        } else {
            // A failed read leaves the other families partial: only the flag is exposed.
            vec![&k.readable]
        }
    }
}

struct Broker {
    checks: IntCounterVec,
    blocked: IntCounterVec,
    keys: IntGaugeVec,
    overflow: IntCounterVec,
    key_memory: IntGaugeVec,
    sessions_held: IntGaugeVec,
    strike_disconnects: IntCounterVec,
    escalation_bans: IntCounter,
    /// The fleet's four, last in [`Scraped::families`] order: exposed only with a fleet.
    redis_up: IntGauge,
    fallbacks: IntCounter,
    switches: IntCounterVec,
    fleet_bans: IntCounterVec,
}

/// Reads the broker limiter's counters at scrape time.
struct BrokerMetrics {
    limiter: Arc<Limiter>,
    families: Broker,
}

impl BrokerMetrics {
    fn new(limiter: Arc<Limiter>) -> Result<Self, MetricsError> {
        let r = MetricsError::Register;
        let families = Broker {
            checks: IntCounterVec::new(
                Opts::new(
                    "limiter_rate_limit_checks_total",
                    "Broker rate-limit checks, by action and outcome.",
                ),
                &["action", "outcome"],
            )
            .map_err(r)?,
            blocked: IntCounterVec::new(
                Opts::new(
                    "limiter_rate_limit_blocked_total",
                    "Broker rate-limit checks refused (limited, cost over the burst or the quota, or closed), by action.",
                ),
                &["action"],
            )
            .map_err(r)?,
            keys: IntGaugeVec::new(
                Opts::new(
                    "limiter_rate_limit_keys",
                    "Keys with a live bucket, by action.",
                ),
                &["action"],
            )
            .map_err(r)?,
            overflow: IntCounterVec::new(
                Opts::new(
                    "limiter_rate_limit_overflow_checks_total",
                    "Checks of new keys answered untracked because the action was at its key cap with every bucket still spending.",
                ),
                &["action"],
            )
            .map_err(r)?,
            key_memory: IntGaugeVec::new(
                Opts::new(
                    "limiter_rate_limit_key_memory_bytes",
                    "Memory the action's key table holds.",
                ),
                &["action"],
            )
            .map_err(r)?,
            sessions_held: IntGaugeVec::new(
                Opts::new(
                    "limiter_sessions_held",
                    "Sessions held now through this agent's brokers (concurrency actions; 0 for the others), by action.",
                ),
                &["action"],
            )
            .map_err(r)?,
            strike_disconnects: IntCounterVec::new(
                Opts::new(
                    "limiter_strike_disconnects_total",
                    "Broker connections closed by their strikes (each once, when it reached strikes-to-disconnect), by action.",
                ),
                &["action"],
            )
            .map_err(r)?,
            escalation_bans: IntCounter::new(
                "limiter_escalation_bans_total",
                "Kernel bans placed because an address failed authentication too often.",
            )
            .map_err(r)?,
            fleet_bans: IntCounterVec::new(
                Opts::new(
                    "limiter_fleet_ban_changes_total",
                    "Bans and unbans shared with the fleet's Redis: sent, received from other agents, or send_failed (enforced on this agent only).",
                ),
                &["change"],
            )
            .map_err(r)?,
            redis_up: IntGauge::new(
                "limiter_fleet_redis_up",
                "1 while shared checks go to the fleet's Redis, 0 while they are decided locally.",
            )
            .map_err(r)?,
            fallbacks: IntCounter::new(
                "limiter_fleet_fallback_total",
                "Shared checks decided locally at limit / expected replicas because Redis failed, was too slow or was down.",
            )
            .map_err(r)?,
            switches: IntCounterVec::new(
                Opts::new(
                    "limiter_fleet_switches_total",
                    "Switches of the shared checks from Redis to local decisions (to=local) and back (to=redis).",
                ),
                &["to"],
            )
            .map_err(r)?,
        };
        Ok(Self { limiter, families })
    }
}

impl Scraped for BrokerMetrics {
    fn families(&self) -> Vec<&dyn Collector> {
        let b = &self.families;
        vec![
            &b.checks,
            &b.blocked,
            &b.keys,
            &b.overflow,
            &b.key_memory,
            &b.sessions_held,
            &b.strike_disconnects,
            &b.escalation_bans,
            // Before the fleet's four, which a lone agent leaves out.
            &b.redis_up,
            &b.fallbacks,
            &b.switches,
            &b.fleet_bans,
        ]
    }

    fn refill(&self) -> Vec<&dyn Collector> {
        let b = &self.families;
        b.checks.reset();
        b.blocked.reset();
        b.keys.reset();
        b.overflow.reset();
        b.key_memory.reset();
        b.sessions_held.reset();
        b.strike_disconnects.reset();
        b.escalation_bans.reset();
        b.fleet_bans.reset();
        let shared = self.limiter.shared_ban_stats();
        for (change, n) in [
            ("sent", shared.sent),
            ("received", shared.received),
            ("send_failed", shared.send_failures),
        ] {
            b.fleet_bans.with_label_values(&[change]).inc_by(n);
        }
        for stats in self.limiter.stats() {
            let action = stats.action.as_str();
            let counts = &stats.counts;
            for outcome in Outcome::ALL {
                let n = match outcome {
                    Outcome::Allowed => counts.allowed,
                    Outcome::Unlimited => counts.unlimited,
                    Outcome::Limited => counts.limited,
                    Outcome::CostExceedsBurst => counts.cost_exceeds_burst,
                    Outcome::CostExceedsLimit => counts.cost_exceeds_limit,
                    Outcome::Closed => counts.closed,
                    Outcome::Disconnect => counts.disconnect,
                    Outcome::PayloadTooLarge => counts.payload_too_large,
                };
                b.checks
                    .with_label_values(&[action, outcome.as_str()])
                    .inc_by(n);
            }
            b.blocked
                .with_label_values(&[action])
                .inc_by(counts.blocked);
            b.keys
                .with_label_values(&[action])
                .set(gauge_value(counts.tracked_keys as u64));
            b.overflow
                .with_label_values(&[action])
                .inc_by(counts.overflow_checks);
            b.key_memory
                .with_label_values(&[action])
                .set(gauge_value(stats.key_memory_bytes as u64));
            b.sessions_held
                .with_label_values(&[action])
                .set(gauge_value(counts.sessions_held));
            b.strike_disconnects
                .with_label_values(&[action])
                .inc_by(counts.strike_disconnects);
        }
        if let Some(escalation) = self.limiter.escalation_stats() {
            b.escalation_bans.inc_by(escalation.bans);
        }
        let mut families = self.families();
        match self.limiter.shared_status() {
            Some(fleet) => {
                b.redis_up.set(i64::from(fleet.redis_up));
                b.fallbacks.reset();
                b.fallbacks.inc_by(fleet.fallback_checks);
                b.switches.reset();
                b.switches
                    .with_label_values(&["local"])
                    .inc_by(fleet.switches_to_local);
                b.switches
                    .with_label_values(&["redis"])
                    .inc_by(fleet.switches_to_redis);
            }
            // Without a fleet these series would only say nothing.
            None => families.truncate(families.len() - 4),
        }
        families
    }
}

/// What monitor mode judged and let through, from the kernel programs and the broker limiter
/// alike: one family, `limiter_would_refuse_total{reason,profile}`. A series appears only once
/// its part has been monitored, so an enforcing host's exposition does not grow.
struct MonitorMetrics {
    /// `None` where no programs are loaded (the broker limiter's own tests).
    enforcer: Option<Arc<Enforcer>>,
    limiter: Arc<Limiter>,
    would_refuse: IntCounterVec,
}

impl MonitorMetrics {
    fn new(enforcer: Option<Arc<Enforcer>>, limiter: Arc<Limiter>) -> Result<Self, MetricsError> {
        let would_refuse = IntCounterVec::new(
            Opts::new(
                "limiter_would_refuse_total",
                "Refusals monitor mode counted and did not make, by reason and profile: for the kernel's limits, profile=\"default\" and the refusal's reason (packets, as limiter_packets_total counts them); for an action, profile=\"action:NAME\" and the refusal's outcome; for escalation, profile=\"escalation\", reason=\"ban\".",
            ),
            &["reason", "profile"],
        )
        .map_err(MetricsError::Register)?;
        Ok(Self {
            enforcer,
            limiter,
            would_refuse,
        })
    }

    /// The kernel's series, per port profile: a profile's appear once it monitors or has.
    fn fill_kernel(&self, enforcer: &Enforcer) -> Result<(), MapsError> {
        let config = enforcer.with_maps(|m| m.config())?;
        let slots = enforcer.with_maps(|m| m.profile_slots())?;
        for (slot, profile) in enforcer.with_maps(|m| m.profile_labels())? {
            let monitoring = if slot == 0 {
                config.limits.monitor != 0
            } else {
                slots
                    .iter()
                    .any(|(s, _, limits)| *s == slot && limits.monitor != 0)
            };
            let mut counts = Vec::with_capacity(Reason::REFUSAL_COUNT);
            for &reason in &Reason::ALL[..Reason::REFUSAL_COUNT] {
                let n = enforcer.with_maps(|m| m.refusals_in(slot, true, reason))?;
                counts.push((reason, n));
            }
            if monitoring || counts.iter().any(|(_, n)| *n > 0) {
                for (reason, n) in counts {
                    self.would_refuse
                        .with_label_values(&[reason.label(), &profile])
                        .inc_by(n);
                }
            }
        }
        Ok(())
    }
}

impl Scraped for MonitorMetrics {
    fn families(&self) -> Vec<&dyn Collector> {
        vec![&self.would_refuse]
    }

    fn refill(&self) -> Vec<&dyn Collector> {
        self.would_refuse.reset();
        if let Some(enforcer) = &self.enforcer
            && let Err(error) = self.fill_kernel(enforcer)
        {
            // `limiter_maps_readable` says so; the broker's series still count.
            tracing::warn!(error = %crate::errors::error_chain(&error), "metrics: reading the kernel's monitored refusals");
        }
        for stats in self.limiter.stats() {
            if stats.mode == Enforcement::Monitor || stats.counts.would_refuse > 0 {
                let profile = format!("action:{}", stats.action.as_str());
                for (outcome, n) in &stats.would_refuse {
                    self.would_refuse
                        .with_label_values(&[outcome.as_str(), profile.as_str()])
                        .inc_by(*n);
                }
            }
        }
        if let Some(escalation) = self.limiter.escalation_stats()
            && (self.limiter.mode() == Enforcement::Monitor || escalation.would_ban > 0)
        {
            self.would_refuse
                .with_label_values(&["ban", "escalation"])
                .inc_by(escalation.would_ban);
        }
        self.families()
    }
}

/// Whether the kernel programs can count a packet under these labels, so only series that
/// can ever move are exported. Egress (TC) only observes: it passes, for parse failures and
/// for the segments of connections. Ingress refuses (drop, or rst for a refused SYN or a
/// handshake refused at its last ACK) for a refusal reason, drops what it cannot read when it
/// could reach a protected port or the host would discard it (only ingress checks that) and
/// a tunnel unless `tunnels` is `pass`, and passes for every other reason but a plain segment
/// (left
/// uncounted: see `decide::established` in the kernel crate), and for a full flow table when
/// failing open.
fn possible(direction: Direction, verdict: Verdict, reason: Reason) -> bool {
    let refusal = (reason as usize) < Reason::REFUSAL_COUNT;
    let unreadable = matches!(
        reason,
        Reason::Fragment | Reason::Truncated | Reason::HeaderChain | Reason::Malformed
    );
    let discarded = matches!(
        reason,
        Reason::Checksum | Reason::Martian | Reason::BadCookie
    );
    // Dropped unless `tunnels` is `pass`, then passed; passed on egress like non-TCP.
    let tunnel = reason == Reason::Tunnel;
    match (direction, verdict) {
        (Direction::Egress, Verdict::Pass) => {
            unreadable
                || matches!(
                    reason,
                    Reason::NonIp
                        | Reason::NonTcp
                        | Reason::UnprotectedPort
                        | Reason::Segment
                        | Reason::Tracked
                        | Reason::Untracked
                        | Reason::Tunnel
                )
        }
        (Direction::Egress, _) => false,
        (Direction::Ingress, Verdict::Pass) => {
            (!refusal
                && !unreadable
                && !discarded
                && !matches!(reason, Reason::Segment | Reason::Unproven))
                || reason == Reason::FlowTableFull
        }
        (Direction::Ingress, Verdict::Drop) => refusal || unreadable || discarded || tunnel,
        (Direction::Ingress, Verdict::Rst) => refusal,
        (Direction::Ingress, Verdict::Cookie) => reason == Reason::Unproven,
        // Monitor mode passes what the source and rate policy would refuse; what cannot be
        // judged is refused as ever.
        (Direction::Ingress, Verdict::WouldRefuse) => refusal,
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeMap, time::Duration};

    use super::*;
    use crate::buckets::{
        ActionConfig, KeyKind, LimiterConfig, ManualClock, NoBans, Window, resolve_actions,
    };

    #[test]
    fn broker_counters_are_read_at_scrape_time() {
        let mut table = BTreeMap::new();
        table.insert(
            "export".to_owned(),
            ActionConfig {
                limit: Some(1),
                window: Some(Window(Duration::from_secs(60))),
                key: Some(KeyKind::User),
                ..ActionConfig::default()
            },
        );
        let limiter = Arc::new(Limiter::new(
            LimiterConfig {
                actions: resolve_actions(&table, &[], false).unwrap(),
                escalation: None,
                mode: Enforcement::Enforce,
            },
            Arc::new(ManualClock::new()),
            Arc::new(NoBans),
        ));
        let registry = Registry::new();
        registry
            .register(Box::new(AtScrape::new(
                BrokerMetrics::new(Arc::clone(&limiter)).unwrap(),
            )))
            .unwrap();
        let scrape = || {
            TextEncoder::new()
                .encode_to_string(&registry.gather())
                .unwrap()
        };
        let before = scrape();
        assert!(before.contains(
            "limiter_rate_limit_checks_total{action=\"export\",outcome=\"limited\"} 0\n"
        ));
        assert!(before.contains("limiter_escalation_bans_total 0\n"));
        for _ in 0..3 {
            limiter.check("export", b"alice", 1).unwrap();
        }
        limiter.check("export", b"bob", 5).unwrap();
        let after = scrape();
        for line in [
            "limiter_rate_limit_checks_total{action=\"export\",outcome=\"allowed\"} 1\n",
            "limiter_rate_limit_checks_total{action=\"export\",outcome=\"limited\"} 2\n",
            "limiter_rate_limit_checks_total{action=\"export\",outcome=\"cost_exceeds_burst\"} 1\n",
            "limiter_rate_limit_blocked_total{action=\"export\"} 3\n",
            "limiter_rate_limit_keys{action=\"export\"} 2\n",
            "# TYPE limiter_rate_limit_checks_total counter\n",
            "# TYPE limiter_rate_limit_keys gauge\n",
        ] {
            assert!(after.contains(line), "{line:?} missing from:\n{after}");
        }
        // A second scrape reports the same totals, not twice them.
        assert_eq!(scrape(), after);
    }

    #[test]
    fn sessions_held_and_strike_disconnects_are_read_at_scrape_time() {
        let text = "[actions.logins]\nkind = \"concurrency\"\nlimit = 2\nkey = \"user\"\n\
                    [actions.pub]\nlimit = 1\nwindow = \"60s\"\nkey = \"connection\"\n\
                    strikes-to-disconnect = 2\nstrike-window = \"60s\"\n";
        let table = toml::from_str::<toml::Table>(text).unwrap();
        let actions: BTreeMap<String, ActionConfig> = table["actions"].clone().try_into().unwrap();
        let limiter = Arc::new(Limiter::new(
            LimiterConfig {
                actions: resolve_actions(&actions, &[], false).unwrap(),
                escalation: None,
                mode: Enforcement::Enforce,
            },
            Arc::new(ManualClock::new()),
            Arc::new(NoBans),
        ));
        let registry = Registry::new();
        registry
            .register(Box::new(AtScrape::new(
                BrokerMetrics::new(Arc::clone(&limiter)).unwrap(),
            )))
            .unwrap();
        let scrape = || {
            TextEncoder::new()
                .encode_to_string(&registry.gather())
                .unwrap()
        };
        let before = scrape();
        for line in [
            "limiter_sessions_held{action=\"logins\"} 0\n",
            "limiter_strike_disconnects_total{action=\"pub\"} 0\n",
        ] {
            assert!(before.contains(line), "{line:?} missing from:\n{before}");
        }
        let broker = crate::buckets::SessionOwner::default();
        for session in [b"1", b"2", b"3"] {
            let pending = limiter.acquire(&broker, "logins", b"alice", session);
            assert!(
                pending.unwrap().now().is_ok(),
                "a local action answers at once"
            );
        }
        // Allowed, then two strikes: closed once, answered so twice.
        for _ in 0..4 {
            limiter.check("pub", b"c1", 1).unwrap();
        }
        let during = scrape();
        for line in [
            "limiter_sessions_held{action=\"logins\"} 2\n",
            "limiter_strike_disconnects_total{action=\"pub\"} 1\n",
            "# TYPE limiter_sessions_held gauge\n",
            "# TYPE limiter_strike_disconnects_total counter\n",
        ] {
            assert!(during.contains(line), "{line:?} missing from:\n{during}");
        }
        drop(broker);
        assert!(scrape().contains("limiter_sessions_held{action=\"logins\"} 0\n"));
    }
}

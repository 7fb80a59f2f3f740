//! The sweeper: a periodic pass that evicts half-open and idle flows, idle SYN buckets, expired
//! bans and the broker limiter's idle keys, adopts established connections the flow table
//! lacks, and repairs counters that drifted from the flow table. Each pass does bounded work,
//! resuming where the last one stopped.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::Instant,
};

use limiter_common::{FlowKey, PROFILE_SLOTS, ProfileSource};
use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, Opts};

use super::sweep_rules::{self, Counter, Mismatch, Release, SocketView, Streak};
use crate::{
    buckets::Limiter,
    datapath::{
        Adoption, EnforceError, Enforcer, SweepCursor,
        kernel_keys::boot_time_ns,
        local_routes::{LocalAddresses, RouteQueries},
        sockets::SocketTable,
    },
    duration_units::duration_ns,
    settings::{Live, SweepSettings},
};

/// What the sweeper has done, as Prometheus metrics (registered by the metrics module).
#[derive(Clone)]
pub struct SweepStats {
    /// By kind: `closed`, `over_cap`, `half_open`, `idle`, `ban`, `app_key`.
    pub evictions: IntCounterVec,
    /// Established connections the flow table lacked, entered and counted.
    pub adoptions: IntCounter,
    pub repairs: IntCounter,
    pub duration: Histogram,
}

/// The `kind` label values of `limiter_evictions_total`, in the order a pass reports them.
const EVICTION_KINDS: [&str; 6] = ["closed", "over_cap", "half_open", "idle", "ban", "app_key"];

impl SweepStats {
    pub fn new() -> Self {
        let stats = Self {
            evictions: IntCounterVec::new(
                Opts::new(
                    "limiter_evictions_total",
                    "Entries the sweeper evicted, by kind.",
                ),
                &["kind"],
            )
            .expect("valid metric"),
            adoptions: IntCounter::new(
                "limiter_adopted_flows_total",
                "Established connections the flow table lacked, adopted from the host's socket table and counted.",
            )
            .expect("valid metric"),
            // Not `limiter_counter_...`: a metric name must not name a metric type.
            repairs: IntCounter::new(
                "limiter_drift_repairs_total",
                "Connection counters the sweeper found drifted from the flow table and repaired.",
            )
            .expect("valid metric"),
            duration: Histogram::with_opts(
                HistogramOpts::new(
                    "limiter_sweep_duration_seconds",
                    "Duration of one sweep pass.",
                )
                .buckets(vec![0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0]),
            )
            .expect("valid metric"),
        };
        // Every kind exists from the first scrape, at 0, so a rate() over it never starts
        // from a missing series.
        for kind in EVICTION_KINDS {
            stats.evictions.with_label_values(&[kind]);
        }
        stats
    }
}

impl Default for SweepStats {
    fn default() -> Self {
        Self::new()
    }
}

/// What one pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PassReport {
    /// Flows released because the host has no socket for them any more.
    pub closed: u64,
    /// Adopted connections that got past a cap unjudged, closed (`SOCK_DESTROY`) and released.
    pub over_cap: u64,
    /// Half-open connections older than `syn-timeout` removed (they held no slot).
    pub half_open: u64,
    /// Flows released by `idle-timeout`, where the socket table cannot speak for them.
    pub idle: u64,
    pub bans: u64,
    pub app_keys: u64,
    /// Established connections the flow table lacked, adopted (see [`Sweeper::adopt`]).
    pub adopted: u64,
    /// Sources kernel escalation banned (or, in monitor mode, would have).
    pub escalated: u64,
    pub repairs: u64,
    /// This pass's walk reached the end of the flow table: a cycle ended (and was
    /// reconciled, if it began at the table's start).
    pub cycle_ended: bool,
}

/// The sweeper's memory between passes.
#[derive(Default)]
pub struct Sweeper {
    cursor: SweepCursor,
    /// Flows per source and profile counted so far in this cycle over the flow table.
    tally: HashMap<ProfileSource, u64>,
    /// The counters as they read when this cycle began; `None` until a cycle has begun at the
    /// table's start, since a tally that starts mid-table counts only part of it.
    cycle_start: Option<HashMap<Counter, u64>>,
    /// Mismatches of the last reconciliation: only a drift seen twice in a row is repaired, so
    /// a connection opening or closing between two reads is never "repaired" into a real drift.
    suspects: HashMap<Counter, Mismatch>,
    /// Flows seen in the flow table so far in this cycle and in the whole cycle before, and
    /// 4-tuples the adoption helper found tracked (or not the programs' to count) since this
    /// cycle began: established sockets among them need no helper run. Every other one is
    /// looked at on every pass, so a connection that got in unjudged is found within one
    /// pass, however many passes a cycle takes.
    tracked: HashSet<FlowKey>,
    tracked_before: HashSet<FlowKey>,
    checked: HashSet<FlowKey>,
    /// Whether a pass has run since the agent started: connections adopted at the first were
    /// open before it and are counted as they are; later ones got past the programs unjudged,
    /// and one past a cap is closed.
    settled: bool,
    /// The interfaces the programs are attached to: only connections from another host that
    /// the host routes back through one of them came in through the programs and are adopted
    /// ([`sweep_rules::came_in`]). Others (local users, peers behind an interface the operator
    /// left unprotected) were never the programs' to judge.
    interfaces: Vec<String>,
}

impl Sweeper {
    /// A sweeper that adopts nothing (no interface is judged).
    pub fn new() -> Self {
        Self::default()
    }

    /// A sweeper for programs attached to `interfaces`.
    pub fn for_interfaces(interfaces: Vec<String>) -> Self {
        Self {
            interfaces,
            ..Self::default()
        }
    }

    /// One pass: bounded by `settings.batch` entries per map.
    pub fn pass(
        &mut self,
        enforcer: &Enforcer,
        limiter: &Limiter,
        stats: &SweepStats,
        settings: &SweepSettings,
    ) -> Result<PassReport, EnforceError> {
        let started = Instant::now();
        let mut report = PassReport::default();
        if self.cycle_start.is_none() && self.cursor.at_flow_start() {
            self.cycle_start = Some(counters(enforcer)?);
        }
        let now = boot_time_ns()?;
        let batch = settings.batch as usize;
        let flows = enforcer.with_maps(|m| m.flow_batch(&mut self.cursor, batch))?;
        // Read after the flows, so a flow in the batch whose socket is missing really has none.
        let sockets = match SocketTable::read() {
            Ok(sockets) => Some(sockets),
            Err(error) => {
                tracing::warn!(%error, "the host's socket table is unreadable; flows are judged by the timeouts alone");
                None
            }
        };
        for (key, flow) in &flows.flows {
            let socket = match sockets.as_ref().filter(|s| s.covers(key)) {
                Some(sockets) if sockets.has(key) => SocketView::Open,
                Some(_) => SocketView::Missing,
                None => SocketView::Silent,
            };
            let release =
                sweep_rules::judge_flow(socket, now, flow.last_seen_ns, settings.idle_timeout);
            match release {
                // Released through the kernel, so it happens once even if a FIN races it.
                Some(why) if enforcer.datapath().release(key)? => match why {
                    Release::Closed => report.closed += 1,
                    Release::Idle => report.idle += 1,
                },
                Some(_) => {}
                // Each flow counts once in a cycle: a walk whose cursor's key was deleted (a
                // flow released at the end of the last batch) starts again from the first key
                // and reads again flows it counted already, which would otherwise look like
                // drift and, seen twice, be "repaired" into it.
                None => {
                    if self.tracked.insert(*key) {
                        *self.tally.entry(flow.counted).or_default() += 1;
                    }
                }
            }
        }
        if let Some(sockets) = &sockets {
            (report.adopted, report.over_cap) = self.adopt(enforcer, sockets)?;
        }
        self.settled = true;
        report.cycle_ended = flows.wrapped;
        if flows.wrapped {
            if let Some(start) = self.cycle_start.take() {
                report.repairs = self.reconcile(enforcer, &start)?;
            }
            self.tally.clear();
            self.tracked_before = std::mem::take(&mut self.tracked);
            self.checked.clear();
        }
        report.escalated = escalate(enforcer, limiter, now)?;
        let syn_timeout = duration_ns(settings.syn_timeout);
        report.half_open =
            enforcer.with_maps(|m| m.sweep_half_open(&mut self.cursor, batch, now, syn_timeout))?;
        report.bans = enforcer.with_maps(|m| m.sweep_bans(&mut self.cursor, batch, now))?;
        report.app_keys = limiter.sweep() as u64;
        let counts = [
            report.closed,
            report.over_cap,
            report.half_open,
            report.idle,
            report.bans,
            report.app_keys,
        ];
        for (kind, n) in EVICTION_KINDS.into_iter().zip(counts) {
            stats.evictions.with_label_values(&[kind]).inc_by(n);
        }
        stats.adoptions.inc_by(report.adopted);
        stats.repairs.inc_by(report.repairs);
        stats.duration.observe(started.elapsed().as_secs_f64());
        Ok(report)
    }

    /// Enters every established connection not known to be tracked (see `tracked`) that is an
    /// adoption candidate ([`sweep_rules::adoption_candidate`]), with its slots taken (the
    /// kernel skips a 4-tuple it tracks, a port not protected and an allowlisted source). Such a connection completed its handshake unjudged: it was open
    /// before the programs were attached, or its half-open record was evicted by a flood or
    /// swept after `syn-timeout` while its client held the ACK back, which an attacker can do
    /// at will. After the first pass, one that took its source or the host past a cap is
    /// closed, as the programs would have refused it at its ACK; those open before the agent
    /// started are only counted. Returns (adopted, closed).
    fn adopt(
        &mut self,
        enforcer: &Enforcer,
        sockets: &SocketTable,
    ) -> Result<(u64, u64), EnforceError> {
        let (mut adopted, mut closed) = (0, 0);
        // Read at the first candidate only: a pass with none costs no netlink query.
        let mut host: Option<HostRoutes> = None;
        let policy = enforcer.policy();
        for flow in sockets.established() {
            let known = self.tracked.contains(flow)
                || self.tracked_before.contains(flow)
                || self.checked.contains(flow);
            let protects = |port| policy.protects(port);
            if !sweep_rules::adoption_candidate(flow, known, protects, &policy.allow, |f| {
                host.get_or_insert_with(|| HostRoutes::read(&self.interfaces))
                    .came_in(f)
            }) {
                continue;
            }
            let adoption = enforcer.datapath().adopt(flow)?;
            self.checked.insert(*flow);
            if adoption == Adoption::Skipped {
                continue;
            }
            adopted += 1;
            // Monitored as its port's profile is.
            let monitoring = policy
                .limits_of(flow.local_port)
                .is_some_and(|limits| limits.monitor != 0);
            if sweep_rules::destroys(adoption, self.settled, monitoring) {
                let remote = std::net::Ipv6Addr::from(flow.remote).to_canonical();
                match sockets.destroy(flow) {
                    Ok(()) => {
                        tracing::warn!(%remote, port = flow.remote_port, "closed a connection that got past a cap unjudged");
                        // Its RST leaving the host may have released it already: once either way.
                        enforcer.datapath().release(flow)?;
                        closed += 1;
                    }
                    Err(error) => {
                        tracing::warn!(%remote, %error, "a connection got past a cap unjudged and could not be closed; it stays counted");
                    }
                }
            }
        }
        Ok((adopted, closed))
    }

    /// Reconciles the counters with the cycle's tally ([`sweep_rules::reconcile`]): the
    /// counters it finds drifted are repaired, and an entry read at 0 (the kernel removes a
    /// source's entry as its last slot goes; a rare race can leave one behind) is removed by
    /// the kernel's own retirement, never by a delete from here, which would race a
    /// handshake taking a slot between the read and the delete.
    fn reconcile(
        &mut self,
        enforcer: &Enforcer,
        start: &HashMap<Counter, u64>,
    ) -> Result<u64, EnforceError> {
        let end = counters(enforcer)?;
        let verdict = sweep_rules::reconcile(start, &end, &self.tally, &self.suspects);
        for source in &verdict.idle_sources {
            enforcer.datapath().remove_idle_source(source)?;
        }
        for repair in &verdict.repairs {
            enforcer.datapath().adjust(&repair.request)?;
            let (count, counted) = (repair.count, repair.counted);
            match repair.who {
                Counter::Source(counted_as) => {
                    let source = crate::datapath::kernel_keys::key_address(&counted_as.source);
                    let profile = counted_as.profile;
                    tracing::warn!(%source, profile, count, counted, "repaired a drifted connection counter");
                }
                Counter::Global(profile) => {
                    tracing::warn!(
                        profile,
                        count,
                        counted,
                        "repaired a drifted global connection counter"
                    );
                }
            }
        }
        self.suspects = verdict.seen;
        Ok(verdict.repairs.len() as u64)
    }
}

/// What a pass knows of the host to tell whether a connection came in through the programs:
/// its own addresses, the protected interfaces' indexes, and the way back to each peer
/// looked up so far (one query per peer and pass).
#[derive(Default)]
struct HostRoutes {
    local: LocalAddresses,
    protected: Vec<u32>,
    /// `None` when nothing is judged, or the host's routes are unreadable: then nothing came in.
    queries: Option<RouteQueries>,
    out: HashMap<[u8; 16], Option<u32>>,
}

impl HostRoutes {
    fn read(interfaces: &[String]) -> Self {
        // Routes name interfaces by index; resolved each pass, so one re-created under its
        // name is still found.
        let protected: Vec<u32> = interfaces
            .iter()
            .filter_map(|name| nix::net::if_::if_nametoindex(name.as_str()).ok())
            .collect();
        if protected.is_empty() {
            return Self::default();
        }
        let read = LocalAddresses::read().and_then(|local| Ok((local, RouteQueries::open()?)));
        match read {
            Ok((local, queries)) => Self {
                local,
                protected,
                queries: Some(queries),
                out: HashMap::new(),
            },
            Err(error) => {
                tracing::warn!(%error, "the host's routes are unreadable; nothing is adopted this pass");
                Self::default()
            }
        }
    }

    fn came_in(&mut self, flow: &FlowKey) -> bool {
        let Some(queries) = &self.queries else {
            return false;
        };
        let out = &mut self.out;
        sweep_rules::came_in(flow, &self.local, &self.protected, |remote| {
            *out.entry(*remote)
                .or_insert_with(|| match queries.out_interface(remote) {
                    Ok(index) => index,
                    Err(error) => {
                        tracing::warn!(%error, "the route back to a peer is unreadable; it is not adopted this pass");
                        None
                    }
                })
        })
    }
}

/// Kernel escalation: each source whose streak of refusals at its proven handshakes lasted
/// past `escalate-refused-for` is handed to the broker limiter's escalation, which bans it
/// (a repeat offender's ban longer; in monitor mode, counted and not placed), and its streak
/// forgotten; a streak that paused short of it is forgotten. Returns how many were handed.
fn escalate(enforcer: &Enforcer, limiter: &Limiter, now: u64) -> Result<u64, EnforceError> {
    let Some(refused_for) = limiter.escalation_config().and_then(|c| c.refused_for) else {
        return Ok(0);
    };
    let mut escalated = 0;
    for (source, offense) in enforcer.with_maps(|m| m.offenders())? {
        match sweep_rules::judge_streak(offense.first_ns, offense.last_ns, now, refused_for) {
            Streak::Escalate(refused) => {
                let addr = crate::datapath::kernel_keys::key_address(&source);
                tracing::warn!(%addr, ?refused, refusals = offense.refusals, "refused at its handshakes past escalate-refused-for");
                limiter.report_refused(addr, refused, offense.monitored != 0);
                escalated += 1;
            }
            Streak::Over => {}
            Streak::Going => continue,
        }
        enforcer.with_maps(|m| m.forget_offender(&source))?;
    }
    Ok(escalated)
}

/// Every connection counter: each source's in each profile, and each profile's global one.
fn counters(enforcer: &Enforcer) -> Result<HashMap<Counter, u64>, EnforceError> {
    let mut out: HashMap<Counter, u64> = enforcer
        .with_maps(|m| m.all_source_connections())?
        .into_iter()
        .map(|(source, n)| (Counter::Source(source), n))
        .collect();
    let globals = enforcer.with_maps(|m| m.profile_connections())?;
    out.extend(
        (0..PROFILE_SLOTS)
            .zip(globals)
            .map(|(slot, n)| (Counter::Global(slot), n)),
    );
    Ok(out)
}

/// What the sweeper works on: the datapath, the broker limiter, its metrics, and the live
/// settings (re-read before every pass, so SIGHUP changes the interval and timeouts).
pub struct SweepTargets {
    /// The interfaces the programs are attached to (see [`Sweeper::for_interfaces`]).
    pub interfaces: Vec<String>,
    pub enforcer: Arc<Enforcer>,
    pub limiter: Arc<Limiter>,
    pub stats: SweepStats,
    pub settings: Live,
}

/// Runs passes every `sweep.interval` until `shutdown` resolves.
pub async fn run(targets: SweepTargets, shutdown: impl std::future::Future<Output = ()>) {
    let mut sweeper = Sweeper::for_interfaces(targets.interfaces.clone());
    tokio::pin!(shutdown);
    loop {
        let settings = targets.settings.get().sweep;
        tokio::select! {
            _ = &mut shutdown => return,
            _ = tokio::time::sleep(settings.interval) => {}
        }
        let result = tokio::task::block_in_place(|| {
            sweeper.pass(
                &targets.enforcer,
                &targets.limiter,
                &targets.stats,
                &settings,
            )
        });
        match result {
            Ok(report) if report != PassReport::default() => tracing::debug!(?report, "sweep"),
            Ok(_) => {}
            Err(error) => tracing::warn!(%error, "sweep pass failed"),
        }
    }
}

//! The sweeper: a periodic pass that evicts half-open and idle flows, idle SYN buckets, expired
//! bans and the broker limiter's idle keys, and repairs counters that drifted from the flow
//! table. Each pass does bounded work, resuming where the last one stopped.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use limiter_common::{AdjustRequest, SourceKey, flow_state};
use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, Opts};

use crate::{
    buckets::Limiter,
    datapath::{EnforceError, Enforcer, SweepCursor, keys::boot_time_ns},
    settings::{Live, SweepSettings},
};

/// What the sweeper has done, as Prometheus metrics (registered by the metrics module).
#[derive(Clone)]
pub struct SweepStats {
    /// By kind: `half_open`, `idle`, `syn_bucket`, `ban`, `app_key`.
    pub evictions: IntCounterVec,
    pub repairs: IntCounter,
    pub duration: Histogram,
}

/// The `kind` label values of `limiter_evictions_total`, in the order a pass reports them.
const EVICTION_KINDS: [&str; 5] = ["half_open", "idle", "syn_bucket", "ban", "app_key"];

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
    pub half_open: u64,
    pub idle: u64,
    pub buckets: u64,
    pub bans: u64,
    pub app_keys: u64,
    pub repairs: u64,
}

/// A counter that disagreed with the flow table: (counter read, flows counted).
type Mismatch = (u64, u64);

/// The sweeper's memory between passes.
#[derive(Default)]
pub struct Sweeper {
    cursor: SweepCursor,
    /// Flows per source seen so far in this cycle over the flow table.
    tally: HashMap<SourceKey, u64>,
    /// Whether the current cycle fits in one pass, which is when its tally is a snapshot good
    /// enough to reconcile against.
    single_pass: bool,
    /// Mismatches of the last reconciliation: only a drift seen twice in a row is repaired, so
    /// a connection opening or closing between two reads is never "repaired" into a real drift.
    suspects: HashMap<Option<SourceKey>, Mismatch>,
}

impl Sweeper {
    pub fn new() -> Self {
        Self {
            single_pass: true,
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
        let now = boot_time_ns()?;
        let batch = settings.batch as usize;
        let flows = enforcer.with_maps(|m| m.flow_batch(&mut self.cursor, batch))?;
        for (key, flow) in &flows.flows {
            let half_open = flow.state & flow_state::ESTABLISHED == 0
                && older_than(now, flow.first_seen_ns, settings.syn_timeout);
            let idle = older_than(now, flow.last_seen_ns, settings.idle_timeout);
            if half_open || idle {
                // Released through the kernel, so it happens once even if a FIN races it.
                if enforcer.datapath().release(key)? {
                    if half_open {
                        report.half_open += 1;
                    } else {
                        report.idle += 1;
                    }
                }
            } else {
                *self.tally.entry(flow.source).or_default() += 1;
            }
        }
        if flows.wrapped {
            if self.single_pass {
                report.repairs = self.reconcile(enforcer)?;
            }
            self.tally.clear();
            self.single_pass = true;
        } else {
            self.single_pass = false;
        }
        report.buckets = enforcer.with_maps(|m| m.sweep_buckets(&mut self.cursor, batch, now))?;
        report.bans = enforcer.with_maps(|m| m.sweep_bans(&mut self.cursor, batch, now))?;
        report.app_keys = limiter.sweep() as u64;
        let counts = [
            report.half_open,
            report.idle,
            report.buckets,
            report.bans,
            report.app_keys,
        ];
        for (kind, n) in EVICTION_KINDS.into_iter().zip(counts) {
            stats.evictions.with_label_values(&[kind]).inc_by(n);
        }
        stats.repairs.inc_by(report.repairs);
        stats.duration.observe(started.elapsed().as_secs_f64());
        Ok(report)
    }

    /// Compares every counter with the flows counted this cycle and repairs drift seen twice.
    fn reconcile(&mut self, enforcer: &Enforcer) -> Result<u64, EnforceError> {
        let counters = enforcer.with_maps(|m| m.all_source_connections())?;
        let global = enforcer.with_maps(|m| m.global_connections())?;
        let mut seen: HashMap<Option<SourceKey>, Mismatch> = HashMap::new();
        for (source, count) in &counters {
            let counted = self.tally.get(source).copied().unwrap_or(0);
            if *count != counted {
                seen.insert(Some(*source), (*count, counted));
            } else if *count == 0 {
                enforcer.with_maps(|m| m.remove_idle_source(source))?;
            }
        }
        for (source, counted) in &self.tally {
            if !counters.iter().any(|(s, _)| s == source) {
                seen.insert(Some(*source), (0, *counted));
            }
        }
        let total: u64 = self.tally.values().sum();
        if global != total {
            seen.insert(None, (global, total));
        }
        let mut repairs = 0;
        for (who, mismatch) in &seen {
            if self.suspects.get(who) != Some(mismatch) {
                continue;
            }
            let (count, counted) = *mismatch;
            let request = AdjustRequest {
                source: who.unwrap_or(SourceKey { addr: [0; 16] }),
                delta: counted as i64 - count as i64,
                global: who.is_none().into(),
                _pad: 0,
            };
            enforcer.datapath().adjust(&request)?;
            tracing::warn!(source = ?who.map(|s| crate::datapath::keys::key_address(&s)), count, counted, "repaired a drifted connection counter");
            repairs += 1;
        }
        self.suspects = seen;
        Ok(repairs)
    }
}

fn older_than(now: u64, then: u64, age: Duration) -> bool {
    now.saturating_sub(then) > age.as_nanos().min(u64::MAX as u128) as u64
}

/// What the sweeper works on: the datapath, the broker limiter, its metrics, and the live
/// settings (re-read before every pass, so SIGHUP changes the interval and timeouts).
pub struct SweepTargets {
    pub enforcer: Arc<Enforcer>,
    pub limiter: Arc<Limiter>,
    pub stats: SweepStats,
    pub settings: Live,
}

/// Runs passes every `sweep.interval` until `shutdown` resolves.
pub async fn run(targets: SweepTargets, shutdown: impl std::future::Future<Output = ()>) {
    let mut sweeper = Sweeper::new();
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

//! The limiter core: every action's buckets, the check itself, eviction and the figures the
//! agent exports.
//!
//! Buckets live in a sharded map per action. A check on a tracked key takes a shared lock on
//! one shard and a compare-and-swap on the key's TAT, so checks on different keys, and even on
//! the same key, run in parallel on every core; only a key's first check takes a shard's write
//! lock.

use std::{
    net::IpAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use dashmap::{DashMap, mapref::entry::Entry};
use limiter_client::{Escalation, NEVER_MS, Outcome, Verdict};

use crate::api::BlockedKey;

use super::{
    actions::{ActionSpec, KeyKind, Mode},
    ban::{BanError, Banner},
    clock::{Clock, ns_to_ms_ceil},
    escalation::{EscalationConfig, EscalationStats, Escalator},
    gcra::{Cell, Evaluation, Rate},
    keys::{self, KeyError, StoredKey},
    stats::{ActionStats, OutcomeCounters},
};

/// Everything the limiter needs to start; see `protocol::AppArgs` for where it comes from.
#[derive(Clone, Debug)]
pub struct LimiterConfig {
    pub actions: Vec<ActionSpec>,
    pub escalation: Option<EscalationConfig>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CheckError {
    #[error("unknown action {0:?}")]
    UnknownAction(String),
    #[error("invalid key for action {action:?}: {source}")]
    InvalidKey {
        action: String,
        #[source]
        source: KeyError,
    },
    #[error("a cost must be at least 1")]
    ZeroCost,
}

#[derive(Default)]
struct Bucket {
    cell: Cell,
    /// Refusals since the bucket was created; reaped with it.
    blocked: AtomicU64,
}

struct Action {
    spec: ActionSpec,
    mode: Mode,
    buckets: DashMap<Box<[u8]>, Bucket>,
    /// Shared by every new key that arrives while `buckets` holds `max_keys`.
    overflow: Bucket,
    tracked: AtomicUsize,
    outcomes: OutcomeCounters,
    overflow_checks: AtomicU64,
}

pub struct Limiter {
    clock: Arc<dyn Clock>,
    /// A handful of actions: a scan comparing names beats hashing the name.
    actions: Vec<Action>,
    escalator: Option<Escalator>,
    banner: Arc<dyn Banner>,
}

impl Limiter {
    pub fn new(config: LimiterConfig, clock: Arc<dyn Clock>, banner: Arc<dyn Banner>) -> Self {
        let actions: Vec<Action> = config
            .actions
            .into_iter()
            .map(|spec| Action {
                mode: spec.mode(),
                spec,
                buckets: DashMap::new(),
                overflow: Bucket::default(),
                tracked: AtomicUsize::new(0),
                outcomes: OutcomeCounters::default(),
                overflow_checks: AtomicU64::new(0),
            })
            .collect();
        let escalator = config
            .escalation
            .map(|c| Escalator::new(c, clock.clone(), banner.clone()));
        Self {
            clock,
            actions,
            escalator,
            banner,
        }
    }

    pub fn actions(&self) -> impl Iterator<Item = &ActionSpec> {
        self.actions.iter().map(|a| &a.spec)
    }

    /// Spends `cost` tokens of `key`'s bucket if it holds them; a refusal spends nothing.
    pub fn check(&self, action: &str, key: &[u8], cost: u32) -> Result<Verdict, CheckError> {
        self.decide(action, key, cost, true, true)
    }

    /// `check` for callers outside the broker's trust boundary (the HTTP endpoint, which any
    /// local user can reach): it spends and counts the same, but its refusals never escalate,
    /// so such a caller cannot get someone else's address banned in the kernel.
    pub fn check_unescalated(
        &self,
        action: &str,
        key: &[u8],
        cost: u32,
    ) -> Result<Verdict, CheckError> {
        self.decide(action, key, cost, true, false)
    }

    /// What `check` would answer, spending nothing and counting nothing.
    pub fn peek(&self, action: &str, key: &[u8], cost: u32) -> Result<Verdict, CheckError> {
        self.decide(action, key, cost, false, false)
    }

    /// Forgets a key's bucket, so its next check finds it full. `Ok(false)` if it had none.
    pub fn reset(&self, action: &str, key: &[u8]) -> Result<bool, CheckError> {
        let (action, stored) = self.resolve(action, key)?;
        let removed = action.buckets.remove(stored.as_bytes()).is_some();
        if removed {
            action.tracked.fetch_sub(1, Ordering::AcqRel);
        }
        Ok(removed)
    }

    /// A failed authentication reported by the broker: counts towards escalation.
    pub fn report_auth_failure(&self, addr: IpAddr) -> Escalation {
        self.escalator
            .as_ref()
            .map_or(Escalation::Off, |e| e.record_failure(addr))
    }

    pub fn ban(&self, addr: IpAddr, ttl: Duration) -> Result<(), BanError> {
        self.banner.ban(addr.to_canonical(), ttl)
    }

    /// Lifts a ban and forgets the address's failures, so it starts again from a clean slate.
    pub fn unban(&self, addr: IpAddr) -> Result<bool, BanError> {
        if let Some(escalator) = &self.escalator {
            escalator.forget(addr);
        }
        self.banner.unban(addr.to_canonical())
    }

    /// Evicts buckets that are full again (they hold nothing a fresh bucket would not) and
    /// idle escalation records; returns how many entries went. The agent calls it periodically.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now_ns();
        let mut removed = 0;
        for action in &self.actions {
            let mut gone = 0;
            action.buckets.retain(|_, bucket| {
                let keep = !Rate::is_full(bucket.cell.tat(), now);
                gone += usize::from(!keep);
                keep
            });
            action.tracked.fetch_sub(gone, Ordering::AcqRel);
            removed += gone;
        }
        removed + self.escalator.as_ref().map_or(0, Escalator::sweep)
    }

    pub fn stats(&self) -> Vec<ActionStats> {
        self.actions
            .iter()
            .map(|a| {
                let count = |o| a.outcomes.get(o);
                ActionStats {
                    action: a.spec.name.clone(),
                    allowed: count(Outcome::Allowed),
                    unlimited: count(Outcome::Unlimited),
                    limited: count(Outcome::Limited),
                    cost_exceeds_burst: count(Outcome::CostExceedsBurst),
                    closed: count(Outcome::Closed),
                    blocked: count(Outcome::Limited)
                        + count(Outcome::CostExceedsBurst)
                        + count(Outcome::Closed),
                    tracked_keys: a.tracked.load(Ordering::Acquire),
                    overflow_checks: a.overflow_checks.load(Ordering::Relaxed),
                }
            })
            .collect()
    }

    pub fn escalation_stats(&self) -> Option<EscalationStats> {
        self.escalator.as_ref().map(Escalator::stats)
    }

    pub fn escalation_config(&self) -> Option<EscalationConfig> {
        self.escalator.as_ref().map(Escalator::config)
    }

    /// The `n` keys of `action` refused most often while their buckets were live.
    pub fn top_blocked(&self, action: &str, n: usize) -> Result<Vec<BlockedKey>, CheckError> {
        let action = self.action(action)?;
        let mut blocked: Vec<(u64, Box<[u8]>)> = action
            .buckets
            .iter()
            .filter_map(|entry| {
                let count = entry.value().blocked.load(Ordering::Relaxed);
                (count > 0).then(|| (count, entry.key().clone()))
            })
            .collect();
        blocked.sort_unstable_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        Ok(blocked
            .into_iter()
            .take(n)
            .map(|(count, key)| BlockedKey {
                key: keys::display(action.spec.key, &key),
                blocked: count,
            })
            .collect())
    }

    fn action(&self, name: &str) -> Result<&Action, CheckError> {
        self.actions
            .iter()
            .find(|a| a.spec.name == name)
            .ok_or_else(|| CheckError::UnknownAction(name.to_owned()))
    }

    fn resolve<'k>(
        &self,
        name: &str,
        key: &'k [u8],
    ) -> Result<(&Action, StoredKey<'k>), CheckError> {
        let action = self.action(name)?;
        let stored =
            keys::store(action.spec.key, key).map_err(|source| CheckError::InvalidKey {
                action: name.to_owned(),
                source,
            })?;
        Ok((action, stored))
    }

    fn decide(
        &self,
        name: &str,
        key: &[u8],
        cost: u32,
        consume: bool,
        escalate: bool,
    ) -> Result<Verdict, CheckError> {
        if cost == 0 {
            return Err(CheckError::ZeroCost);
        }
        let (action, stored) = self.resolve(name, key)?;
        let limit = action.spec.limit;
        let verdict = match action.mode {
            Mode::Unlimited => Verdict::new(Outcome::Unlimited, 0, u32::MAX, 0, 0),
            Mode::Closed => Verdict::new(Outcome::Closed, 0, 0, NEVER_MS, NEVER_MS),
            Mode::Limited(rate) => {
                let now = self.clock.now_ns();
                let evaluation = self.evaluate(action, &rate, &stored, now, cost, consume);
                let outcome = if evaluation.allowed {
                    Outcome::Allowed
                } else if cost > rate.burst() {
                    Outcome::CostExceedsBurst
                } else {
                    Outcome::Limited
                };
                Verdict::new(
                    outcome,
                    limit,
                    evaluation.remaining,
                    if evaluation.retry_after_ns == u64::MAX {
                        NEVER_MS
                    } else {
                        ns_to_ms_ceil(evaluation.retry_after_ns)
                    },
                    ns_to_ms_ceil(evaluation.reset_after_ns),
                )
            }
        };
        if consume {
            action.outcomes.add(verdict.outcome);
            if !verdict.allowed
                && escalate
                && action.spec.escalate
                && action.spec.key == KeyKind::Ip
                && let (Some(escalator), Some(addr)) = (&self.escalator, stored.address())
            {
                escalator.record_failure(addr);
            }
        }
        Ok(verdict)
    }

    fn evaluate(
        &self,
        action: &Action,
        rate: &Rate,
        key: &StoredKey<'_>,
        now: u64,
        cost: u32,
        consume: bool,
    ) -> Evaluation {
        let settle = |bucket: &Bucket| {
            let evaluation = bucket.cell.take(rate, now, cost, consume);
            if consume && !evaluation.allowed {
                bucket.blocked.fetch_add(1, Ordering::Relaxed);
            }
            evaluation
        };
        if let Some(bucket) = action.buckets.get(key.as_bytes()) {
            return settle(&bucket);
        }
        if !consume {
            // An untracked key has a full bucket; nothing is created to answer a peek.
            return rate.evaluate(0, now, cost);
        }
        // Claim a slot under the cap before inserting, so the cap holds under races.
        if action.tracked.fetch_add(1, Ordering::AcqRel) >= action.spec.max_keys {
            action.tracked.fetch_sub(1, Ordering::AcqRel);
            action.overflow_checks.fetch_add(1, Ordering::Relaxed);
            return settle(&action.overflow);
        }
        match action.buckets.entry(key.as_bytes().into()) {
            Entry::Occupied(occupied) => {
                // Another check inserted it first; give the slot back.
                action.tracked.fetch_sub(1, Ordering::AcqRel);
                settle(occupied.get())
            }
            Entry::Vacant(vacant) => settle(&vacant.insert(Bucket::default())),
        }
    }
}

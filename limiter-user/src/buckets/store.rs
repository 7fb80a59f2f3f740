//! The limiter core: every action's buckets, the check itself, eviction and the figures the
//! agent exports.
//!
//! Buckets live in a sharded map per action. A check on a tracked key takes a shared lock on
//! one shard and a compare-and-swap on the key's TAT, so checks on different keys, and even on
//! the same key, run in parallel on every core; only a key's first check takes a shard's write
//! lock. Keys are fixed-size ([`StoredKey`]) and hashed with a per-map random seed, so a check
//! allocates nothing and a flood of chosen keys cannot aim at one hash chain.
//!
//! **Key-cap pressure.** When an action tracks `max_keys` keys, a new key first makes room:
//! buckets that are full again hold nothing a fresh one would not, so they are evicted (one
//! pass at most every [`CAP_SWEEP_EVERY`]). When every tracked bucket is still spending (the
//! degraded mode), the new key is answered as the fresh bucket it would get, without being
//! tracked, and counted in `overflow_checks`: a key that has not itself gone over its limit is
//! never refused, and such a verdict never escalates into a ban.

use std::{
    net::IpAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use dashmap::{DashMap, mapref::entry::Entry};
use foldhash::quality::RandomState;
use limiter_client::{Escalation, NEVER_MS, Outcome, Verdict};

use crate::api::BlockedKey;

use super::{
    actions::{ActionSpec, KeyKind, Mode},
    ban::{BanError, Banner, SharedBanStats},
    cell::{Algorithm, Cell, Evaluation},
    clock::{Clock, ns_to_ms_ceil},
    escalation::{EscalationConfig, EscalationStats, Escalator},
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

/// The least time between two cap sweeps of one action: a flood of new keys into a full
/// action of hot buckets costs one pass over the map per interval, not one per check.
pub const CAP_SWEEP_EVERY: Duration = Duration::from_millis(100);

/// What one slot of a key table costs: the entry (key and bucket) and its control byte.
const SLOT_BYTES: usize = std::mem::size_of::<(StoredKey, Bucket)>() + 1;

/// What one tracked key costs at most: a table holds 7 keys per 8 slots when it grows, and
/// doubles, so it is never less than 7/16 used (and shrinks when sweeping leaves it less
/// than half used).
pub const BYTES_PER_KEY: usize = SLOT_BYTES * 16 / 7;

#[derive(Default)]
pub struct Bucket {
    cell: Cell,
    /// Refusals since the bucket was created; reaped with it.
    blocked: AtomicU64,
}

/// An action resolved once by name, for callers that check the same action many times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActionId(usize);

struct Action {
    spec: ActionSpec,
    mode: Mode,
    buckets: DashMap<StoredKey, Bucket, RandomState>,
    tracked: AtomicUsize,
    outcomes: OutcomeCounters,
    overflow_checks: AtomicU64,
    /// When the last cap sweep ran (clock ns + 1; 0 = never).
    cap_swept: AtomicU64,
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
                buckets: DashMap::with_hasher(RandomState::default()),
                tracked: AtomicUsize::new(0),
                outcomes: OutcomeCounters::default(),
                overflow_checks: AtomicU64::new(0),
                cap_swept: AtomicU64::new(0),
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

    /// The action named `name`, resolved once for [`Limiter::check_id`].
    pub fn action_id(&self, name: &str) -> Result<ActionId, CheckError> {
        self.actions
            .iter()
            .position(|a| a.spec.name == name)
            .map(ActionId)
            .ok_or_else(|| CheckError::UnknownAction(name.to_owned()))
    }

    /// Spends `cost` tokens of `key`'s bucket if it holds them; a refusal spends nothing.
    pub fn check(&self, action: &str, key: &[u8], cost: u32) -> Result<Verdict, CheckError> {
        self.decide(self.action_id(action)?, key, cost, true, true)
    }

    /// `check` for an action resolved with [`Limiter::action_id`].
    pub fn check_id(&self, action: ActionId, key: &[u8], cost: u32) -> Result<Verdict, CheckError> {
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
        self.decide(self.action_id(action)?, key, cost, true, false)
    }

    /// What `check` would answer, spending nothing and counting nothing.
    pub fn peek(&self, action: &str, key: &[u8], cost: u32) -> Result<Verdict, CheckError> {
        self.decide(self.action_id(action)?, key, cost, false, false)
    }

    /// Forgets a key's bucket, so its next check finds it full. `Ok(false)` if it had none.
    pub fn reset(&self, action: &str, key: &[u8]) -> Result<bool, CheckError> {
        let (action, stored) = self.resolve(self.action_id(action)?, key)?;
        let removed = action.buckets.remove(&stored).is_some();
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
        let mut removed = 0;
        for action in &self.actions {
            removed += action.evict_idle(action.now(&*self.clock));
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
                    cost_exceeds_limit: count(Outcome::CostExceedsLimit),
                    closed: count(Outcome::Closed),
                    blocked: count(Outcome::Limited)
                        + count(Outcome::CostExceedsBurst)
                        + count(Outcome::CostExceedsLimit)
                        + count(Outcome::Closed),
                    tracked_keys: a.tracked.load(Ordering::Acquire),
                    overflow_checks: a.overflow_checks.load(Ordering::Relaxed),
                    // `capacity` counts usable slots, 7 of every 8.
                    key_memory_bytes: a.buckets.capacity() * SLOT_BYTES * 8 / 7,
                }
            })
            .collect()
    }

    /// What the banner shared with the fleet (zero without one).
    pub fn shared_ban_stats(&self) -> SharedBanStats {
        self.banner.shared_stats()
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
        let mut blocked: Vec<(u64, StoredKey)> = action
            .buckets
            .iter()
            .filter_map(|entry| {
                let count = entry.value().blocked.load(Ordering::Relaxed);
                (count > 0).then(|| (count, *entry.key()))
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
        self.action_id(name).map(|ActionId(i)| &self.actions[i])
    }

    fn resolve(
        &self,
        ActionId(id): ActionId,
        key: &[u8],
    ) -> Result<(&Action, StoredKey), CheckError> {
        let action = &self.actions[id];
        let stored =
            keys::store(action.spec.key, key).map_err(|source| CheckError::InvalidKey {
                action: action.spec.name.clone(),
                source,
            })?;
        Ok((action, stored))
    }

    fn decide(
        &self,
        id: ActionId,
        key: &[u8],
        cost: u32,
        consume: bool,
        escalate: bool,
    ) -> Result<Verdict, CheckError> {
        if cost == 0 {
            return Err(CheckError::ZeroCost);
        }
        let (action, stored) = self.resolve(id, key)?;
        let now = || action.now(&*self.clock);
        let (verdict, tracked) = match action.mode {
            Mode::Unlimited => (Verdict::new(Outcome::Unlimited, 0, u32::MAX, 0, 0), true),
            Mode::Closed => (
                Verdict::new(Outcome::Closed, 0, 0, NEVER_MS, NEVER_MS),
                true,
            ),
            Mode::Limited(rate) => Self::settle(action, &rate, &stored, now(), cost, consume),
            Mode::Quota(quota) => Self::settle(action, &quota, &stored, now(), cost, consume),
        };
        if consume {
            action.outcomes.add(verdict.outcome);
            if !verdict.allowed
                && escalate
                && tracked
                && action.spec.escalate
                && action.spec.key == KeyKind::Ip
                && let (Some(escalator), Some(addr)) = (&self.escalator, stored.address())
            {
                escalator.record_failure(addr);
            }
        }
        Ok(verdict)
    }

    /// The verdict of `algorithm` for `key`; the flag says whether the key is tracked (false
    /// for a peek of an unknown key and for the degraded mode of a full action).
    fn settle<A: Algorithm>(
        action: &Action,
        algorithm: &A,
        key: &StoredKey,
        now: u64,
        cost: u32,
        consume: bool,
    ) -> (Verdict, bool) {
        let (evaluation, tracked) = Self::evaluate(action, algorithm, key, now, cost, consume);
        let outcome = if evaluation.allowed {
            Outcome::Allowed
        } else if cost > algorithm.capacity() {
            A::OVERSIZED
        } else {
            Outcome::Limited
        };
        let verdict = Verdict::new(
            outcome,
            action.spec.limit,
            evaluation.remaining,
            if evaluation.retry_after_ns == u64::MAX {
                NEVER_MS
            } else {
                ns_to_ms_ceil(evaluation.retry_after_ns)
            },
            ns_to_ms_ceil(evaluation.reset_after_ns),
        );
        (verdict, tracked)
    }

    /// Settles `key`'s cell, creating it under the key cap when `consume` is set.
    fn evaluate(
        action: &Action,
        algorithm: &impl Algorithm,
        key: &StoredKey,
        now: u64,
        cost: u32,
        consume: bool,
    ) -> (Evaluation, bool) {
        let settle = |bucket: &Bucket| {
            let evaluation = bucket.cell.take(algorithm, now, cost, consume);
            if consume && !evaluation.allowed {
                bucket.blocked.fetch_add(1, Ordering::Relaxed);
            }
            (evaluation, true)
        };
        if let Some(bucket) = action.buckets.get(key) {
            return settle(&bucket);
        }
        if !consume {
            // An untracked key is fresh; nothing is created to answer a peek.
            return (algorithm.evaluate(0, now, cost), false);
        }
        if !action.claim_slot(now) {
            // Degraded mode: answered as the fresh key it would get, never refused for
            // others' spending.
            action.overflow_checks.fetch_add(1, Ordering::Relaxed);
            return (algorithm.evaluate(0, now, cost), false);
        }
        match action.buckets.entry(*key) {
            Entry::Occupied(occupied) => {
                // Another check inserted it first; give the slot back.
                action.tracked.fetch_sub(1, Ordering::AcqRel);
                settle(occupied.get())
            }
            Entry::Vacant(vacant) => settle(&vacant.insert(Bucket::default())),
        }
    }
}

impl Action {
    /// The time the action's algorithm counts in: a rate the monotonic clock, a quota the
    /// calendar.
    fn now(&self, clock: &dyn Clock) -> u64 {
        match self.mode {
            Mode::Quota(_) => clock.unix_ns(),
            Mode::Limited(_) | Mode::Unlimited | Mode::Closed => clock.now_ns(),
        }
    }

    /// Whether a key in `state` holds nothing a fresh key would not.
    fn is_idle(&self, state: u64, now: u64) -> bool {
        match &self.mode {
            Mode::Limited(rate) => rate.is_idle(state, now),
            Mode::Quota(quota) => quota.is_idle(state, now),
            Mode::Unlimited | Mode::Closed => true,
        }
    }

    /// Claims a slot under the cap before inserting, so the cap holds under races; a full
    /// action first evicts its buckets that are full again (at most once per
    /// [`CAP_SWEEP_EVERY`]).
    fn claim_slot(&self, now: u64) -> bool {
        for attempt in 0..2 {
            if self.tracked.fetch_add(1, Ordering::AcqRel) < self.spec.max_keys {
                return true;
            }
            self.tracked.fetch_sub(1, Ordering::AcqRel);
            let last = self.cap_swept.load(Ordering::Acquire);
            let due =
                last == 0 || now.saturating_sub(last - 1) >= CAP_SWEEP_EVERY.as_nanos() as u64;
            let ours = attempt == 0
                && due
                && self
                    .cap_swept
                    .compare_exchange(last, now + 1, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok();
            if !ours || self.evict_idle(now) == 0 {
                return false;
            }
        }
        false
    }

    /// Evicts the keys that hold nothing a fresh one would not (buckets full again, quotas
    /// past their window) and gives the table's memory back when it is less than half used;
    /// returns how many went.
    fn evict_idle(&self, now: u64) -> usize {
        let mut gone = 0;
        self.buckets.retain(|_, bucket| {
            let keep = !self.is_idle(bucket.cell.state(), now);
            gone += usize::from(!keep);
            keep
        });
        self.tracked.fetch_sub(gone, Ordering::AcqRel);
        if gone > 0 && self.buckets.capacity() > 2 * self.buckets.len() {
            self.buckets.shrink_to_fit();
        }
        gone
    }
}

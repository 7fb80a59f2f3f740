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
//!
//! **Reload.** [`Limiter::reconfigure`] applies new actions and escalation settings while
//! checks run. An action's settings are immutable: a reload builds a new [`Action`] that
//! shares the old one's counters and, when its key kind is unchanged, its buckets (so every
//! key keeps its state, and is judged by the new settings from then on). The old action points
//! to its successor, or says it was removed, so an [`ActionId`] resolved before a reload
//! follows it with one load per check.
//!
//! **Shared actions.** With a [`SharedBuckets`] store (the fleet's Redis), an action marked
//! `shared` is checked there through [`Limiter::submit`], the one bucket for the whole fleet.
//! When the store cannot answer, the check is decided here at the action's fallback rate
//! (limit and burst divided by the expected replicas), in the same key table, so the key cap
//! bounds it too. The synchronous checks decide shared actions that way as well.

use std::{
    net::IpAddr,
    sync::{
        Arc, OnceLock, RwLock,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use dashmap::{DashMap, mapref::entry::Entry};
use foldhash::quality::RandomState;
use limiter_client::{Escalation, NEVER_MS, Outcome, Verdict};

use crate::{
    api::{ActionCounts, BlockedKey},
    duration_units::duration_ns,
    events::{self, Event},
};

use super::{
    action_stats::{ActionStats, OutcomeCounters},
    actions::{ActionKind, ActionSpec, Enforcement, KeyKind, Mode},
    ban::{BanError, Banner, SharedBanStats},
    bucket_keys::{self, KeyError, StoredKey},
    calendar_quota::Quota,
    cell::{Algorithm, Cell, Evaluation},
    clock::{Clock, ns_to_ms_ceil},
    escalation::{EscalationConfig, EscalationStats, Escalator},
    gcra::Rate,
    sessions::{OwnerHandle, Released, SessionCounts, SessionOwner},
    shared_store::{Pending, SessionLease, SharedBuckets, SharedCheck, SharedLimit},
    strikes::{StrikeBook, Struck},
};

/// Everything the limiter needs to start; `settings::broker` resolves it from the settings.
#[derive(Clone, Debug)]
pub struct LimiterConfig {
    pub actions: Vec<ActionSpec>,
    pub escalation: Option<EscalationConfig>,
    /// The top-level `mode`: every action's that sets none, and escalation's.
    pub mode: Enforcement,
}

impl LimiterConfig {
    /// The event-log lines of a reload from these settings to `new`: the top-level `mode`
    /// once if it changed, and each action kept whose own `mode` changes what it runs as
    /// (one that follows the top level changes with it, and is not named again).
    pub fn mode_changes(&self, new: &LimiterConfig) -> Vec<Event> {
        let mut changes = Vec::new();
        if self.mode != new.mode {
            changes.push(Event::Mode {
                action: None,
                from: self.mode.as_str(),
                to: new.mode.as_str(),
            });
        }
        for action in &new.actions {
            let Some(old) = self.actions.iter().find(|a| a.name == action.name) else {
                continue;
            };
            if old.mode.is_none() && action.mode.is_none() {
                continue;
            }
            let (from, to) = (
                old.mode.unwrap_or(self.mode),
                action.mode.unwrap_or(new.mode),
            );
            if from != to {
                changes.push(Event::Mode {
                    action: Some(action.name.clone()),
                    from: from.as_str(),
                    to: to.as_str(),
                });
            }
        }
        changes
    }
}

/// A check's verdict as judged, and whether the action is in monitor mode: then a refusal is
/// counted as one but answered as an allowance ([`Judged::enforced`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Judged {
    pub verdict: Verdict,
    pub monitored: bool,
}

impl Judged {
    /// What the caller acts on: the verdict, or in monitor mode an allowance with the
    /// bucket's numbers.
    pub fn enforced(&self) -> Verdict {
        match self.would_refuse() {
            Some(_) => Verdict::new(
                Outcome::Allowed,
                self.verdict.limit,
                self.verdict.remaining,
                0,
                self.verdict.reset_after_ms,
            ),
            None => self.verdict,
        }
    }

    /// The refusal enforcement would have answered, in monitor mode.
    pub fn would_refuse(&self) -> Option<Outcome> {
        (self.monitored && !self.verdict.allowed).then_some(self.verdict.outcome)
    }
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
    #[error("action {0:?} is not of kind concurrency: it has no sessions")]
    NotConcurrency(String),
}

/// A concurrency action's verdict: `held` sessions of `max` after the request (or before a
/// refused one); a refused session waits for a release, whose time nobody knows.
fn sessions_verdict(fits: bool, max: u32, held: u32) -> Verdict {
    if fits {
        Verdict::new(Outcome::Allowed, max, max.saturating_sub(held), 0, 0)
    } else {
        Verdict::new(Outcome::Limited, max, 0, NEVER_MS, NEVER_MS)
    }
}

/// The outcomes that refuse.
const REFUSALS: [Outcome; 6] = [
    Outcome::Limited,
    Outcome::CostExceedsBurst,
    Outcome::CostExceedsLimit,
    Outcome::Closed,
    Outcome::Disconnect,
    Outcome::PayloadTooLarge,
];

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

/// An action resolved once by name, for callers that check the same action many times. It
/// follows the action through reloads: a check through it applies the settings in force, and
/// fails as an unknown action once a reload removed it.
#[derive(Clone)]
pub struct ActionId(Arc<Action>);

impl ActionId {
    /// The action as configured now.
    fn current(&self) -> Result<&Arc<Action>, CheckError> {
        let mut action = &self.0;
        while let Some(next) = action.next.get() {
            action = next
                .as_ref()
                .ok_or_else(|| CheckError::UnknownAction(action.spec.name.clone()))?;
        }
        Ok(action)
    }
}

/// What a key is judged by: the action's limits, or a key override's.
#[derive(Clone, Copy, Debug)]
struct Limits {
    /// The limit itself: this agent's, or the fleet's for a shared action.
    mode: Mode,
    /// What this agent decides by itself: `mode`, or for a shared action its fallback share.
    local: Mode,
    /// The limit `mode` enforces, reported in the fleet's verdicts.
    limit: u32,
    /// The limit `local` enforces, reported in its verdicts.
    local_limit: u32,
}

impl Limits {
    /// `spec`'s limits; with `replicas`, a shared action's fallback share beside them.
    fn of(spec: &ActionSpec, replicas: Option<u32>) -> Self {
        let mode = spec.mode();
        let (mut local, mut local_limit) = (mode, spec.limit);
        if let Some(replicas) = replicas.filter(|_| spec.shared) {
            let share = (spec.limit / replicas.max(1)).max(1);
            match mode {
                Mode::Limited(_) => {
                    if let Some(rate) = Rate::share(spec.limit, spec.window, spec.burst, replicas) {
                        local = Mode::Limited(rate);
                        local_limit = share;
                    }
                }
                Mode::Quota(_) => {
                    if let Some(quota) = Quota::new(share, spec.window) {
                        local = Mode::Quota(quota);
                        local_limit = share;
                    }
                }
                Mode::Sessions(_) => {
                    local = Mode::Sessions(share);
                    local_limit = share;
                }
                Mode::Unlimited | Mode::Closed => {}
            }
        }
        Self {
            mode,
            local,
            limit: spec.limit,
            local_limit,
        }
    }
}

/// One configuration of an action: its settings, fixed, and its state, shared with the
/// configurations before and after it.
struct Action {
    spec: ActionSpec,
    name: Arc<str>,
    /// Every key's limits but the overridden ones'.
    base: Limits,
    /// The keys with limits of their own, by their stored form (so `::ffff:10.0.0.1` finds
    /// the override written `10.0.0.1`, and a session's by its digest). Empty for most
    /// actions, which then never hash a key for it.
    overrides: std::collections::HashMap<StoredKey, Limits>,
    shared: bool,
    /// Monitor mode: refusals are counted, answered as allowances and never escalate.
    monitor: bool,
    table: Arc<KeyTable>,
    counters: Arc<ActionCounters>,
    /// Set by the reload that replaced this configuration: its successor, or `None` when the
    /// action was removed.
    next: OnceLock<Option<Arc<Action>>>,
}

/// An action's buckets. A reload that keeps the key kind keeps the table; one that changes it
/// starts a new one, since keys stored as one kind mean nothing as another.
#[derive(Default)]
struct KeyTable {
    buckets: DashMap<StoredKey, Bucket, RandomState>,
    tracked: AtomicUsize,
    /// When the last cap sweep ran (clock ns + 1; 0 = never).
    cap_swept: AtomicU64,
    /// The strikes of the keys (connections) that have struck, for an action with strikes.
    strikes: StrikeBook,
    /// Each key's sessions held, for a concurrency action.
    sessions: Arc<SessionCounts>,
}

/// An action's counters, exported as Prometheus counters, so they outlive any reload that
/// keeps the action.
#[derive(Default)]
struct ActionCounters {
    outcomes: OutcomeCounters,
    /// Refusals monitor mode answered as allowances, by the refusal's outcome.
    would_refuse: OutcomeCounters,
    overflow_checks: AtomicU64,
    /// Connections strikes closed (each once, when its count reached the threshold).
    strike_disconnects: AtomicU64,
}

/// What a reload did to the actions, by name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ActionChanges {
    /// Settings changed; every key kept its bucket.
    pub changed: Vec<String>,
    /// The key kind changed: the buckets started empty.
    pub rekeyed: Vec<String>,
    pub added: Vec<String>,
    pub removed: Vec<String>,
}

impl ActionChanges {
    pub fn is_empty(&self) -> bool {
        self.changed.is_empty()
            && self.rekeyed.is_empty()
            && self.added.is_empty()
            && self.removed.is_empty()
    }
}

impl Action {
    /// `replicas` is the fleet's expected replicas when a shared store checks the actions
    /// marked `shared`: each then decides locally at its share (limit / replicas) whenever the
    /// store cannot answer.
    fn new(
        spec: ActionSpec,
        table: Arc<KeyTable>,
        counters: Arc<ActionCounters>,
        replicas: Option<u32>,
        mode: Enforcement,
    ) -> Arc<Self> {
        let overrides = spec
            .overrides
            .iter()
            .filter_map(|(key, &limit)| {
                // Checked by the resolve; a key that does not store is no key a check has.
                let stored = bucket_keys::store(spec.key, key.as_bytes()).ok()?;
                Some((stored, Limits::of(&spec.overridden(limit), replicas)))
            })
            .collect();
        Arc::new(Self {
            name: Arc::from(spec.name.as_str()),
            base: Limits::of(&spec, replicas),
            overrides,
            shared: replicas.is_some() && spec.shared,
            monitor: spec.mode.unwrap_or(mode) == Enforcement::Monitor,
            spec,
            table,
            counters,
            next: OnceLock::new(),
        })
    }

    /// The limits `key` is judged by.
    #[inline(always)]
    fn limits(&self, key: &StoredKey) -> &Limits {
        if self.overrides.is_empty() {
            return &self.base;
        }
        self.overrides.get(key).unwrap_or(&self.base)
    }
}

pub struct Limiter {
    clock: Arc<dyn Clock>,
    /// A handful of actions: a scan comparing names beats hashing the name. Replaced whole by
    /// a reload.
    actions: RwLock<Vec<Arc<Action>>>,
    escalator: Escalator,
    banner: Arc<dyn Banner>,
    shared: Option<Arc<dyn SharedBuckets>>,
    /// The top-level mode in force, for actions rebuilt by `shared_by`.
    mode: RwLock<Enforcement>,
}

/// How a check submitted with [`Limiter::submit`] is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Submit {
    /// Spends; refusals count towards escalation (the broker's own checks).
    Check,
    /// Spends, never escalates (callers outside the broker's trust boundary).
    CheckUnescalated,
    /// Spends nothing, counts nothing.
    Peek,
}

impl Limiter {
    pub fn new(config: LimiterConfig, clock: Arc<dyn Clock>, banner: Arc<dyn Banner>) -> Self {
        let actions = config
            .actions
            .into_iter()
            .map(|spec| Action::new(spec, Arc::default(), Arc::default(), None, config.mode))
            .collect();
        let escalator = Escalator::new(config.escalation, clock.clone(), banner.clone());
        escalator.set_monitor(config.mode == Enforcement::Monitor);
        Self {
            clock,
            actions: RwLock::new(actions),
            escalator,
            banner,
            shared: None,
            mode: RwLock::new(config.mode),
        }
    }

    /// Checks the actions marked `shared` against `store` from now on; each decides locally
    /// at its share of the limit (limit / expected replicas) whenever the store cannot answer.
    pub fn shared_by(mut self, store: Arc<dyn SharedBuckets>) -> Self {
        let replicas = Some(store.expected_replicas());
        let mode = *self.mode.get_mut().expect("mode lock");
        for action in self.actions.get_mut().expect("actions lock").iter_mut() {
            *action = Action::new(
                action.spec.clone(),
                Arc::clone(&action.table),
                Arc::clone(&action.counters),
                replicas,
                mode,
            );
        }
        self.shared = Some(store);
        self
    }

    /// Applies a reloaded configuration while checks run, and says what it did to the
    /// actions. An action whose key kind is unchanged keeps its buckets and counters; one
    /// whose key kind changed keeps its counters and starts with empty buckets; a removed
    /// action's checks fail as unknown from now on. Escalation takes the new settings at once
    /// (the failures counted so far count towards the new threshold; turned off, they are
    /// forgotten).
    pub fn reconfigure(&self, config: LimiterConfig) -> ActionChanges {
        let replicas = self.shared.as_ref().map(|s| s.expected_replicas());
        let mode = config.mode;
        *self.mode.write().expect("mode lock") = mode;
        let mut actions = self.actions.write().expect("actions lock");
        let mut changes = ActionChanges::default();
        let mut next = Vec::with_capacity(config.actions.len());
        for spec in config.actions {
            let old = actions.iter().find(|a| a.spec.name == spec.name);
            let action = match old {
                None => {
                    changes.added.push(spec.name.clone());
                    Action::new(spec, Arc::default(), Arc::default(), replicas, mode)
                }
                Some(old)
                    if old.spec == spec
                        && old.monitor == (spec.mode.unwrap_or(mode) == Enforcement::Monitor) =>
                {
                    Arc::clone(old)
                }
                Some(old) => {
                    // A new kind of state (rate or quota) or key means nothing to the old table.
                    let table = if old.spec.key == spec.key && old.spec.kind == spec.kind {
                        changes.changed.push(spec.name.clone());
                        Arc::clone(&old.table)
                    } else {
                        changes.rekeyed.push(spec.name.clone());
                        Arc::default()
                    };
                    let action =
                        Action::new(spec, table, Arc::clone(&old.counters), replicas, mode);
                    let _ = old.next.set(Some(Arc::clone(&action)));
                    action
                }
            };
            next.push(action);
        }
        for old in actions.iter() {
            if !next.iter().any(|a| a.spec.name == old.spec.name) {
                changes.removed.push(old.spec.name.clone());
                let _ = old.next.set(None);
            }
        }
        *actions = next;
        self.escalator.reconfigure(config.escalation);
        self.escalator.set_monitor(mode == Enforcement::Monitor);
        changes
    }

    /// The fleet's shared buckets at a glance; `None` without a fleet.
    pub fn shared_status(&self) -> Option<crate::api::FleetStatus> {
        self.shared.as_ref().map(|s| s.status())
    }

    /// A check, sent to the fleet's shared bucket for a shared action (its answer then comes
    /// later, never later than the store's timeout) and decided at once otherwise.
    /// `payload_bytes` is the size of what is checked (0 when the caller has none), for an
    /// action with `max-payload-bytes`.
    pub fn submit(
        self: &Arc<Self>,
        id: &ActionId,
        key: &[u8],
        (cost, payload_bytes): (u32, u32),
        how: Submit,
    ) -> Result<Pending<Judged>, CheckError> {
        let (consume, escalate) = match how {
            Submit::Check => (true, true),
            Submit::CheckUnescalated => (true, false),
            Submit::Peek => (false, false),
        };
        if cost == 0 {
            return Err(CheckError::ZeroCost);
        }
        let action = id.current()?;
        let stored = action.store(key)?;
        if let Some(judged) = self.precheck(action, &stored, payload_bytes, (consume, escalate)) {
            return Ok(Pending::ready(judged));
        }
        let limits = *action.limits(&stored);
        if let (Mode::Sessions(max), Some(store)) = (limits.mode, self.shared.as_ref())
            && action.shared
        {
            let answer = store.sessions_held(
                Arc::clone(&action.name),
                bucket_keys::shared_name(action.spec.key, &stored),
                max,
            );
            let limiter = Arc::clone(self);
            let action = Arc::clone(action);
            return Ok(Pending::Waiting(Box::pin(async move {
                let Some(fleet) = answer.await else {
                    return limiter.decide_locally(&action, &stored, cost, consume, escalate);
                };
                let verdict = sessions_verdict(fleet.fits, max, fleet.held);
                limiter.count(&action, &stored, verdict, (consume, escalate), true)
            })));
        }
        let (limit, store) = match (limits.mode, self.shared.as_ref()) {
            (Mode::Limited(rate), Some(store)) if action.shared => (SharedLimit::Rate(rate), store),
            (Mode::Quota(quota), Some(store)) if action.shared => {
                (SharedLimit::Quota(quota), store)
            }
            _ => {
                return Ok(Pending::ready(
                    self.decide_locally(action, &stored, cost, consume, escalate),
                ));
            }
        };
        let answer = store.take(SharedCheck {
            action: Arc::clone(&action.name),
            key: bucket_keys::shared_name(action.spec.key, &stored),
            limit,
            cost,
            consume,
        });
        let limiter = Arc::clone(self);
        let action = Arc::clone(action);
        Ok(Pending::Waiting(Box::pin(async move {
            let action = &*action;
            let flags = (consume, escalate);
            let fleet = limits.limit;
            match (answer.await, limit) {
                (Some(evaluation), SharedLimit::Rate(rate)) => limiter.conclude(
                    action,
                    &stored,
                    (&rate, fleet),
                    cost,
                    flags,
                    (evaluation, true),
                ),
                (Some(evaluation), SharedLimit::Quota(quota)) => limiter.conclude(
                    action,
                    &stored,
                    (&quota, fleet),
                    cost,
                    flags,
                    (evaluation, true),
                ),
                (None, _) => limiter.decide_locally(action, &stored, cost, consume, escalate),
            }
        })))
    }

    /// Takes one of `key`'s sessions in the concurrency action `action`, held by `owner` (the
    /// protocol connection) until released or `owner` is dropped. A session `owner` holds
    /// already is answered as allowed and not counted again. A shared action's session is a
    /// lease in the fleet's store, whose answer comes later (never later than its timeout);
    /// when the store cannot answer, the session is decided here at the action's fallback
    /// share and held on this agent only.
    pub fn acquire(
        self: &Arc<Self>,
        owner: &SessionOwner,
        action: &str,
        key: &[u8],
        session: &[u8],
    ) -> Result<Pending<Judged>, CheckError> {
        let action = self.action(action)?;
        if action.spec.kind != ActionKind::Concurrency {
            return Err(CheckError::NotConcurrency(action.spec.name.clone()));
        }
        let stored = action.store(key)?;
        let limits = *action.limits(&stored);
        let (Mode::Sessions(fleet_max), Mode::Sessions(local_max)) = (limits.mode, limits.local)
        else {
            // Limit 0: sessions are not limited, nor counted.
            let verdict = Verdict::new(Outcome::Unlimited, 0, u32::MAX, 0, 0);
            return Ok(Pending::ready(self.count(
                &action,
                &stored,
                verdict,
                (true, false),
                true,
            )));
        };
        let store = self.shared.as_ref().filter(|_| action.shared);
        let held = owner.holds(&action.name, &stored, session);
        let store = match (held, store) {
            // Held on this agent only (taken while the store was away): still held.
            (Some(false), _) | (Some(true), None) => {
                let held = action.table.sessions.held(&stored);
                let verdict = sessions_verdict(true, local_max, held);
                return Ok(Pending::ready(self.count(
                    &action,
                    &stored,
                    verdict,
                    (true, false),
                    true,
                )));
            }
            (None, None) => {
                return Ok(Pending::ready(self.acquire_locally(
                    &action,
                    &owner.handle(),
                    (&stored, session),
                    local_max,
                )));
            }
            (_, Some(store)) => Arc::clone(store),
        };
        let lease = SessionLease {
            action: Arc::clone(&action.name),
            key: bucket_keys::shared_name(action.spec.key, &stored),
            session: owner.lease_name(session),
        };
        let answer = store.acquire_session(lease.clone(), fleet_max, action.monitor);
        let (limiter, handle, session) = (Arc::clone(self), owner.handle(), session.to_vec());
        Ok(Pending::Waiting(Box::pin(async move {
            let Some(fleet) = answer.await else {
                return limiter.acquire_locally(&action, &handle, (&stored, &session), local_max);
            };
            if fleet.fits || action.monitor {
                let counts = &action.table.sessions;
                counts.acquire(&stored, u32::MAX, true);
                handle.add(
                    &action.name,
                    &stored,
                    &session,
                    counts,
                    Some((&store, lease)),
                );
            }
            let verdict = sessions_verdict(fleet.fits, fleet_max, fleet.held);
            limiter.count(&action, &stored, verdict, (true, false), true)
        })))
    }

    /// A session decided by this agent alone, at most `max` of the key's held here.
    fn acquire_locally(
        &self,
        action: &Action,
        owner: &OwnerHandle,
        (stored, session): (&StoredKey, &[u8]),
        max: u32,
    ) -> Judged {
        let counts = &action.table.sessions;
        let (fits, held) = counts.acquire(stored, max, action.monitor);
        if fits || action.monitor {
            owner.add(&action.name, stored, session, counts, None);
        }
        let verdict = sessions_verdict(fits, max, held);
        self.count(action, stored, verdict, (true, false), true)
    }

    /// Gives back a session `owner` acquired; false if it held none of that name. A shared
    /// session is answered once the fleet's store has removed its lease (or its timeout
    /// passed, and the lease lapses), so a broker that releases and then acquires elsewhere
    /// finds the room made.
    pub fn release(
        &self,
        owner: &SessionOwner,
        action: &str,
        key: &[u8],
        session: &[u8],
    ) -> Result<Pending<bool>, CheckError> {
        let action = self.action(action)?;
        if action.spec.kind != ActionKind::Concurrency {
            return Err(CheckError::NotConcurrency(action.spec.name.clone()));
        }
        let stored = action.store(key)?;
        Ok(match owner.release(&action.name, &stored, session) {
            Released::NotHeld => Pending::ready(false),
            Released::Done => Pending::ready(true),
            Released::Waiting(confirmed) => Pending::Waiting(Box::pin(async move {
                confirmed.await;
                true
            })),
        })
    }

    /// The broker's connection `key` is gone: forgets its buckets and strikes in every action
    /// keyed by connection. True if any held something.
    pub fn connection_gone(&self, key: &[u8]) -> bool {
        let mut changed = false;
        for action in self.current().iter() {
            if action.spec.key != KeyKind::Connection {
                continue;
            }
            let Ok(stored) = action.store(key) else {
                continue;
            };
            let table = &action.table;
            if table.buckets.remove(&stored).is_some() {
                table.tracked.fetch_sub(1, Ordering::AcqRel);
                changed = true;
            }
            changed |= table.strikes.forget(&stored);
        }
        changed
    }

    /// Forgets a key's bucket, here and, for a shared action, in the fleet's store.
    pub fn forget(self: &Arc<Self>, action: &str, key: &[u8]) -> Result<Pending<bool>, CheckError> {
        let here = self.reset(action, key)?;
        let action = self.action(action)?;
        let stored = action.store(key)?;
        let Some(store) = self.shared.as_ref().filter(|_| action.shared) else {
            return Ok(Pending::ready(here));
        };
        let there = store.forget(
            Arc::clone(&action.name),
            bucket_keys::shared_name(action.spec.key, &stored),
        );
        Ok(Pending::Waiting(Box::pin(async move {
            there.await.unwrap_or(false) || here
        })))
    }

    /// The actions' settings in force.
    pub fn actions(&self) -> Vec<ActionSpec> {
        self.current().iter().map(|a| a.spec.clone()).collect()
    }

    /// The action named `name`, resolved once for [`Limiter::check_id`].
    pub fn action_id(&self, name: &str) -> Result<ActionId, CheckError> {
        self.current()
            .iter()
            .find(|a| a.spec.name == name)
            .map(|a| ActionId(Arc::clone(a)))
            .ok_or_else(|| CheckError::UnknownAction(name.to_owned()))
    }

    fn current(&self) -> std::sync::RwLockReadGuard<'_, Vec<Arc<Action>>> {
        self.actions.read().expect("actions lock")
    }

    /// Spends `cost` tokens of `key`'s bucket if it holds them; a refusal spends nothing.
    pub fn check(&self, action: &str, key: &[u8], cost: u32) -> Result<Verdict, CheckError> {
        self.decide(&*self.action(action)?, key, cost, true, true)
            .map(|j| j.enforced())
    }

    /// `check` for an action resolved with [`Limiter::action_id`].
    pub fn check_id(
        &self,
        action: &ActionId,
        key: &[u8],
        cost: u32,
    ) -> Result<Verdict, CheckError> {
        self.decide(action.current()?, key, cost, true, true)
            .map(|j| j.enforced())
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
        self.decide(&*self.action(action)?, key, cost, true, false)
            .map(|j| j.enforced())
    }

    /// What `check` would answer, spending nothing and counting nothing.
    pub fn peek(&self, action: &str, key: &[u8], cost: u32) -> Result<Verdict, CheckError> {
        self.decide(&*self.action(action)?, key, cost, false, false)
            .map(|j| j.enforced())
    }

    /// Forgets a key's bucket, so its next check finds it full. `Ok(false)` if it had none.
    pub fn reset(&self, action: &str, key: &[u8]) -> Result<bool, CheckError> {
        let action = self.action(action)?;
        let stored = action.store(key)?;
        let table = &action.table;
        let removed = table.buckets.remove(&stored).is_some();
        if removed {
            table.tracked.fetch_sub(1, Ordering::AcqRel);
        }
        Ok(removed)
    }

    /// A failed authentication reported by the broker: counts towards escalation.
    pub fn report_auth_failure(&self, addr: IpAddr) -> Escalation {
        self.escalator.record_failure(addr)
    }

    /// A source the kernel refused at its proven handshakes for `refused` (the sweeper reads
    /// it from the kernel; `monitored` if a refusal was only judged, on a monitored port):
    /// kernel escalation bans it past `escalate-refused-for`.
    pub fn report_refused(&self, addr: IpAddr, refused: Duration, monitored: bool) -> Escalation {
        self.escalator.record_refused(addr, refused, monitored)
    }

    pub fn ban(&self, addr: IpAddr, ttl: Duration) -> Result<(), BanError> {
        self.banner.ban(addr.to_canonical(), ttl)
    }

    /// Lifts a ban and forgets the address's failures, so it starts again from a clean slate.
    pub fn unban(&self, addr: IpAddr) -> Result<bool, BanError> {
        self.escalator.forget(addr);
        self.banner.unban(addr.to_canonical())
    }

    /// Evicts buckets that are full again (they hold nothing a fresh bucket would not) and
    /// idle escalation records; returns how many entries went. The agent calls it periodically.
    pub fn sweep(&self) -> usize {
        let mut removed = 0;
        for action in self.current().iter() {
            removed += action.evict_idle(action.now(&*self.clock));
            removed += action
                .table
                .strikes
                .sweep(action.spec.strikes.as_ref(), self.clock.now_ns());
        }
        removed + self.escalator.sweep()
    }

    pub fn stats(&self) -> Vec<ActionStats> {
        self.current()
            .iter()
            .map(|a| {
                let count = |o| a.counters.outcomes.get(o);
                ActionStats {
                    action: a.spec.name.clone(),
                    counts: ActionCounts {
                        allowed: count(Outcome::Allowed),
                        unlimited: count(Outcome::Unlimited),
                        limited: count(Outcome::Limited),
                        cost_exceeds_burst: count(Outcome::CostExceedsBurst),
                        cost_exceeds_limit: count(Outcome::CostExceedsLimit),
                        closed: count(Outcome::Closed),
                        disconnect: count(Outcome::Disconnect),
                        payload_too_large: count(Outcome::PayloadTooLarge),
                        blocked: REFUSALS.iter().map(|&o| count(o)).sum(),
                        struck_connections: a.table.strikes.tracked(),
                        session_keys: a.table.sessions.keys(),
                        sessions_held: a.table.sessions.total(),
                        strike_disconnects: a.counters.strike_disconnects.load(Ordering::Relaxed),
                        tracked_keys: a.table.tracked.load(Ordering::Acquire),
                        overflow_checks: a.counters.overflow_checks.load(Ordering::Relaxed),
                        would_refuse: REFUSALS
                            .iter()
                            .map(|&o| a.counters.would_refuse.get(o))
                            .sum(),
                    },
                    mode: if a.monitor {
                        Enforcement::Monitor
                    } else {
                        Enforcement::Enforce
                    },
                    would_refuse: REFUSALS
                        .iter()
                        .map(|&o| (o, a.counters.would_refuse.get(o)))
                        .collect(),
                    // `capacity` counts usable slots, 7 of every 8.
                    key_memory_bytes: a.table.buckets.capacity() * SLOT_BYTES * 8 / 7,
                }
            })
            .collect()
    }

    /// What the banner shared with the fleet (zero without one).
    pub fn shared_ban_stats(&self) -> SharedBanStats {
        self.banner.shared_stats()
    }

    /// The top-level mode in force.
    pub fn mode(&self) -> Enforcement {
        *self.mode.read().expect("mode lock")
    }

    /// `None` while escalation is off.
    pub fn escalation_stats(&self) -> Option<EscalationStats> {
        self.escalator.config().map(|_| self.escalator.stats())
    }

    pub fn escalation_config(&self) -> Option<EscalationConfig> {
        self.escalator.config()
    }

    /// The `n` keys of `action` refused most often while their buckets were live.
    pub fn top_blocked(&self, action: &str, n: usize) -> Result<Vec<BlockedKey>, CheckError> {
        let action = self.action(action)?;
        let mut blocked: Vec<(u64, StoredKey)> = action
            .table
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
                key: bucket_keys::display(action.spec.key, &key),
                blocked: count,
            })
            .collect())
    }

    fn action(&self, name: &str) -> Result<Arc<Action>, CheckError> {
        self.action_id(name).map(|ActionId(action)| action)
    }

    fn decide(
        &self,
        action: &Action,
        key: &[u8],
        cost: u32,
        consume: bool,
        escalate: bool,
    ) -> Result<Judged, CheckError> {
        if cost == 0 {
            return Err(CheckError::ZeroCost);
        }
        let stored = action.store(key)?;
        if let Some(judged) = self.precheck(action, &stored, 0, (consume, escalate)) {
            return Ok(judged);
        }
        Ok(self.decide_locally(action, &stored, cost, consume, escalate))
    }

    /// The answer a check gets before any bucket is asked: `disconnect` for a connection its
    /// strikes closed, `payload_too_large` (a strike of its own) for a payload over the cap.
    fn precheck(
        &self,
        action: &Action,
        stored: &StoredKey,
        payload_bytes: u32,
        (consume, escalate): (bool, bool),
    ) -> Option<Judged> {
        let spec = &action.spec;
        if spec.strikes.is_none() && spec.max_payload_bytes == 0 {
            return None;
        }
        let limit = action.limits(stored).local_limit;
        let flags = (consume, escalate);
        if spec.strikes.is_some()
            && action
                .table
                .strikes
                .disconnected(stored, self.clock.now_ns(), consume)
        {
            let verdict = Verdict::new(Outcome::Disconnect, limit, 0, NEVER_MS, NEVER_MS);
            return Some(self.count(action, stored, verdict, flags, true));
        }
        if spec.max_payload_bytes > 0 && payload_bytes > spec.max_payload_bytes {
            // The bucket is not asked: the same payload can never pass.
            let verdict = Verdict::new(Outcome::PayloadTooLarge, limit, 0, NEVER_MS, 0);
            return Some(self.count(action, stored, verdict, flags, true));
        }
        None
    }

    /// A spending verdict of an action with strikes, after its strike: `disconnect` once the
    /// connection has collected enough within the window.
    fn strike(&self, action: &Action, stored: &StoredKey, verdict: Verdict) -> Verdict {
        let Some(rule) = &action.spec.strikes else {
            return verdict;
        };
        let weight = match verdict.outcome {
            Outcome::PayloadTooLarge => rule.oversize,
            // Already closed: nothing more to count.
            Outcome::Disconnect => return verdict,
            outcome if outcome.allowed() => return verdict,
            _ => 1,
        };
        let now = self.clock.now_ns();
        let struck = action
            .table
            .strikes
            .strike(rule, stored, now, weight, action.spec.max_keys);
        // Monitor mode answers the disconnect as an allowance: nothing is closed to log.
        if let Struck::Disconnects { strikes } = struck
            && !action.monitor
        {
            action
                .counters
                .strike_disconnects
                .fetch_add(1, Ordering::Relaxed);
            events::emit(&Event::Disconnect {
                action: action.name.to_string(),
                key: bucket_keys::display(action.spec.key, stored),
                strikes,
                window: rule.window,
            });
        }
        if struck.disconnects() {
            Verdict::new(Outcome::Disconnect, verdict.limit, 0, NEVER_MS, NEVER_MS)
        } else {
            verdict
        }
    }

    /// The verdict of this agent's own bucket for `key`.
    fn decide_locally(
        &self,
        action: &Action,
        stored: &StoredKey,
        cost: u32,
        consume: bool,
        escalate: bool,
    ) -> Judged {
        let flags = (consume, escalate);
        let limits = action.limits(stored);
        let limit = limits.local_limit;
        let verdict = match limits.local {
            Mode::Unlimited => Verdict::new(Outcome::Unlimited, 0, u32::MAX, 0, 0),
            Mode::Closed => Verdict::new(Outcome::Closed, 0, 0, NEVER_MS, NEVER_MS),
            // A check of sessions asks whether one more would fit, and takes none.
            Mode::Sessions(max) => {
                let held = action.table.sessions.held(stored);
                sessions_verdict(held < max, max, held)
            }
            Mode::Limited(rate) => return self.settle(action, (&rate, limit), stored, cost, flags),
            Mode::Quota(quota) => return self.settle(action, (&quota, limit), stored, cost, flags),
        };
        self.count(action, stored, verdict, (consume, escalate), true)
    }

    /// Turns a bucket's evaluation (this agent's or the fleet's) into the verdict, and counts
    /// it.
    fn conclude<A: Algorithm>(
        &self,
        action: &Action,
        stored: &StoredKey,
        (algorithm, limit): (&A, u32),
        cost: u32,
        (consume, escalate): (bool, bool),
        (evaluation, tracked): (Evaluation, bool),
    ) -> Judged {
        let outcome = if evaluation.allowed {
            Outcome::Allowed
        } else if cost > algorithm.capacity() {
            A::OVERSIZED
        } else {
            Outcome::Limited
        };
        let verdict = Verdict::new(
            outcome,
            limit,
            evaluation.remaining,
            if evaluation.retry_after_ns == u64::MAX {
                NEVER_MS
            } else {
                ns_to_ms_ceil(evaluation.retry_after_ns)
            },
            ns_to_ms_ceil(evaluation.reset_after_ns),
        );
        self.count(action, stored, verdict, (consume, escalate), tracked)
    }

    /// Counts a spending verdict, and feeds a refusal of a tracked key to escalation, unless
    /// the action is in monitor mode, where the refusal is counted as one that was not made.
    fn count(
        &self,
        action: &Action,
        stored: &StoredKey,
        verdict: Verdict,
        (consume, escalate): (bool, bool),
        tracked: bool,
    ) -> Judged {
        let mut judged = Judged {
            verdict,
            monitored: action.monitor,
        };
        if !consume {
            return judged;
        }
        judged.verdict = self.strike(action, stored, verdict);
        let verdict = judged.verdict;
        action.counters.outcomes.add(verdict.outcome);
        if let Some(outcome) = judged.would_refuse() {
            action.counters.would_refuse.add(outcome);
            return judged;
        }
        if !verdict.allowed
            && escalate
            && tracked
            && action.spec.escalate
            && action.spec.key == KeyKind::Ip
            && let Some(addr) = stored.address()
        {
            self.escalator.record_failure(addr);
        }
        judged
    }

    /// The verdict of this agent's own cell for `key` under `algorithm`.
    fn settle<A: Algorithm>(
        &self,
        action: &Action,
        (algorithm, limit): (&A, u32),
        stored: &StoredKey,
        cost: u32,
        flags: (bool, bool),
    ) -> Judged {
        let now = action.now(&*self.clock);
        let settled = Self::evaluate(action, algorithm, stored, now, cost, flags.0);
        self.conclude(action, stored, (algorithm, limit), cost, flags, settled)
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
        let table = &action.table;
        if let Some(bucket) = table.buckets.get(key) {
            return settle(&bucket);
        }
        if !consume {
            // An untracked key is fresh; nothing is created to answer a peek.
            return (algorithm.evaluate(0, now, cost), false);
        }
        if !action.claim_slot(now) {
            // Degraded mode: answered as the fresh key it would get, never refused for
            // others' spending.
            action
                .counters
                .overflow_checks
                .fetch_add(1, Ordering::Relaxed);
            return (algorithm.evaluate(0, now, cost), false);
        }
        match table.buckets.entry(*key) {
            Entry::Occupied(occupied) => {
                // Another check inserted it first; give the slot back.
                table.tracked.fetch_sub(1, Ordering::AcqRel);
                settle(occupied.get())
            }
            Entry::Vacant(vacant) => settle(&vacant.insert(Bucket::default())),
        }
    }
}

impl Action {
    #[inline(always)]
    fn store(&self, key: &[u8]) -> Result<StoredKey, CheckError> {
        bucket_keys::store(self.spec.key, key).map_err(|source| CheckError::InvalidKey {
            action: self.spec.name.clone(),
            source,
        })
    }

    /// The time the action's algorithm counts in: a rate the monotonic clock, a quota the
    /// calendar.
    fn now(&self, clock: &dyn Clock) -> u64 {
        // By the kind, not the limits: an overridden key of a quota off by default (limit 0)
        // counts its quota on the calendar too.
        match self.spec.kind {
            ActionKind::Quota => clock.unix_ns(),
            ActionKind::Rate | ActionKind::Concurrency => clock.now_ns(),
        }
    }

    /// Whether `key`, in `state`, holds nothing a fresh key would not.
    fn is_idle(&self, key: &StoredKey, state: u64, now: u64) -> bool {
        match &self.limits(key).local {
            Mode::Limited(rate) => rate.is_idle(state, now),
            Mode::Quota(quota) => quota.is_idle(state, now),
            Mode::Unlimited | Mode::Closed | Mode::Sessions(_) => true,
        }
    }

    /// Claims a slot under the cap before inserting, so the cap holds under races; a full
    /// action first evicts its buckets that are full again (at most once per
    /// [`CAP_SWEEP_EVERY`]). A cap lowered by a reload below the keys tracked admits no new
    /// key until sweeps bring the count under it.
    fn claim_slot(&self, now: u64) -> bool {
        let table = &self.table;
        for attempt in 0..2 {
            if table.tracked.fetch_add(1, Ordering::AcqRel) < self.spec.max_keys {
                return true;
            }
            table.tracked.fetch_sub(1, Ordering::AcqRel);
            let last = table.cap_swept.load(Ordering::Acquire);
            let due = last == 0 || now.saturating_sub(last - 1) >= duration_ns(CAP_SWEEP_EVERY);
            let ours = attempt == 0
                && due
                && table
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
        let table = &self.table;
        let mut gone = 0;
        table.buckets.retain(|key, bucket| {
            let keep = !self.is_idle(key, bucket.cell.state(), now);
            gone += usize::from(!keep);
            keep
        });
        table.tracked.fetch_sub(gone, Ordering::AcqRel);
        if gone > 0 && table.buckets.capacity() > 2 * table.buckets.len() {
            table.buckets.shrink_to_fit();
        }
        gone
    }
}

//! Per-action counters, kept so that the agent can export them. Counters are striped across
//! cache lines, one stripe per thread slot: a single shared counter would be written by every
//! check on every core and undo the lock-free bucket.

use std::{
    cell::Cell,
    sync::atomic::{AtomicU64, AtomicUsize, Ordering},
};

use limiter_client::Outcome;
use serde::Serialize;

const STRIPES: usize = 16;

#[repr(align(128))]
#[derive(Default)]
struct Stripe([AtomicU64; OUTCOMES]);

const OUTCOMES: usize = 6;

thread_local! {
    static SLOT: Cell<usize> = const { Cell::new(usize::MAX) };
}

static NEXT_SLOT: AtomicUsize = AtomicUsize::new(0);

fn slot() -> usize {
    SLOT.with(|slot| {
        if slot.get() == usize::MAX {
            slot.set(NEXT_SLOT.fetch_add(1, Ordering::Relaxed) % STRIPES);
        }
        slot.get()
    })
}

/// Checks counted by outcome.
#[derive(Default)]
pub struct OutcomeCounters {
    stripes: [Stripe; STRIPES],
}

impl OutcomeCounters {
    pub fn add(&self, outcome: Outcome) {
        self.stripes[slot()].0[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(&self, outcome: Outcome) -> u64 {
        self.stripes
            .iter()
            .map(|s| s.0[outcome as usize].load(Ordering::Relaxed))
            .sum()
    }
}

/// A snapshot of one action, for `/rate_limits` and the metrics.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ActionStats {
    pub action: String,
    pub allowed: u64,
    pub unlimited: u64,
    pub limited: u64,
    pub cost_exceeds_burst: u64,
    pub cost_exceeds_limit: u64,
    pub closed: u64,
    /// Every refusal: limited + cost_exceeds_burst + cost_exceeds_limit + closed.
    pub blocked: u64,
    pub tracked_keys: usize,
    /// Checks for new keys made while the action was at its key cap with every bucket still
    /// spending (the degraded mode): answered as a fresh bucket, untracked.
    pub overflow_checks: u64,
    /// Memory the action's key table holds (entries and the table's slack).
    pub key_memory_bytes: usize,
}

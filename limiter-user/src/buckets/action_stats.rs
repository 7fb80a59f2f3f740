//! Per-action counters, kept so that the agent can export them. Counters are striped across
//! cache lines: a single shared counter would be written by every check on every core and
//! undo the lock-free bucket. A thread claims a stripe of its own while it lives and counts in
//! it with a plain load and store, since no other thread writes it (no read-modify-write on
//! the hot path); threads beyond the stripes share one, with atomic adds.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use limiter_client::Outcome;
use serde::Serialize;

use crate::api::ActionCounts;

/// Stripe 0 is the shared one; the others are claimed by one thread each.
const STRIPES: usize = 16;

#[repr(align(128))]
#[derive(Default)]
struct Stripe([AtomicU64; OUTCOMES]);

const OUTCOMES: usize = limiter_client::Outcome::COUNT;

/// Which stripes a live thread owns.
static CLAIMED: [AtomicBool; STRIPES] = [const { AtomicBool::new(false) }; STRIPES];

/// This thread's stripe, given back when the thread ends.
struct Claim(usize);

impl Claim {
    fn new() -> Self {
        (1..STRIPES)
            .find(|&i| {
                CLAIMED[i]
                    .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            })
            .map_or(Self(0), Self)
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if self.0 != 0 {
            // Release: the next owner's first load sees this thread's last store.
            CLAIMED[self.0].store(false, Ordering::Release);
        }
    }
}

thread_local! {
    static SLOT: Claim = Claim::new();
}

/// Checks counted by outcome.
#[derive(Default)]
pub struct OutcomeCounters {
    stripes: [Stripe; STRIPES],
}

impl OutcomeCounters {
    pub fn add(&self, outcome: Outcome) {
        let stripe = SLOT.try_with(|claim| claim.0).unwrap_or(0);
        let counter = &self.stripes[stripe].0[outcome as usize];
        if stripe == 0 {
            counter.fetch_add(1, Ordering::Relaxed);
        } else {
            // Only this thread writes its stripe.
            counter.store(counter.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        }
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
    #[serde(flatten)]
    pub counts: ActionCounts,
    /// `enforce` or `monitor`, as in force.
    pub mode: super::Enforcement,
    /// Refusals monitor mode answered as allowances, by the refusal's outcome (the metrics'
    /// `limiter_would_refuse_total`).
    #[serde(skip)]
    pub would_refuse: Vec<(Outcome, u64)>,
    /// Memory the action's key table holds (entries and the table's slack).
    pub key_memory_bytes: usize,
}

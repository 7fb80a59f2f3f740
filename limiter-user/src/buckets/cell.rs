//! One key's state as a single `u64`, settled by compare-and-swap, whatever the algorithm.
//!
//! Both algorithms ([`Rate`](super::gcra::Rate) and [`Quota`](super::calendar_quota::Quota)) keep all a
//! key needs in one word, so one compare-and-swap makes a check exact under concurrency without
//! a lock: of any number of racing requests, exactly those that fit are admitted.

use std::sync::atomic::{AtomicU64, Ordering};

use limiter_client::Outcome;

/// What a key's limit would answer at one instant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Evaluation {
    pub allowed: bool,
    /// The state to store if the request is taken; equal to the current one when refused.
    pub new_state: u64,
    /// Whole tokens left after this request (after paying, if allowed).
    pub remaining: u32,
    /// Zero when allowed; `u64::MAX` when the cost can never be paid; otherwise the wait until
    /// the cost fits.
    pub retry_after_ns: u64,
    /// The wait until the key holds its whole allowance again, given the request's outcome.
    pub reset_after_ns: u64,
}

/// A limit over one `u64` of state per key. State 0 is a key never used.
pub trait Algorithm {
    /// The answer for a request of `cost` at `now` against `state`; pure.
    fn evaluate(&self, state: u64, now: u64, cost: u32) -> Evaluation;

    /// Whether a key in `state` may be forgotten at `now`: it holds nothing a fresh key would
    /// not, so the sweeper evicts it.
    fn is_idle(&self, state: u64, now: u64) -> bool;

    /// The most one request can ever cost; above it the check is refused for good.
    fn capacity(&self) -> u32;

    /// The outcome of a cost above [`Algorithm::capacity`].
    const OVERSIZED: Outcome;
}

#[derive(Debug, Default)]
pub struct Cell {
    state: AtomicU64,
}

impl Cell {
    pub fn state(&self) -> u64 {
        self.state.load(Ordering::Acquire)
    }

    /// Evaluates and, when allowed and `consume` is set, stores the new state atomically; a
    /// refusal stores nothing, so a cost is all or nothing. Inlined into the check, so the
    /// evaluation stays in registers rather than coming back through memory.
    #[inline(always)]
    pub fn take(
        &self,
        algorithm: &impl Algorithm,
        now: u64,
        cost: u32,
        consume: bool,
    ) -> Evaluation {
        let mut current = self.state.load(Ordering::Acquire);
        loop {
            let evaluation = algorithm.evaluate(current, now, cost);
            if !evaluation.allowed || !consume {
                return evaluation;
            }
            match self.state.compare_exchange_weak(
                current,
                evaluation.new_state,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return evaluation,
                Err(actual) => current = actual,
            }
        }
    }
}

//! The generic cell rate algorithm: a token bucket kept as one timestamp per key.
//!
//! The theoretical arrival time (TAT) is when the bucket would be full again if nothing else
//! arrived. Refill is continuous because it is only ever a comparison with the clock, so time
//! short of a whole token is never lost, and the TAT is one `u64` a [`Cell`](super::cell::Cell)
//! updates with a single compare-and-swap.

use std::time::Duration;

use limiter_client::Outcome;

use super::cell::{Algorithm, Evaluation};
use crate::duration_units::duration_ns;

/// A limit turned into the two numbers GCRA works with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    /// Time one token takes to come back: window / limit, rounded down to a whole nanosecond
    /// (the rounding favours the client by under a nanosecond per token).
    emission_ns: u64,
    /// How far ahead of the clock the TAT may run: the bucket's capacity expressed as time.
    tolerance_ns: u64,
    burst: u32,
    /// `u64::MAX / emission_ns`: every verdict divides by the emission interval to count the
    /// tokens left, and a multiplication by this reciprocal (with one correction step) is
    /// exact and several times cheaper than a 64-bit division.
    emission_inverse: u64,
}

impl Rate {
    /// `None` when the limit is finer than one token per nanosecond, which GCRA cannot express.
    pub fn new(limit: u32, window: Duration, burst: u32) -> Option<Self> {
        if limit == 0 || burst == 0 {
            return None;
        }
        let emission_ns = duration_ns(window) / u64::from(limit);
        if emission_ns == 0 {
            return None;
        }
        Some(Self {
            emission_ns,
            tolerance_ns: emission_ns.saturating_mul(u64::from(burst)),
            burst,
            emission_inverse: u64::MAX / emission_ns,
        })
    }

    /// Time one token takes to come back.
    pub fn emission_ns(&self) -> u64 {
        self.emission_ns
    }

    /// The bucket's capacity as time.
    pub fn tolerance_ns(&self) -> u64 {
        self.tolerance_ns
    }

    /// The same rate for `replicas` agents deciding alone: a share of the limit and of the
    /// burst, each at least one token. `None` when the share is finer than a nanosecond.
    pub fn share(limit: u32, window: Duration, burst: u32, replicas: u32) -> Option<Self> {
        let replicas = replicas.max(1);
        Self::new((limit / replicas).max(1), window, (burst / replicas).max(1))
    }

    /// Whole tokens in a bucket that is `debt_ns` short of full.
    #[inline]
    fn tokens(&self, debt_ns: u64) -> u32 {
        let tokens = self.per_emission(self.tolerance_ns.saturating_sub(debt_ns));
        u32::try_from(tokens).unwrap_or(u32::MAX)
    }

    /// `ns / emission_ns`, exactly. With m = floor((2^64 - 1) / d), d·m > 2^64 - 1 - d, so
    /// n·m / 2^64 falls short of n / d by less than n / 2^64 < 1: the estimate is the quotient
    /// or one less, and the remainder tells which.
    #[inline]
    fn per_emission(&self, ns: u64) -> u64 {
        let estimate = ((u128::from(ns) * u128::from(self.emission_inverse)) >> 64) as u64;
        let remainder = ns - estimate * self.emission_ns;
        estimate + u64::from(remainder >= self.emission_ns)
    }
}

impl Algorithm for Rate {
    const OVERSIZED: Outcome = Outcome::CostExceedsBurst;

    fn capacity(&self) -> u32 {
        self.burst
    }

    /// The answer for a request of `cost` tokens at `now` against a bucket whose TAT is `tat`.
    /// A cost above the burst is answered "refused" with an infinite retry; callers report it
    /// as its own reason.
    #[inline]
    fn evaluate(&self, tat: u64, now: u64, cost: u32) -> Evaluation {
        let start = tat.max(now);
        let new_tat = start.saturating_add(self.emission_ns.saturating_mul(u64::from(cost)));
        let debt_after = new_tat - now;
        if cost <= self.burst && debt_after <= self.tolerance_ns {
            Evaluation {
                allowed: true,
                new_state: new_tat,
                remaining: self.tokens(debt_after),
                retry_after_ns: 0,
                reset_after_ns: debt_after,
            }
        } else {
            let debt_now = start - now;
            Evaluation {
                allowed: false,
                new_state: tat,
                remaining: self.tokens(debt_now),
                retry_after_ns: if cost > self.burst {
                    u64::MAX
                } else {
                    debt_after - self.tolerance_ns
                },
                reset_after_ns: debt_now,
            }
        }
    }

    /// A bucket whose TAT is not after `now` is full: it holds nothing a fresh bucket would not.
    fn is_idle(&self, tat: u64, now: u64) -> bool {
        tat <= now
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buckets::cell::Cell;

    const SEC: u64 = 1_000_000_000;

    fn rate(limit: u32, window_s: u64, burst: u32) -> Rate {
        Rate::new(limit, Duration::from_secs(window_s), burst).unwrap()
    }

    #[test]
    fn a_fresh_bucket_admits_exactly_its_burst_then_refuses() {
        let rate = rate(10, 60, 10);
        let cell = Cell::default();
        let now = 100 * SEC;
        for expected_remaining in (0..10).rev() {
            let e = cell.take(&rate, now, 1, true);
            assert!(e.allowed);
            assert_eq!(e.remaining, expected_remaining);
        }
        let refused = cell.take(&rate, now, 1, true);
        assert!(!refused.allowed);
        assert_eq!(refused.remaining, 0);
        // One token every 6 s; the bucket is full 60 s later.
        assert_eq!(refused.retry_after_ns, 6 * SEC);
        assert_eq!(refused.reset_after_ns, 60 * SEC);
    }

    #[test]
    fn refill_is_continuous_and_partial_time_carries_over() {
        let rate = rate(10, 60, 10);
        let cell = Cell::default();
        let start = 100 * SEC;
        for _ in 0..10 {
            assert!(cell.take(&rate, start, 1, true).allowed);
        }
        // 4 s in: two thirds of a token, not enough; the wait left is the remaining 2 s.
        let early = cell.take(&rate, start + 4 * SEC, 1, true);
        assert!(!early.allowed);
        assert_eq!(early.retry_after_ns, 2 * SEC);
        // At 6 s exactly one token is back.
        assert!(cell.take(&rate, start + 6 * SEC, 1, true).allowed);
        assert!(!cell.take(&rate, start + 6 * SEC, 1, true).allowed);
        // 9 s: the 3 s beyond the last token carried over, so the next one is due at 12 s.
        let carried = cell.take(&rate, start + 9 * SEC, 1, true);
        assert_eq!(carried.retry_after_ns, 3 * SEC);
    }

    #[test]
    fn a_client_at_the_rate_is_never_refused_however_unevenly_it_spaces_requests() {
        // 300 per 60 s: one token per 200 ms. Starting from an empty bucket the client takes,
        // after each irregular gap, exactly the whole tokens that have accrued since the start;
        // any fraction of a token lost at a gap would make a later request fail.
        let rate = rate(300, 60, 300);
        let cell = Cell::default();
        let start = 10 * SEC;
        for _ in 0..300 {
            assert!(cell.take(&rate, start, 1, true).allowed);
        }
        let gaps_ms = [130, 470, 7, 993, 200, 1, 333, 66];
        let (mut elapsed_ms, mut taken) = (0u64, 0u64);
        for step in 0..4_000 {
            elapsed_ms += gaps_ms[step % gaps_ms.len()];
            let now = start + elapsed_ms * 1_000_000;
            while taken < elapsed_ms / 200 {
                let e = cell.take(&rate, now, 1, true);
                assert!(e.allowed, "refused at step {step}, token {taken}");
                taken += 1;
            }
            assert!(
                !cell.take(&rate, now, 1, true).allowed,
                "got ahead at step {step}"
            );
        }
    }

    #[test]
    fn cost_is_all_or_nothing() {
        let rate = rate(10, 10, 10);
        let cell = Cell::default();
        let now = 5 * SEC;
        assert!(cell.take(&rate, now, 7, true).allowed);
        let refused = cell.take(&rate, now, 4, true);
        assert!(!refused.allowed);
        assert_eq!(refused.remaining, 3, "a refused check consumes nothing");
        assert_eq!(refused.retry_after_ns, SEC, "one more token pays for 4");
        assert_eq!(refused.reset_after_ns, 7 * SEC);
        let fits = cell.take(&rate, now, 3, true);
        assert!(fits.allowed);
        assert_eq!(fits.remaining, 0);
        assert_eq!(fits.reset_after_ns, 10 * SEC);
    }

    #[test]
    fn a_cost_above_the_burst_can_never_pass() {
        let rate = rate(10, 10, 5);
        let e = rate.evaluate(0, SEC, 6);
        assert!(!e.allowed);
        assert_eq!(e.retry_after_ns, u64::MAX);
        assert_eq!(e.remaining, 5);
    }

    #[test]
    fn a_burst_below_the_limit_caps_the_bucket_not_the_rate() {
        // 10 per 10 s with a burst of 2: two at once, then one a second.
        let rate = rate(10, 10, 2);
        let cell = Cell::default();
        let now = 100 * SEC;
        assert!(cell.take(&rate, now, 1, true).allowed);
        let second = cell.take(&rate, now, 1, true);
        assert!(second.allowed);
        assert_eq!(second.reset_after_ns, 2 * SEC);
        assert!(!cell.take(&rate, now, 1, true).allowed);
        assert!(cell.take(&rate, now + SEC, 1, true).allowed);
    }

    #[test]
    fn peeking_consumes_nothing() {
        let rate = rate(2, 10, 2);
        let cell = Cell::default();
        for _ in 0..5 {
            assert!(cell.take(&rate, SEC, 1, false).allowed);
        }
        assert_eq!(cell.state(), 0);
    }

    #[test]
    fn the_reciprocal_divides_exactly() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            // xorshift64*: spread over every magnitude of divisor and dividend.
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            x.wrapping_mul(0x2545_f491_4f6c_dd1d)
        };
        let edges = [1, 2, 3, 7, 1_000_000, u64::MAX / 3, u64::MAX - 1, u64::MAX];
        for _ in 0..20_000 {
            let d = match next() % 4 {
                0 => edges[(next() % 8) as usize],
                shift => (next() >> (16 * shift)).max(1),
            };
            let rate = Rate {
                emission_ns: d,
                tolerance_ns: 0,
                burst: 1,
                emission_inverse: u64::MAX / d,
            };
            for n in [
                next(),
                next() >> 32,
                d,
                d - 1,
                d.saturating_mul(5),
                u64::MAX,
                0,
            ] {
                assert_eq!(rate.per_emission(n), n / d, "{n} / {d}");
            }
        }
    }

    #[test]
    fn limits_finer_than_a_nanosecond_are_rejected() {
        assert!(Rate::new(u32::MAX, Duration::from_millis(1), 1).is_none());
        assert!(Rate::new(0, Duration::from_secs(1), 1).is_none());
    }
}

//! Quotas: a fixed allowance per calendar window (a UTC day unless the action sets a period),
//! spent all or nothing and refilled at once when the window rolls over.
//!
//! Windows are aligned to the UNIX epoch, so a period of a day is the UTC day, and every agent
//! (and Redis) cuts the same windows without agreeing on anything. A key's state is the window
//! it last spent in and what it spent there, packed into one `u64` (the window index's low 32
//! bits over the count), settled by a [`Cell`](super::cell::Cell)'s compare-and-swap. With
//! periods of at least a second, 32 bits of index repeat after 136 years, and the sweeper
//! forgets a key long before.

use std::time::Duration;

use limiter_client::Outcome;

use super::cell::{Algorithm, Evaluation};
use crate::duration_units::duration_ns;

/// The shortest period: below a second the window index would repeat within a human lifetime.
pub const MIN_PERIOD: Duration = Duration::from_secs(1);

/// The longest period, the longest ban's bound too: a quota is a calendar allowance.
pub const MAX_PERIOD: Duration = Duration::from_secs(366 * 24 * 3600);

/// The period when an action does not set one: the UTC day.
pub const DAY: Duration = Duration::from_secs(24 * 3600);

/// A quota: `limit` per `period`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quota {
    limit: u32,
    period_ns: u64,
}

/// One window: `[start, end)` in nanoseconds since the epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub index: u64,
    pub start_ns: u64,
    pub end_ns: u64,
}

impl Quota {
    /// `None` for a limit of 0, which the action's mode turns into off or closed.
    pub fn new(limit: u32, period: Duration) -> Option<Self> {
        let period_ns = duration_ns(period);
        (limit > 0 && period_ns > 0).then_some(Self { limit, period_ns })
    }

    /// The length of a window.
    pub fn period(&self) -> Duration {
        Duration::from_nanos(self.period_ns)
    }

    /// The window `now` falls in.
    pub fn window(&self, now: u64) -> Window {
        let index = now / self.period_ns;
        let start_ns = index * self.period_ns;
        Window {
            index,
            start_ns,
            end_ns: start_ns.saturating_add(self.period_ns),
        }
    }

    /// How long a key outlives its window: a twenty-fourth of the period, from one second to
    /// one hour (a daily quota's key lives 25 hours). A wall clock stepped back across the
    /// window's edge then still finds the window's count, and Redis, which expires keys on its
    /// own, never drops one a check is about to read.
    pub fn expiry_margin(&self) -> Duration {
        Duration::from_nanos(self.period_ns / 24).clamp(MIN_PERIOD, Duration::from_secs(3600))
    }

    /// The count `state` holds for `window`: 0 for another window (or a fresh key).
    fn used(state: u64, window: &Window) -> u32 {
        if state >> 32 == window.index & u64::from(u32::MAX) {
            state as u32
        } else {
            0
        }
    }

    fn pack(window: &Window, used: u32) -> u64 {
        (window.index & u64::from(u32::MAX)) << 32 | u64::from(used)
    }
}

impl Algorithm for Quota {
    const OVERSIZED: Outcome = Outcome::CostExceedsLimit;

    fn capacity(&self) -> u32 {
        self.limit
    }

    fn evaluate(&self, state: u64, now: u64, cost: u32) -> Evaluation {
        let window = self.window(now);
        let used = Self::used(state, &window);
        let left = self.limit - used;
        let rollover = window.end_ns - now;
        if cost <= left {
            return Evaluation {
                allowed: true,
                new_state: Self::pack(&window, used + cost),
                remaining: left - cost,
                retry_after_ns: 0,
                reset_after_ns: rollover,
            };
        }
        Evaluation {
            allowed: false,
            new_state: state,
            remaining: left,
            // A cost within the limit fits as soon as the window rolls over.
            retry_after_ns: if cost > self.limit {
                u64::MAX
            } else {
                rollover
            },
            reset_after_ns: if used == 0 { 0 } else { rollover },
        }
    }

    /// Idle once nothing is spent in the current window and the margin past the key's own
    /// window is over.
    fn is_idle(&self, state: u64, now: u64) -> bool {
        let window = self.window(now);
        if Self::used(state, &window) > 0 {
            return false;
        }
        let age = (window.index as u32).wrapping_sub((state >> 32) as u32);
        // Spent one window ago: kept until the margin into this one has passed.
        state as u32 == 0 || age != 1 || now - window.start_ns >= duration_ns(self.expiry_margin())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buckets::cell::Cell;

    const SEC: u64 = 1_000_000_000;
    const DAY_NS: u64 = 86_400 * SEC;
    /// 2026-12-01T00:00:00Z.
    const DEC_1: u64 = 1_796_083_200 * SEC;

    fn daily(limit: u32) -> Quota {
        Quota::new(limit, DAY).unwrap()
    }

    #[test]
    fn a_day_is_the_utc_day() {
        let window = daily(5).window(DEC_1 + 13 * 3600 * SEC);
        assert_eq!((window.start_ns, window.end_ns), (DEC_1, DEC_1 + DAY_NS));
        assert_eq!(daily(5).expiry_margin(), Duration::from_secs(3600));
        let hourly = Quota::new(5, Duration::from_secs(3600)).unwrap();
        assert_eq!(hourly.expiry_margin(), Duration::from_secs(150));
        assert_eq!(
            Quota::new(5, Duration::from_secs(2))
                .unwrap()
                .expiry_margin(),
            Duration::from_secs(1)
        );
    }

    #[test]
    fn the_allowance_is_spent_all_or_nothing_and_comes_back_at_midnight() {
        let quota = daily(10);
        let cell = Cell::default();
        let evening = DEC_1 + DAY_NS - 10 * SEC;
        let e = cell.take(&quota, evening, 7, true);
        assert!(e.allowed);
        assert_eq!(
            (e.remaining, e.retry_after_ns, e.reset_after_ns),
            (3, 0, 10 * SEC)
        );
        let refused = cell.take(&quota, evening, 4, true);
        assert!(!refused.allowed);
        assert_eq!(refused.remaining, 3, "a refusal consumes nothing");
        assert_eq!(refused.retry_after_ns, 10 * SEC, "until midnight UTC");
        assert_eq!(refused.reset_after_ns, 10 * SEC);
        assert!(cell.take(&quota, evening, 3, true).allowed);
        assert!(!cell.take(&quota, DEC_1 + DAY_NS - 1, 1, true).allowed);
        let midnight = cell.take(&quota, DEC_1 + DAY_NS, 10, true);
        assert!(midnight.allowed, "a new day, a new allowance");
        assert_eq!((midnight.remaining, midnight.reset_after_ns), (0, DAY_NS));
    }

    #[test]
    fn a_cost_above_the_limit_never_fits() {
        let quota = daily(10);
        let e = quota.evaluate(0, DEC_1, 11);
        assert!(!e.allowed);
        assert_eq!(
            (e.retry_after_ns, e.remaining, e.reset_after_ns),
            (u64::MAX, 10, 0)
        );
        assert_eq!(quota.capacity(), 10);
    }

    #[test]
    fn keys_expire_a_margin_after_their_window() {
        let quota = daily(10);
        let cell = Cell::default();
        assert!(
            quota.is_idle(cell.state(), DEC_1),
            "a fresh key holds nothing"
        );
        cell.take(&quota, DEC_1 + 5 * SEC, 1, true);
        let state = cell.state();
        assert!(!quota.is_idle(state, DEC_1 + DAY_NS - 1));
        assert!(
            !quota.is_idle(state, DEC_1 + DAY_NS + 3599 * SEC),
            "within the margin"
        );
        assert!(quota.is_idle(state, DEC_1 + DAY_NS + 3600 * SEC));
        assert!(quota.is_idle(state, DEC_1 + 40 * DAY_NS));
        // A wall clock stepped back across midnight within the margin finds the day's count.
        assert_eq!(quota.evaluate(state, DEC_1 + 6 * SEC, 10).remaining, 9);
    }

    #[test]
    fn epoch_aligned_periods() {
        let weekly = Quota::new(3, Duration::from_secs(7 * 86_400)).unwrap();
        // The epoch was a Thursday: weeks run Thursday to Thursday.
        let window = weekly.window(DEC_1);
        assert_eq!(window.start_ns % (7 * DAY_NS), 0);
        assert!(window.start_ns <= DEC_1 && DEC_1 < window.end_ns);
        assert!(Quota::new(0, DAY).is_none());
    }
}

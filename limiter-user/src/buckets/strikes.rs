//! Strikes against a broker's connection: each refused check on it counts one, an oversize
//! payload `oversize-strikes`; a connection that collects `strikes-to-disconnect` within
//! `strike-window` is to be closed, and every check it makes until the broker reports it gone
//! is answered `disconnect`, so what it sends meanwhile is dropped.
//!
//! The window runs from a count's first strike (as escalation's does): a strike after it has
//! passed starts a new count, so a connection refused now and then, fewer than the threshold
//! times per window, is never closed. One record per connection that has struck, kept beside
//! the action's buckets and bounded by its `max-keys`; a record with no strike (or, once
//! disconnected, no check) for a whole window is swept, as is one the broker reports gone.

use std::{
    sync::atomic::{AtomicUsize, Ordering},
    time::Duration,
};

use dashmap::{DashMap, mapref::entry::Entry};
use foldhash::quality::RandomState;
use serde::Serialize;

use super::bucket_keys::StoredKey;

use crate::duration_units::duration_ns;

/// An action's strike settings, validated (`strikes-to-disconnect` ≥ 1, a window above zero,
/// `oversize-strikes` ≥ 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct StrikeRule {
    /// Strikes within the window that close the connection.
    pub to_disconnect: u32,
    #[serde(
        rename = "window_ms",
        serialize_with = "crate::duration_units::serialize_ms"
    )]
    pub window: Duration,
    /// What one payload over `max-payload-bytes` weighs.
    pub oversize: u32,
}

/// One connection's strikes: the count since `since` (clock ns), the last time it was seen
/// striking or, once disconnected, checking.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Strikes {
    count: u32,
    since: u64,
    last: u64,
    disconnected: bool,
}

/// What a strike did to its connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Struck {
    /// Counted; the connection stays.
    Counted,
    /// This strike took the count to the threshold: the connection is to be closed, and the
    /// event log says so (only here, so once per connection).
    Disconnects { strikes: u32 },
    /// Closed by an earlier strike.
    Closed,
}

impl Struck {
    /// Whether the connection is to be closed.
    pub fn disconnects(self) -> bool {
        self != Self::Counted
    }
}

impl Strikes {
    /// Adds `weight` strikes at `now`; the connection is closed once it has collected enough
    /// (and from then on).
    pub fn strike(&mut self, rule: &StrikeRule, now: u64, weight: u32) -> Struck {
        self.last = now;
        if self.disconnected {
            return Struck::Closed;
        }
        if weight == 0 {
            return Struck::Counted;
        }
        if self.count == 0 || now.saturating_sub(self.since) >= window_ns(rule) {
            self.count = 0;
            self.since = now;
        }
        self.count = self.count.saturating_add(weight);
        self.disconnected = self.count >= rule.to_disconnect;
        if self.disconnected {
            Struck::Disconnects {
                strikes: self.count,
            }
        } else {
            Struck::Counted
        }
    }

    /// Strikes in the current count.
    pub fn count(&self) -> u32 {
        self.count
    }

    pub fn disconnected(&self) -> bool {
        self.disconnected
    }

    /// Whether the record holds nothing a connection with no record would not: no strike
    /// within the window, or a disconnected connection silent for a whole window (its broker
    /// has surely closed it).
    pub fn is_idle(&self, rule: &StrikeRule, now: u64) -> bool {
        now.saturating_sub(self.last) >= window_ns(rule)
    }
}

fn window_ns(rule: &StrikeRule) -> u64 {
    duration_ns(rule.window)
}

/// The records of an action's connections that have struck.
#[derive(Default)]
pub struct StrikeBook {
    records: DashMap<StoredKey, Strikes, RandomState>,
    tracked: AtomicUsize,
}

impl StrikeBook {
    /// Whether `key` has been disconnected; a check from it is then refused at once. Notes it
    /// as seen, so a connection still sending is not forgotten.
    pub fn disconnected(&self, key: &StoredKey, now: u64, note: bool) -> bool {
        match self.records.get_mut(key) {
            Some(mut record) if record.disconnected => {
                if note {
                    record.last = now;
                }
                true
            }
            _ => false,
        }
    }

    /// Adds `weight` strikes to `key`'s record (made if it has none and the book is under
    /// `max` records; a connection beyond is not counted), under the record's lock, so one
    /// strike of all those racing on a connection is the one that closes it.
    pub fn strike(
        &self,
        rule: &StrikeRule,
        key: &StoredKey,
        now: u64,
        weight: u32,
        max: usize,
    ) -> Struck {
        if let Some(mut record) = self.records.get_mut(key) {
            return record.strike(rule, now, weight);
        }
        if self.tracked.fetch_add(1, Ordering::AcqRel) >= max {
            self.tracked.fetch_sub(1, Ordering::AcqRel);
            return Struck::Counted;
        }
        match self.records.entry(*key) {
            Entry::Occupied(mut occupied) => {
                self.tracked.fetch_sub(1, Ordering::AcqRel);
                occupied.get_mut().strike(rule, now, weight)
            }
            Entry::Vacant(vacant) => vacant.insert(Strikes::default()).strike(rule, now, weight),
        }
    }

    /// Forgets `key`'s record; true if it had one.
    pub fn forget(&self, key: &StoredKey) -> bool {
        let removed = self.records.remove(key).is_some();
        if removed {
            self.tracked.fetch_sub(1, Ordering::AcqRel);
        }
        removed
    }

    /// Forgets the idle records (all of them without a rule); returns how many went.
    pub fn sweep(&self, rule: Option<&StrikeRule>, now: u64) -> usize {
        let mut gone = 0;
        self.records.retain(|_, record| {
            let keep = rule.is_some_and(|rule| !record.is_idle(rule, now));
            gone += usize::from(!keep);
            keep
        });
        self.tracked.fetch_sub(gone, Ordering::AcqRel);
        gone
    }

    /// Connections with a record.
    pub fn tracked(&self) -> usize {
        self.tracked.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn rule(to_disconnect: u32, window_s: u64, oversize: u32) -> StrikeRule {
        StrikeRule {
            to_disconnect,
            window: Duration::from_secs(window_s),
            oversize,
        }
    }

    #[test]
    fn the_threshold_within_the_window_disconnects_and_stays() {
        let rule = rule(3, 10, 1);
        let mut s = Strikes::default();
        assert!(!s.strike(&rule, S, 1).disconnects());
        assert!(!s.strike(&rule, 5 * S, 1).disconnects());
        assert_eq!(s.count(), 2);
        assert_eq!(
            s.strike(&rule, 10 * S, 1),
            Struck::Disconnects { strikes: 3 },
            "third strike 9 s after the first"
        );
        // Disconnected for good: nothing more counts, every answer stays.
        assert_eq!(s.strike(&rule, 100 * S, 0), Struck::Closed);
        assert_eq!(s.strike(&rule, 101 * S, 1), Struck::Closed);
        assert!(s.disconnected());
    }

    #[test]
    fn a_count_whose_window_passed_starts_again() {
        let rule = rule(3, 10, 1);
        let mut s = Strikes::default();
        s.strike(&rule, 0, 1);
        s.strike(&rule, 9 * S, 1);
        // 10 s after the first strike: a new count, which this strike starts.
        assert!(!s.strike(&rule, 10 * S, 1).disconnects());
        assert_eq!(s.count(), 1);
        assert!(!s.strike(&rule, 11 * S, 1).disconnects());
        assert!(s.strike(&rule, 19 * S, 1).disconnects());
    }

    #[test]
    fn an_oversize_payload_weighs_its_strikes() {
        let rule = rule(5, 10, 3);
        let mut s = Strikes::default();
        assert!(!s.strike(&rule, 0, rule.oversize).disconnects());
        assert_eq!(s.count(), 3);
        assert_eq!(
            s.strike(&rule, S, rule.oversize),
            Struck::Disconnects { strikes: 6 },
            "3 + 3 reaches 5"
        );
        let mut heavy = Strikes::default();
        assert!(
            heavy.strike(&rule, 0, u32::MAX).disconnects(),
            "a weight never overflows the count"
        );
    }

    #[test]
    fn the_book_is_bounded_forgets_and_sweeps_idle_records() {
        let rule = rule(2, 10, 1);
        let book = StrikeBook::default();
        let key = |k: &[u8]| {
            crate::buckets::bucket_keys::store(crate::buckets::KeyKind::Connection, k).unwrap()
        };
        let (a, b) = (key(b"a"), key(b"b"));
        assert!(!book.strike(&rule, &a, 0, 1, 1).disconnects());
        // At the cap, another connection is not counted (and so never closed).
        assert!(!book.strike(&rule, &b, 0, 5, 1).disconnects());
        assert_eq!(book.tracked(), 1);
        assert!(book.strike(&rule, &a, S, 1, 1).disconnects());
        assert!(book.disconnected(&a, 5 * S, true));
        assert!(!book.disconnected(&b, 5 * S, true));
        // Seen at 5 s: not idle at 14 s, idle at 15 s.
        assert_eq!(book.sweep(Some(&rule), 14 * S), 0);
        assert_eq!(book.sweep(Some(&rule), 15 * S), 1);
        assert!(!book.disconnected(&a, 15 * S, true));
        assert!(!book.strike(&rule, &a, 16 * S, 1, 1).disconnects());
        assert!(book.forget(&a));
        assert!(!book.forget(&a));
        assert_eq!(book.tracked(), 0);
    }
}

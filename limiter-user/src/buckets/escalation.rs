//! Escalation: an address that fails authentication more than K times within W is banned for
//! T, once, so a brute-forcing client stops reaching the broker at all.
//!
//! Each address keeps the times of its last K+1 failures, which is exactly what "more than K
//! within W" needs and bounds the memory per address; the number of addresses is capped too.

use std::{
    collections::VecDeque,
    net::IpAddr,
    sync::{
        Arc, RwLock,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use dashmap::{DashMap, mapref::entry::Entry};
use limiter_client::Escalation;
use serde::Serialize;

use super::{
    ban::Banner,
    clock::{Clock, duration_ns},
};

/// Addresses tracked when the config does not say.
pub const DEFAULT_MAX_ADDRESSES: usize = 100_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EscalationConfig {
    /// K: failures tolerated within the window; one more bans.
    pub after: u32,
    /// W.
    pub window: Duration,
    /// T.
    pub ban: Duration,
    pub max_addresses: usize,
}

#[derive(Debug, Default)]
struct Record {
    failures: VecDeque<u64>,
    banned_until: Option<u64>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct EscalationStats {
    pub tracked_addresses: usize,
    pub bans: u64,
    pub ban_failures: u64,
    pub untracked: u64,
}

pub struct Escalator {
    /// `None`: escalation is off. A reload replaces it.
    config: RwLock<Option<EscalationConfig>>,
    clock: Arc<dyn Clock>,
    banner: Arc<dyn Banner>,
    records: DashMap<IpAddr, Record>,
    tracked: AtomicUsize,
    bans: AtomicU64,
    ban_failures: AtomicU64,
    untracked: AtomicU64,
}

impl Escalator {
    pub fn new(
        config: Option<EscalationConfig>,
        clock: Arc<dyn Clock>,
        banner: Arc<dyn Banner>,
    ) -> Self {
        Self {
            config: RwLock::new(config),
            clock,
            banner,
            records: DashMap::new(),
            tracked: AtomicUsize::new(0),
            bans: AtomicU64::new(0),
            ban_failures: AtomicU64::new(0),
            untracked: AtomicU64::new(0),
        }
    }

    pub fn config(&self) -> Option<EscalationConfig> {
        *self.config.read().expect("escalation lock")
    }

    /// Takes new settings (a reload). Failures counted so far count towards the new threshold
    /// within the new window; turning escalation off forgets them.
    pub fn reconfigure(&self, config: Option<EscalationConfig>) {
        *self.config.write().expect("escalation lock") = config;
        if config.is_none() {
            self.records.clear();
            self.tracked.store(0, Ordering::Release);
        }
    }

    pub fn record_failure(&self, addr: IpAddr) -> Escalation {
        let Some(config) = self.config() else {
            return Escalation::Off;
        };
        let addr = addr.to_canonical();
        self.banner.failure(addr);
        let now = self.clock.now_ns();
        let window = duration_ns(config.window);
        {
            let mut record = match self.records.entry(addr) {
                Entry::Occupied(occupied) => occupied.into_ref(),
                Entry::Vacant(vacant) => {
                    if self.tracked.fetch_add(1, Ordering::AcqRel) >= config.max_addresses {
                        self.tracked.fetch_sub(1, Ordering::AcqRel);
                        self.untracked.fetch_add(1, Ordering::Relaxed);
                        return Escalation::Untracked;
                    }
                    vacant.insert(Record::default())
                }
            };
            match record.banned_until {
                Some(until) if until > now => return Escalation::AlreadyBanned,
                Some(_) => record.banned_until = None,
                None => {}
            }
            while record
                .failures
                .front()
                .is_some_and(|&at| now.saturating_sub(at) >= window)
            {
                record.failures.pop_front();
            }
            record.failures.push_back(now);
            let count = record.failures.len();
            if count > config.after as usize {
                record.failures.clear();
                record.banned_until = Some(now.saturating_add(duration_ns(config.ban)));
            } else {
                return Escalation::Counted {
                    failures: count as u32,
                };
            }
        }
        // The ban runs outside the map's lock: it is a syscall in the agent.
        match self.banner.ban(addr, config.ban) {
            Ok(()) => {
                self.bans.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%addr, ttl = ?config.ban, "escalated to a ban");
                Escalation::Banned
            }
            Err(error) => {
                self.ban_failures.fetch_add(1, Ordering::Relaxed);
                let error = crate::errors::error_chain(&error);
                tracing::error!(%addr, %error, "escalation could not ban");
                if let Some(mut record) = self.records.get_mut(&addr) {
                    record.banned_until = None;
                }
                Escalation::BanFailed
            }
        }
    }

    /// Forgets an address, so an operator's unban also restarts its count.
    pub fn forget(&self, addr: IpAddr) {
        if self.records.remove(&addr.to_canonical()).is_some() {
            self.tracked.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Drops addresses with no failure inside the window and no ban in force.
    pub fn sweep(&self) -> usize {
        let Some(config) = self.config() else {
            return 0;
        };
        let now = self.clock.now_ns();
        let window = duration_ns(config.window);
        let mut removed = 0;
        self.records.retain(|_, record| {
            let banned = record.banned_until.is_some_and(|until| until > now);
            let recent = record
                .failures
                .back()
                .is_some_and(|&at| now.saturating_sub(at) < window);
            let keep = banned || recent;
            removed += usize::from(!keep);
            keep
        });
        self.tracked.fetch_sub(removed, Ordering::AcqRel);
        removed
    }

    pub fn stats(&self) -> EscalationStats {
        EscalationStats {
            tracked_addresses: self.tracked.load(Ordering::Acquire),
            bans: self.bans.load(Ordering::Relaxed),
            ban_failures: self.ban_failures.load(Ordering::Relaxed),
            untracked: self.untracked.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::buckets::{ban::BanError, clock::ManualClock};

    /// Records every call; can be told to fail.
    #[derive(Default)]
    pub(crate) struct RecordingBanner {
        pub calls: Mutex<Vec<(IpAddr, Option<Duration>)>>,
        pub fail: std::sync::atomic::AtomicBool,
    }

    impl Banner for RecordingBanner {
        fn ban(&self, addr: IpAddr, ttl: Duration) -> Result<(), BanError> {
            if self.fail.load(Ordering::SeqCst) {
                return Err(BanError::Failed {
                    addr,
                    source: "told to fail".into(),
                });
            }
            self.calls.lock().unwrap().push((addr, Some(ttl)));
            Ok(())
        }
        fn unban(&self, addr: IpAddr) -> Result<bool, BanError> {
            let mut calls = self.calls.lock().unwrap();
            let banned = calls.iter().any(|(a, ttl)| *a == addr && ttl.is_some());
            calls.push((addr, None));
            Ok(banned)
        }
    }

    fn setup(after: u32, max: usize) -> (Arc<ManualClock>, Arc<RecordingBanner>, Escalator) {
        let clock = Arc::new(ManualClock::new());
        let banner = Arc::new(RecordingBanner::default());
        let config = EscalationConfig {
            after,
            window: Duration::from_secs(60),
            ban: Duration::from_secs(600),
            max_addresses: max,
        };
        let escalator = Escalator::new(Some(config), clock.clone(), banner.clone());
        (clock, banner, escalator)
    }

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(192, 0, 2, 7));

    #[test]
    fn more_than_k_within_w_bans_once() {
        let (clock, banner, esc) = setup(3, 10);
        for n in 1..=3 {
            assert_eq!(esc.record_failure(A), Escalation::Counted { failures: n });
            clock.advance(Duration::from_secs(10));
        }
        assert_eq!(esc.record_failure(A), Escalation::Banned);
        for _ in 0..5 {
            assert_eq!(esc.record_failure(A), Escalation::AlreadyBanned);
        }
        assert_eq!(
            *banner.calls.lock().unwrap(),
            vec![(A, Some(Duration::from_secs(600)))]
        );
        // After the ban lapses counting starts again from zero.
        clock.advance(Duration::from_secs(601));
        assert_eq!(esc.record_failure(A), Escalation::Counted { failures: 1 });
    }

    #[test]
    fn failures_spread_wider_than_w_never_ban() {
        let (clock, banner, esc) = setup(3, 10);
        for _ in 0..50 {
            assert!(matches!(esc.record_failure(A), Escalation::Counted { .. }));
            clock.advance(Duration::from_secs(20));
        }
        assert!(banner.calls.lock().unwrap().is_empty());
    }

    #[test]
    fn a_failed_ban_is_retried_on_the_next_failure() {
        let (_clock, banner, esc) = setup(1, 10);
        banner.fail.store(true, Ordering::SeqCst);
        esc.record_failure(A);
        assert_eq!(esc.record_failure(A), Escalation::BanFailed);
        banner.fail.store(false, Ordering::SeqCst);
        esc.record_failure(A);
        assert_eq!(esc.record_failure(A), Escalation::Banned);
        assert_eq!(esc.stats().ban_failures, 1);
        assert_eq!(esc.stats().bans, 1);
    }

    #[test]
    fn memory_is_bounded_and_swept() {
        let (clock, _banner, esc) = setup(5, 2);
        let b: IpAddr = "192.0.2.8".parse().unwrap();
        let c: IpAddr = "192.0.2.9".parse().unwrap();
        esc.record_failure(A);
        esc.record_failure(b);
        assert_eq!(esc.record_failure(c), Escalation::Untracked);
        assert_eq!(esc.stats().tracked_addresses, 2);
        clock.advance(Duration::from_secs(60));
        assert_eq!(esc.sweep(), 2);
        assert_eq!(esc.stats().tracked_addresses, 0);
        assert_eq!(esc.record_failure(c), Escalation::Counted { failures: 1 });
    }
}

//! Escalation: an address that fails authentication more than K times within W is banned for
//! T, once, so a brute-forcing client stops reaching the broker at all; so is one whose
//! connection attempts the kernel refused at their proven handshakes, over its cap or its SYN
//! rate, for longer than a set time (kernel escalation). An address banned again
//! within a memory window of its last ban's end is banned longer (fail2ban's
//! `bantime.increment`): T times the factor for each ban before it in the run, up to a ceiling,
//! so a patient attacker who waits out each ban gains less with each round.
//!
//! Each address keeps the times of its last K+1 failures, which is exactly what "more than K
//! within W" needs and bounds the memory per address, and its run of bans; the number of
//! addresses is capped too.

use std::{
    collections::VecDeque,
    net::IpAddr,
    sync::{
        Arc, RwLock,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use dashmap::{DashMap, mapref::entry::Entry};
use limiter_client::Escalation;
use serde::Serialize;

use crate::events::{self, BanCause, Event};

use super::{ban::Banner, clock::Clock};
use crate::duration_units::duration_ns;

/// Addresses tracked when the config does not say.
pub const DEFAULT_MAX_ADDRESSES: usize = 100_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EscalationConfig {
    /// K: failures tolerated within the window; one more bans. `None`: failures never ban.
    pub after: Option<u32>,
    /// Kernel escalation: a source refused at its proven handshakes for this long is banned
    /// (see [`Escalator::record_refused`]). `None`: off.
    pub refused_for: Option<Duration>,
    /// W.
    pub window: Duration,
    /// T: the first ban's length.
    pub ban: Duration,
    /// How a repeat offender's bans grow.
    pub increment: BanIncrement,
    pub max_addresses: usize,
}

/// Repeat offenders' longer bans.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BanIncrement {
    /// Each ban in a run lasts this many times the one before; 1 keeps every ban at T.
    pub factor: u32,
    /// The longest a ban grows to.
    pub max_ban: Duration,
    /// A ban that begins within this long of the previous one's end continues the run; later,
    /// the run starts over at T.
    pub memory: Duration,
}

impl BanIncrement {
    /// Every ban lasts T.
    pub const OFF: Self = Self {
        factor: 1,
        max_ban: Duration::ZERO,
        memory: Duration::ZERO,
    };

    fn on(&self) -> bool {
        self.factor > 1
    }
}

impl EscalationConfig {
    /// The length of the `nth` ban of a run (the first is 1): T × factor^(n−1), at most the
    /// ceiling. A pure function of the settings, so a test needs no clock.
    pub fn ban_for(&self, nth: u32) -> Duration {
        if !self.increment.on() || nth <= 1 {
            return self.ban;
        }
        let ceiling = self.increment.max_ban.max(self.ban);
        self.increment
            .factor
            .checked_pow(nth - 1)
            .and_then(|times| self.ban.checked_mul(times))
            .map_or(ceiling, |ttl| ttl.min(ceiling))
    }
}

#[derive(Debug, Default)]
struct Record {
    failures: VecDeque<u64>,
    /// The end of the last ban (in force while it is ahead of the clock).
    banned_until: Option<u64>,
    /// Bans in the current run.
    run: u32,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct EscalationStats {
    pub tracked_addresses: usize,
    pub bans: u64,
    pub ban_failures: u64,
    pub untracked: u64,
    /// Bans monitor mode did not place.
    pub would_ban: u64,
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
    /// Monitor mode: a ban escalation would place is counted in `would_ban`, not placed.
    monitor: AtomicBool,
    would_ban: AtomicU64,
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
            monitor: AtomicBool::new(false),
            would_ban: AtomicU64::new(0),
        }
    }

    /// Monitor mode on or off (the top-level `mode`, live on reload).
    pub fn set_monitor(&self, monitor: bool) {
        self.monitor.store(monitor, Ordering::Relaxed);
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
        let Some(after) = config.after else {
            return Escalation::Off;
        };
        let addr = addr.to_canonical();
        self.banner.failure(addr);
        let now = self.clock.now_ns();
        let window = duration_ns(config.window);
        {
            let Some(mut record) = self.record(addr, &config) else {
                return Escalation::Untracked;
            };
            if record.banned_until.is_some_and(|until| until > now) {
                return Escalation::AlreadyBanned;
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
            if count <= after as usize {
                return Escalation::Counted {
                    failures: count as u32,
                };
            }
            record.failures.clear();
        }
        let failures = after.saturating_add(1);
        match self.ban_next(addr, &config, now, false, |nth| BanCause::Escalation {
            failures,
            nth,
        }) {
            // Monitor mode: judged, not placed.
            Escalation::Counted { .. } => Escalation::Counted { failures },
            answer => answer,
        }
    }

    /// Kernel escalation: the kernel refused `addr`'s connection attempts at their proven
    /// handshakes, over its cap or SYN rate, in a streak `refused` long. Past `refused_for`,
    /// it is banned as the next ban of its run (a repeat offender's longer, the same run as
    /// its failures'), or in monitor mode, or when a refusal of the streak was only judged
    /// on a monitored port (`monitored`), counted as a ban not placed.
    pub fn record_refused(&self, addr: IpAddr, refused: Duration, monitored: bool) -> Escalation {
        let Some(config) = self.config() else {
            return Escalation::Off;
        };
        let Some(threshold) = config.refused_for else {
            return Escalation::Off;
        };
        if refused < threshold {
            return Escalation::Counted { failures: 0 };
        }
        let addr = addr.to_canonical();
        let now = self.clock.now_ns();
        let seconds = refused.as_secs();
        self.ban_next(addr, &config, now, monitored, |nth| BanCause::Refused {
            seconds,
            nth,
        })
    }

    /// `addr`'s record, made if it has none and the cap allows; `None` at the cap.
    fn record(
        &self,
        addr: IpAddr,
        config: &EscalationConfig,
    ) -> Option<dashmap::mapref::one::RefMut<'_, IpAddr, Record>> {
        Some(match self.records.entry(addr) {
            Entry::Occupied(occupied) => occupied.into_ref(),
            Entry::Vacant(vacant) => {
                if self.tracked.fetch_add(1, Ordering::AcqRel) >= config.max_addresses {
                    self.tracked.fetch_sub(1, Ordering::AcqRel);
                    self.untracked.fetch_add(1, Ordering::Relaxed);
                    return None;
                }
                vacant.insert(Record::default())
            }
        })
    }

    /// Bans `addr` as the next ban of its run, for the length [`EscalationConfig::ban_for`]
    /// gives its place (`cause` says why, from that place); in monitor mode (or `monitored`:
    /// the judgement was a monitored port's) only counts and logs the ban it would place, the
    /// run left as it was, and answers `Counted`.
    fn ban_next(
        &self,
        addr: IpAddr,
        config: &EscalationConfig,
        now: u64,
        monitored: bool,
        cause: impl FnOnce(u32) -> BanCause,
    ) -> Escalation {
        let (before, ttl, nth) = {
            let Some(mut record) = self.record(addr, config) else {
                return Escalation::Untracked;
            };
            if record.banned_until.is_some_and(|until| until > now) {
                return Escalation::AlreadyBanned;
            }
            let before = (record.banned_until, record.run);
            record.run = match record.banned_until {
                Some(end) if now.saturating_sub(end) < duration_ns(config.increment.memory) => {
                    record.run.saturating_add(1)
                }
                _ => 1,
            };
            let ttl = config.ban_for(record.run);
            record.banned_until = Some(now.saturating_add(duration_ns(ttl)));
            (before, ttl, record.run)
        };
        let cause = cause(nth);
        if monitored || self.monitor.load(Ordering::Relaxed) {
            // Judged and counted, not placed: the address stays unbanned and its run as it
            // was, so the figures read as enforcement's would.
            self.would_ban.fetch_add(1, Ordering::Relaxed);
            if let Some(mut record) = self.records.get_mut(&addr) {
                (record.banned_until, record.run) = before;
            }
            tracing::info!(%addr, ?ttl, "monitor mode: would have escalated to a ban");
            events::emit(&Event::WouldBan { addr, cause, ttl });
            return Escalation::Counted { failures: 0 };
        }
        // The ban runs outside the map's lock: it is a syscall in the agent.
        match self.banner.ban(addr, ttl) {
            Ok(()) => {
                self.bans.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%addr, ?ttl, "escalated to a ban");
                events::emit(&Event::Ban { addr, cause, ttl });
                Escalation::Banned
            }
            Err(error) => {
                self.ban_failures.fetch_add(1, Ordering::Relaxed);
                let error = crate::errors::error_chain(&error);
                tracing::error!(%addr, %error, "escalation could not ban");
                // Not banned: the run is as it was.
                if let Some(mut record) = self.records.get_mut(&addr) {
                    (record.banned_until, record.run) = before;
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
        // A ban's end is remembered as long as a next ban would continue its run.
        let memory = if config.increment.on() {
            duration_ns(config.increment.memory)
        } else {
            0
        };
        let mut removed = 0;
        self.records.retain(|_, record| {
            let remembered = record
                .banned_until
                .is_some_and(|until| until > now || now - until < memory);
            let recent = record
                .failures
                .back()
                .is_some_and(|&at| now.saturating_sub(at) < window);
            let keep = remembered || recent;
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
            would_ban: self.would_ban.load(Ordering::Relaxed),
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
            after: Some(after),
            refused_for: None,
            window: Duration::from_secs(60),
            ban: Duration::from_secs(600),
            increment: BanIncrement::OFF,
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

    /// Escalation after 1 failure, bans of 10m doubling up to 30m, a run kept 1h past a ban.
    fn incrementing() -> (Arc<ManualClock>, Arc<RecordingBanner>, Escalator) {
        let clock = Arc::new(ManualClock::new());
        let banner = Arc::new(RecordingBanner::default());
        let config = EscalationConfig {
            after: Some(1),
            refused_for: None,
            window: Duration::from_secs(60),
            ban: Duration::from_secs(600),
            increment: BanIncrement {
                factor: 2,
                max_ban: Duration::from_secs(1800),
                memory: Duration::from_secs(3600),
            },
            max_addresses: 10,
        };
        let escalator = Escalator::new(Some(config), clock.clone(), banner.clone());
        (clock, banner, escalator)
    }

    /// Fails twice: past the threshold of one.
    fn offend(esc: &Escalator) -> Escalation {
        esc.record_failure(A);
        esc.record_failure(A)
    }

    fn bans(banner: &RecordingBanner) -> Vec<u64> {
        let calls = banner.calls.lock().unwrap();
        calls
            .iter()
            .filter_map(|(_, ttl)| ttl.map(|t| t.as_secs()))
            .collect()
    }

    #[test]
    fn a_repeat_offender_is_banned_longer_up_to_the_ceiling() {
        let (clock, banner, esc) = incrementing();
        let mut lengths = Vec::new();
        for _ in 0..4 {
            assert_eq!(offend(&esc), Escalation::Banned);
            let ttl = *bans(&banner).last().unwrap();
            lengths.push(ttl);
            // Banned for all of it, not a second less...
            clock.advance(Duration::from_secs(ttl - 1));
            assert_eq!(esc.record_failure(A), Escalation::AlreadyBanned);
            // ...and back 10 minutes after it ended: within the memory.
            clock.advance(Duration::from_secs(1 + 600));
            esc.sweep();
        }
        assert_eq!(lengths, [600, 1200, 1800, 1800]);
    }

    #[test]
    fn a_run_starts_over_once_the_memory_has_passed() {
        let (clock, banner, esc) = incrementing();
        assert_eq!(offend(&esc), Escalation::Banned);
        clock.advance(Duration::from_secs(600 + 3600));
        // The sweep forgets the address, as it would the run itself.
        assert_eq!(esc.sweep(), 1);
        assert_eq!(offend(&esc), Escalation::Banned);
        clock.advance(Duration::from_secs(600 + 3599));
        assert_eq!(esc.sweep(), 0, "still remembered within the memory");
        assert_eq!(offend(&esc), Escalation::Banned);
        assert_eq!(bans(&banner), [600, 600, 1200]);
    }

    #[test]
    fn an_unban_forgets_the_run_and_a_failed_ban_does_not_lengthen_it() {
        let (clock, banner, esc) = incrementing();
        assert_eq!(offend(&esc), Escalation::Banned);
        clock.advance(Duration::from_secs(700));
        banner.fail.store(true, Ordering::SeqCst);
        assert_eq!(offend(&esc), Escalation::BanFailed);
        banner.fail.store(false, Ordering::SeqCst);
        assert_eq!(offend(&esc), Escalation::Banned);
        esc.forget(A);
        assert_eq!(offend(&esc), Escalation::Banned);
        assert_eq!(bans(&banner), [600, 1200, 600]);
    }

    #[test]
    fn refusals_past_their_time_ban_in_the_same_run_as_failures() {
        let (clock, banner, esc) = incrementing();
        let config = EscalationConfig {
            refused_for: Some(Duration::from_secs(30)),
            ..esc.config().unwrap()
        };
        esc.reconfigure(Some(config));
        let short = Duration::from_secs(29);
        assert_eq!(
            esc.record_refused(A, short, false),
            Escalation::Counted { failures: 0 }
        );
        assert!(bans(&banner).is_empty(), "refused for less than 30 s");
        let long = Duration::from_secs(31);
        assert_eq!(esc.record_refused(A, long, false), Escalation::Banned);
        assert_eq!(
            esc.record_refused(A, long, false),
            Escalation::AlreadyBanned
        );
        // Back after the ban, it fails to log in: the next ban of the same run, twice as long.
        clock.advance(Duration::from_secs(601));
        assert_eq!(offend(&esc), Escalation::Banned);
        assert_eq!(bans(&banner), [600, 1200]);
        // Without a time, refusals never ban; failures still do.
        esc.reconfigure(Some(EscalationConfig {
            refused_for: None,
            ..config
        }));
        assert_eq!(esc.record_refused(A, long, false), Escalation::Off);
    }

    #[test]
    fn a_monitored_streak_bans_no_one_and_counts_the_ban_it_did_not_place() {
        let (_clock, banner, esc) = incrementing();
        esc.reconfigure(Some(EscalationConfig {
            after: None,
            refused_for: Some(Duration::from_secs(30)),
            ..esc.config().unwrap()
        }));
        let long = Duration::from_secs(31);
        // Judged on a monitored port: no ban, even where escalation enforces.
        assert_eq!(
            esc.record_refused(A, long, true),
            Escalation::Counted { failures: 0 }
        );
        esc.set_monitor(true);
        assert_eq!(
            esc.record_refused(A, long, false),
            Escalation::Counted { failures: 0 }
        );
        assert!(bans(&banner).is_empty());
        assert_eq!(esc.stats().would_ban, 2);
        assert_eq!(esc.record_failure(A), Escalation::Off, "failures never ban");
    }

    #[test]
    fn ban_lengths_grow_by_the_factor_and_never_overflow() {
        let config = EscalationConfig {
            after: Some(1),
            refused_for: None,
            window: Duration::from_secs(60),
            ban: Duration::from_secs(60),
            increment: BanIncrement {
                factor: 3,
                max_ban: Duration::from_secs(366 * 86_400),
                memory: Duration::from_secs(86_400),
            },
            max_addresses: 1,
        };
        let secs = |n| config.ban_for(n).as_secs();
        assert_eq!([secs(0), secs(1), secs(2), secs(3)], [60, 60, 180, 540]);
        assert_eq!(secs(u32::MAX), 366 * 86_400);
        let off = EscalationConfig {
            increment: BanIncrement::OFF,
            ..config
        };
        assert_eq!(off.ban_for(9), Duration::from_secs(60));
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

//! Where the buckets get the time: the agent reads a monotonic clock, tests turn a manual one,
//! so the arithmetic is checked to the nanosecond without sleeping.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, SystemTime},
};

use crate::duration_units::duration_ns;

/// Two readings: a monotonic one for rates, and the calendar for quotas.
pub trait Clock: Send + Sync {
    /// Nanoseconds since the clock's own origin. Only differences matter, and a monotonic
    /// origin means a wall-clock step (NTP, an operator) can neither refill nor drain a bucket.
    fn now_ns(&self) -> u64;

    /// Nanoseconds since the UNIX epoch (UTC). A quota's window is a calendar period, "today
    /// in UTC", which only the wall clock can say; a step of the wall clock moves the window
    /// edge with it, as it moves every other calendar boundary on the host.
    fn unix_ns(&self) -> u64;
}

/// The process's monotonic clock, counted from when the limiter was built. It reads the CPU's
/// time-stamp counter through `quanta` where that is reliable: a system call per check would
/// cost more than the check itself.
#[derive(Debug)]
pub struct MonotonicClock {
    clock: quanta::Clock,
    origin: u64,
}

impl MonotonicClock {
    pub fn new() -> Self {
        let clock = quanta::Clock::new();
        let origin = clock.raw();
        Self { clock, origin }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_ns(&self) -> u64 {
        self.clock.delta_as_nanos(self.origin, self.clock.raw())
    }

    fn unix_ns(&self) -> u64 {
        // Through the vDSO: no system call. A clock set before 1970 reads as the epoch.
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, duration_ns)
    }
}

/// A clock that moves only when told to, shared between a test and the limiter under test.
/// Both readings are the same number: its origin is the UNIX epoch, so a test sets it to a
/// calendar instant (say a second before midnight UTC) and rates still only see differences.
#[derive(Debug, Default)]
pub struct ManualClock {
    now: AtomicU64,
}

impl ManualClock {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn advance(&self, by: Duration) {
        self.now.fetch_add(duration_ns(by), Ordering::SeqCst);
    }

    pub fn set_ns(&self, now: u64) {
        self.now.store(now, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ns(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }

    fn unix_ns(&self) -> u64 {
        self.now_ns()
    }
}

/// Rounded up: a client that waits this long is guaranteed to find what it was promised.
pub fn ns_to_ms_ceil(ns: u64) -> u64 {
    ns.div_ceil(1_000_000)
}

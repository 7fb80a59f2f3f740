//! `syn-cookies = auto`: the programs answer unproven sources' SYNs with cookies while SYNs
//! flood the host, and leave them to the host again once it is calm.
//!
//! The decision is [`Switch`], a pure function of the SYN rate and the time; [`run`] reads
//! the rate from the kernel's counters once a second and writes the switch's bits.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use limiter_common::{Direction, Reason, Verdict, syn_cookies};

use crate::{
    datapath::{CookieMode, Enforcer},
    errors::error_chain,
    events::{self, CookieSwitch, Event},
};

/// How long the rate must stay under half the threshold before cookies go off.
pub const CALM: Duration = Duration::from_secs(10);
/// How long after cookies go off the ACKs of those already sent are still checked: the host
/// accepts a cookie for up to about two minutes, and an unchecked one would connect uncounted
/// until the sweeper adopted it.
pub const CHECK_AFTER: Duration = Duration::from_secs(180);

/// The auto mode's state.
#[derive(Clone, Copy, Debug, Default)]
pub struct Switch {
    on: bool,
    /// Since when the rate has been under half the threshold, while on.
    calm_since: Option<Instant>,
    /// When cookies last went off.
    off_since: Option<Instant>,
    /// The bits last returned (written).
    written: u8,
}

impl Switch {
    /// The [`syn_cookies`] bits for this state at `now`.
    pub fn bits(&self, now: Instant) -> u8 {
        if self.on {
            syn_cookies::ANSWER | syn_cookies::CHECK
        } else if self
            .off_since
            .is_some_and(|off| now.duration_since(off) < CHECK_AFTER)
        {
            syn_cookies::CHECK
        } else {
            0
        }
    }

    pub fn on(&self) -> bool {
        self.on
    }

    /// One reading of the SYNs a second; returns the new bits if they changed. On at once
    /// above `threshold`; off once under half of it for [`CALM`] (hysteresis: a flood
    /// hovering around the threshold does not flap).
    pub fn observe(&mut self, syns_per_second: u64, threshold: u32, now: Instant) -> Option<u8> {
        let threshold = u64::from(threshold);
        if !self.on {
            if syns_per_second > threshold {
                self.on = true;
                self.calm_since = None;
            }
        } else if syns_per_second * 2 < threshold {
            let calm_since = *self.calm_since.get_or_insert(now);
            if now.duration_since(calm_since) >= CALM {
                self.on = false;
                self.calm_since = None;
                self.off_since = Some(now);
            }
        } else {
            self.calm_since = None;
        }
        let bits = self.bits(now);
        (bits != std::mem::replace(&mut self.written, bits)).then_some(bits)
    }
}

/// The SYNs that reached the host or were answered with a cookie, as counted so far.
fn syns(enforcer: &Enforcer) -> Option<u64> {
    enforcer.with_maps(|maps| {
        let read = |verdict, reason| maps.packets(Direction::Ingress, verdict, reason);
        match (
            read(Verdict::Pass, Reason::HalfOpen),
            read(Verdict::Cookie, Reason::Unproven),
        ) {
            (Ok(passed), Ok(answered)) => Some(passed + answered),
            (Err(error), _) | (_, Err(error)) => {
                tracing::warn!(error = %error_chain(&error), "reading the SYN counters");
                None
            }
        }
    })
}

/// Runs the auto mode until `stop`: reads the SYN rate each second and switches the cookies
/// while the policy says `auto` (a reload that sets `off` or `always` takes over at once).
pub async fn run(enforcer: Arc<Enforcer>, stop: impl std::future::Future<Output = ()>) {
    let mut switch = Switch::default();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last: Option<(Instant, u64)> = None;
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => return,
            _ = tick.tick() => {}
        }
        let CookieMode::Auto { threshold } = enforcer.policy().cookies else {
            last = None;
            continue;
        };
        let now = Instant::now();
        let Some(count) = syns(&enforcer) else {
            continue;
        };
        let Some((then, before)) = last.replace((now, count)) else {
            continue;
        };
        let elapsed = now.duration_since(then).as_secs_f64().max(0.001);
        let rate = (count.saturating_sub(before) as f64 / elapsed) as u64;
        if let Some(bits) = switch.observe(rate, threshold, now) {
            if let Err(error) = enforcer.switch_auto_cookies(bits, switch.on()) {
                tracing::warn!(error = %error_chain(&error), "switching SYN cookies");
                continue;
            }
            let to = if bits & syn_cookies::ANSWER != 0 {
                tracing::info!(syns_per_second = rate, threshold, "SYN cookies on");
                CookieSwitch::On
            } else if bits == 0 {
                tracing::info!("SYN cookies no longer checked");
                CookieSwitch::Unchecked
            } else {
                tracing::info!(syns_per_second = rate, threshold, "SYN cookies off");
                CookieSwitch::Off
            };
            events::emit(&Event::SynCookies {
                to,
                syns_per_second: rate,
                threshold,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ANSWER_AND_CHECK: u8 = syn_cookies::ANSWER | syn_cookies::CHECK;

    #[test]
    fn on_above_the_threshold_off_after_a_calm_with_hysteresis() {
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        let mut switch = Switch::default();
        assert_eq!(
            switch.observe(1_000, 1_000, at(0)),
            None,
            "at it, not above"
        );
        assert_eq!(switch.observe(1_001, 1_000, at(1)), Some(ANSWER_AND_CHECK));
        // Hovering between half and the threshold keeps it on, however long.
        for s in 2..40 {
            assert_eq!(switch.observe(600, 1_000, at(s)), None);
        }
        assert!(switch.on());
        // Under half: off only after CALM of it, and a burst in between starts over.
        assert_eq!(switch.observe(100, 1_000, at(40)), None);
        assert_eq!(switch.observe(100, 1_000, at(45)), None);
        assert_eq!(switch.observe(900, 1_000, at(46)), None);
        assert_eq!(switch.observe(100, 1_000, at(47)), None);
        assert_eq!(switch.observe(100, 1_000, at(56)), None);
        assert_eq!(
            switch.observe(100, 1_000, at(57)),
            Some(syn_cookies::CHECK),
            "off, still checking the cookies sent"
        );
        assert_eq!(switch.observe(0, 1_000, at(57 + 179)), None);
        assert_eq!(switch.observe(0, 1_000, at(57 + 180)), Some(0));
        assert_eq!(
            switch.observe(5_000, 1_000, at(300)),
            Some(ANSWER_AND_CHECK)
        );
    }
}

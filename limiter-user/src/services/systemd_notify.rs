//! The agent's state told to the service manager (systemd's `Type=notify`), so that a unit
//! ordered after the agent (mosquitto, whose plugin asks it) starts only once the broker
//! socket and the HTTP listener serve: READY=1 then, RELOADING=1 and READY=1 around a SIGHUP
//! reload, STOPPING=1 on the way out, and the watchdog's ping while the runtime runs. Without
//! `NOTIFY_SOCKET` (not started by systemd) each is a no-op.

use std::{future::Future, time::Duration};

use sd_notify::NotifyState;

/// The start is done: both listeners serve.
pub fn ready() {
    send(&[NotifyState::Ready]);
}

/// A reload begins; systemd 253 and newer want the monotonic time with it, to tell this
/// reload's READY=1 from an earlier one.
pub fn reloading() {
    let mut states = vec![NotifyState::Reloading];
    match NotifyState::monotonic_usec_now() {
        Ok(now) => states.push(now),
        Err(error) => tracing::warn!(%error, "reading the monotonic clock for RELOADING=1"),
    }
    send(&states);
}

/// The agent is stopping.
pub fn stopping() {
    send(&[NotifyState::Stopping]);
}

/// How often to ping a watchdog of `timeout` (WATCHDOG_USEC): at half of it, as
/// sd_watchdog_enabled(3) advises, so one late tick does not miss the deadline.
pub fn ping_interval(timeout: Option<Duration>) -> Option<Duration> {
    timeout.filter(|t| !t.is_zero()).map(|t| t / 2)
}

/// Pings the watchdog until `stop`, when systemd set one for this process; a stuck runtime
/// stops the pings, and systemd restarts the agent.
pub async fn watchdog(stop: impl Future<Output = ()>) {
    let Some(every) = ping_interval(sd_notify::watchdog_enabled()) else {
        return;
    };
    let mut tick = tokio::time::interval(every);
    tokio::pin!(stop);
    loop {
        tokio::select! {
            () = &mut stop => return,
            _ = tick.tick() => send(&[NotifyState::Watchdog]),
        }
    }
}

fn send(states: &[NotifyState]) {
    if let Err(error) = sd_notify::notify(states) {
        tracing::warn!(%error, ?states, "telling the service manager");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watchdog_is_pinged_at_half_its_timeout_and_only_when_set() {
        assert_eq!(
            ping_interval(Some(Duration::from_secs(30))),
            Some(Duration::from_secs(15))
        );
        assert_eq!(
            ping_interval(Some(Duration::from_micros(3))),
            Some(Duration::from_nanos(1500))
        );
        assert_eq!(ping_interval(Some(Duration::ZERO)), None);
        assert_eq!(ping_interval(None), None);
    }
}

//! The event log's vocabulary: every enforcement decision an operator looks for afterwards
//! (a ban and its cause, a disconnect by strikes, a SYN-cookie switch, a mode changed by a
//! reload, the fleet falling back to local decisions and back) as one [`Event`], written once
//! by [`emit`] at the place the decision is made.
//!
//! An event goes to the `tracing` target [`TARGET`] only; `services::event_sink` routes that
//! target to the configured sink (a JSON file or journald) and keeps it out of the ordinary
//! log. Every event has the same fields, those that do not apply left out, so a reader (`limiter
//! events`, `jq`, a log shipper) needs one schema:
//!
//! | field | what |
//! | --- | --- |
//! | `kind` | `ban`, `unban`, `would-ban`, `disconnect`, `syn-cookies`, `mode`, `fleet-fallback` |
//! | `source` | the address (bans), the connection's key (disconnect), the Redis (fleet) |
//! | `action` | the broker action (disconnect, a per-action mode), or what fell back (`checks`, `bans`) |
//! | `cause` | who or what decided: `http`, `broker`, `escalation`, `fleet-escalation`, `fleet`, `strikes`, `auto`, `reload`, `redis` |
//! | `to` | the state switched to: `on` / `off` / `unchecked`, `enforce` / `monitor`, `local` / `redis` |
//! | `reason` | why, in words |
//! | `duration_ms` | a ban's length |
//! | `message` | the whole event as one readable sentence |
//!
//! Layer 0: it imports nothing of the agent, so the engines and the services both emit.

use std::{net::IpAddr, time::Duration};

use crate::duration_units::duration_ms;

/// The `tracing` target every event is written to, and nothing else is.
pub const TARGET: &str = "limiter::events";

/// Who placed or lifted a ban.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BanCause {
    /// The admin API (`POST /v1/bans`, which `limiter ban` calls).
    Http,
    /// A broker's admin request over the broker protocol.
    Broker,
    /// This agent's escalation: more than `escalate-after` failed authentications within
    /// `escalate-window`; `nth` is the ban's place in the address's run of bans.
    Escalation { failures: u32, nth: u32 },
    /// The fleet's count of failures, across agents, crossed the threshold.
    FleetEscalation { failures: u64 },
    /// Kernel escalation: the source's connection attempts were refused at their proven
    /// handshakes (over its cap or SYN rate) for `seconds`, past `escalate-refused-for`; `nth`
    /// is the ban's place in the address's run of bans.
    Refused { seconds: u64, nth: u32 },
    /// Another agent of the fleet banned or unbanned, read from the fleet's ban log.
    Fleet,
}

impl BanCause {
    fn name(self) -> &'static str {
        match self {
            Self::Http => "http",
            Self::Broker => "broker",
            Self::Escalation { .. } => "escalation",
            Self::FleetEscalation { .. } => "fleet-escalation",
            Self::Refused { .. } => "kernel-escalation",
            Self::Fleet => "fleet",
        }
    }

    fn reason(self) -> String {
        match self {
            Self::Http => "an operator, over the admin API".into(),
            Self::Broker => "the broker's admin request".into(),
            Self::Escalation { failures, nth } if nth > 1 => {
                format!("{failures} failed authentications within the window (ban {nth} of a run)")
            }
            Self::Escalation { failures, .. } => {
                format!("{failures} failed authentications within the window")
            }
            Self::FleetEscalation { failures } => {
                format!("{failures} failed authentications across the fleet within the window")
            }
            Self::Refused { seconds, nth } => {
                let run = if nth > 1 {
                    format!(" (ban {nth} of a run)")
                } else {
                    String::new()
                };
                format!(
                    "connection attempts refused at their handshakes, over its cap or SYN rate, for {seconds} s{run}"
                )
            }
            Self::Fleet => "another agent of the fleet".into(),
        }
    }
}

/// The SYN-cookie state `syn-cookies = auto` switched to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CookieSwitch {
    /// SYNs from unproven sources are answered with cookies.
    On,
    /// No more cookies are sent; those sent are still checked for a while.
    Off,
    /// The cookies sent have all expired; their ACKs are no longer checked.
    Unchecked,
}

/// What a fleet agent decides locally while its Redis is away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FleetPart {
    /// Shared actions' checks, at limit / expected-replicas.
    Checks,
    /// Bans, enforced on this agent only.
    Bans,
}

/// One enforcement event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Ban {
        addr: IpAddr,
        cause: BanCause,
        ttl: Duration,
    },
    Unban {
        addr: IpAddr,
        cause: BanCause,
        /// Whether a ban was in force.
        lifted: bool,
    },
    /// Monitor mode: escalation would have banned.
    WouldBan {
        addr: IpAddr,
        cause: BanCause,
        ttl: Duration,
    },
    /// A broker connection collected `strikes-to-disconnect` within `strike-window`.
    Disconnect {
        action: String,
        key: String,
        strikes: u32,
        window: Duration,
    },
    SynCookies {
        to: CookieSwitch,
        syns_per_second: u64,
        threshold: u32,
    },
    /// A reload changed `mode` (`action: None`) or an action's own `mode`.
    Mode {
        action: Option<String>,
        from: &'static str,
        to: &'static str,
    },
    FleetFallback {
        part: FleetPart,
        redis: String,
        /// `true`: to local decisions; `false`: back to Redis.
        local: bool,
        /// What failed (to local), or `None` (back).
        error: Option<String>,
    },
}

/// An event as its fields: what [`emit`] writes, a pure function so a test sees each field.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fields {
    pub kind: &'static str,
    pub source: Option<String>,
    pub action: Option<String>,
    pub cause: Option<&'static str>,
    pub to: Option<&'static str>,
    pub reason: Option<String>,
    pub duration_ms: Option<u64>,
    pub message: String,
}

fn text(d: Duration) -> humantime::FormattedDuration {
    humantime::format_duration(d)
}

impl Event {
    pub fn fields(&self) -> Fields {
        match self {
            Self::Ban { addr, cause, ttl } => Fields {
                kind: "ban",
                source: Some(addr.to_string()),
                cause: Some(cause.name()),
                reason: Some(cause.reason()),
                duration_ms: Some(duration_ms(*ttl)),
                message: format!("banned {addr} for {}: {}", text(*ttl), cause.reason()),
                ..Fields::default()
            },
            Self::Unban {
                addr,
                cause,
                lifted,
            } => {
                let reason = cause.reason();
                let had = if *lifted { "" } else { " (none was in force)" };
                Fields {
                    kind: "unban",
                    source: Some(addr.to_string()),
                    cause: Some(cause.name()),
                    message: format!("unbanned {addr}{had}: {reason}"),
                    reason: Some(reason),
                    ..Fields::default()
                }
            }
            Self::WouldBan { addr, cause, ttl } => {
                let reason = cause.reason();
                Fields {
                    kind: "would-ban",
                    source: Some(addr.to_string()),
                    cause: Some(cause.name()),
                    duration_ms: Some(duration_ms(*ttl)),
                    message: format!(
                        "monitor mode: would have banned {addr} for {}: {reason}",
                        text(*ttl)
                    ),
                    reason: Some(reason),
                    ..Fields::default()
                }
            }
            Self::Disconnect {
                action,
                key,
                strikes,
                window,
            } => {
                let reason = format!("{strikes} strikes within {}", text(*window));
                Fields {
                    kind: "disconnect",
                    source: Some(key.clone()),
                    action: Some(action.clone()),
                    cause: Some("strikes"),
                    message: format!("disconnecting {key:?} (action {action}): {reason}"),
                    reason: Some(reason),
                    ..Fields::default()
                }
            }
            Self::SynCookies {
                to,
                syns_per_second,
                threshold,
            } => {
                let (state, reason) = match to {
                    CookieSwitch::On => (
                        "on",
                        format!("{syns_per_second} SYNs/s, over the threshold of {threshold}"),
                    ),
                    CookieSwitch::Off => (
                        "off",
                        format!(
                            "{syns_per_second} SYNs/s, under half the threshold of {threshold} for a while"
                        ),
                    ),
                    CookieSwitch::Unchecked => (
                        "unchecked",
                        "the cookies sent have expired; their ACKs are no longer checked".into(),
                    ),
                };
                Fields {
                    kind: "syn-cookies",
                    cause: Some("auto"),
                    to: Some(state),
                    message: format!("SYN cookies {state}: {reason}"),
                    reason: Some(reason),
                    ..Fields::default()
                }
            }
            Self::Mode { action, from, to } => {
                let reason = format!("a reload changed it from {from}");
                let what = match action {
                    Some(action) => format!("action {action}"),
                    None => "the broker's actions and escalation".into(),
                };
                Fields {
                    kind: "mode",
                    action: action.clone(),
                    cause: Some("reload"),
                    to: Some(to),
                    message: format!("{what}: {to} ({reason})"),
                    reason: Some(reason),
                    ..Fields::default()
                }
            }
            Self::FleetFallback {
                part,
                redis,
                local,
                error,
            } => {
                let (what, local_text) = match part {
                    FleetPart::Checks => (
                        "checks",
                        "shared checks are decided locally at limit / expected-replicas",
                    ),
                    FleetPart::Bans => ("bans", "bans are enforced on this agent only"),
                };
                let (to, message) = if *local {
                    let why = error.as_deref().unwrap_or("Redis does not answer");
                    (
                        "local",
                        format!("fleet {what}: {local_text} ({redis}: {why})"),
                    )
                } else {
                    (
                        "redis",
                        format!("fleet {what}: back to Redis ({redis} answers)"),
                    )
                };
                Fields {
                    kind: "fleet-fallback",
                    source: Some(redis.clone()),
                    action: Some(what.into()),
                    cause: Some("redis"),
                    to: Some(to),
                    reason: error.clone(),
                    message,
                    ..Fields::default()
                }
            }
        }
    }
}

/// Writes `event` to the event log, once. Where no sink is configured it goes nowhere.
pub fn emit(event: &Event) {
    let f = event.fields();
    tracing::info!(
        target: TARGET,
        kind = f.kind,
        source = f.source.as_deref(),
        action = f.action.as_deref(),
        cause = f.cause,
        to = f.to,
        reason = f.reason.as_deref(),
        duration_ms = f.duration_ms,
        "{}",
        f.message
    );
}

/// One line of the event log as `limiter events` prints it: the time and the event's
/// sentence. A line that is not an event (not JSON, or without a message) is shown as it is,
/// so nothing in the file is hidden.
pub fn render(line: &str) -> String {
    let Ok(serde_json::Value::Object(object)) = serde_json::from_str::<serde_json::Value>(line)
    else {
        return line.to_owned();
    };
    let Some(message) = object.get("message").and_then(|m| m.as_str()) else {
        return line.to_owned();
    };
    match object.get("timestamp").and_then(|t| t.as_str()) {
        Some(at) => format!("{at} {message}"),
        None => message.to_owned(),
    }
}

/// The event's time, for `limiter events --since`; `None` for a line without one.
pub fn timestamp(line: &str) -> Option<std::time::SystemTime> {
    let value: serde_json::Value = serde_json::from_str(line).ok()?;
    humantime::parse_rfc3339_weak(value.get("timestamp")?.as_str()?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_kind() -> Vec<Event> {
        let addr: IpAddr = "192.0.2.7".parse().unwrap();
        vec![
            Event::Ban {
                addr,
                cause: BanCause::Http,
                ttl: Duration::from_secs(600),
            },
            Event::Ban {
                addr,
                cause: BanCause::Escalation {
                    failures: 4,
                    nth: 2,
                },
                ttl: Duration::from_secs(1800),
            },
            Event::Ban {
                addr,
                cause: BanCause::FleetEscalation { failures: 6 },
                ttl: Duration::from_secs(60),
            },
            Event::Unban {
                addr,
                cause: BanCause::Fleet,
                lifted: false,
            },
            Event::WouldBan {
                addr,
                cause: BanCause::Escalation {
                    failures: 4,
                    nth: 1,
                },
                ttl: Duration::from_secs(60),
            },
            Event::Disconnect {
                action: "publish".into(),
                key: "client \"7\"\nx".into(),
                strikes: 3,
                window: Duration::from_secs(10),
            },
            Event::SynCookies {
                to: CookieSwitch::On,
                syns_per_second: 2500,
                threshold: 2000,
            },
            Event::SynCookies {
                to: CookieSwitch::Unchecked,
                syns_per_second: 0,
                threshold: 2000,
            },
            Event::Mode {
                action: None,
                from: "monitor",
                to: "enforce",
            },
            Event::FleetFallback {
                part: FleetPart::Checks,
                redis: "redis://10.0.0.5:6379".into(),
                local: true,
                error: Some("connection refused".into()),
            },
            Event::FleetFallback {
                part: FleetPart::Bans,
                redis: "redis://10.0.0.5:6379".into(),
                local: false,
                error: None,
            },
            Event::Ban {
                addr,
                cause: BanCause::Refused {
                    seconds: 30,
                    nth: 2,
                },
                ttl: Duration::from_secs(1200),
            },
        ]
    }

    #[test]
    fn a_kernel_escalation_ban_says_how_long_its_source_was_refused() {
        let f = every_kind().last().unwrap().fields();
        assert_eq!((f.kind, f.cause), ("ban", Some("kernel-escalation")));
        let reason = f.reason.unwrap();
        assert!(reason.contains("for 30 s (ban 2 of a run)"), "{reason}");
    }

    #[test]
    fn a_ban_names_its_source_cause_and_length() {
        let f = Event::Ban {
            addr: "2001:db8::1".parse().unwrap(),
            cause: BanCause::Escalation {
                failures: 6,
                nth: 3,
            },
            ttl: Duration::from_secs(5400),
        }
        .fields();
        assert_eq!(f.kind, "ban");
        assert_eq!(f.source.as_deref(), Some("2001:db8::1"));
        assert_eq!(f.cause, Some("escalation"));
        assert_eq!(f.duration_ms, Some(5_400_000));
        assert!(f.reason.unwrap().contains("ban 3 of a run"));
        assert!(f.message.contains("for 1h 30m"), "{}", f.message);
        assert_eq!((f.action, f.to), (None, None));
    }

    #[test]
    fn a_disconnect_names_the_action_and_the_connection() {
        let f = every_kind()[5].fields();
        assert_eq!(
            (f.kind, f.action.as_deref(), f.cause),
            ("disconnect", Some("publish"), Some("strikes"))
        );
        assert_eq!(f.source.as_deref(), Some("client \"7\"\nx"));
        assert_eq!(f.reason.as_deref(), Some("3 strikes within 10s"));
    }

    #[test]
    fn switches_name_the_state_they_switched_to() {
        let to = |e: &Event| e.fields().to;
        let events = every_kind();
        assert_eq!(to(&events[6]), Some("on"));
        assert_eq!(to(&events[7]), Some("unchecked"));
        assert_eq!(to(&events[8]), Some("enforce"));
        assert_eq!(to(&events[9]), Some("local"));
        assert_eq!(to(&events[10]), Some("redis"));
        assert_eq!(
            events[9].fields().reason.as_deref(),
            Some("connection refused")
        );
    }

    /// The lines the file sink writes, each event through the real JSON layer.
    fn written(events: &[Event]) -> String {
        use tracing_subscriber::layer::SubscriberExt;
        let buffer = crate::services::event_sink::tests::Buffer::default();
        let subscriber = tracing_subscriber::registry()
            .with(crate::services::event_sink::json_layer(buffer.clone()));
        tracing::subscriber::with_default(subscriber, || events.iter().for_each(emit));
        buffer.text()
    }

    #[test]
    fn each_event_is_one_line_of_valid_json_with_its_fields() {
        let events = every_kind();
        let text = written(&events);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), events.len(), "{text}");
        assert!(text.ends_with('\n'));
        for (line, event) in lines.iter().zip(&events) {
            let json: serde_json::Value = serde_json::from_str(line).expect(line);
            let f = event.fields();
            assert_eq!(json["kind"], f.kind, "{line}");
            assert_eq!(json["message"], f.message.as_str(), "{line}");
            assert_eq!(
                json.get("source").and_then(|s| s.as_str()),
                f.source.as_deref()
            );
            assert_eq!(
                json.get("action").and_then(|s| s.as_str()),
                f.action.as_deref()
            );
            assert_eq!(json.get("cause").and_then(|s| s.as_str()), f.cause);
            assert_eq!(json.get("to").and_then(|s| s.as_str()), f.to);
            assert_eq!(
                json.get("reason").and_then(|s| s.as_str()),
                f.reason.as_deref()
            );
            assert_eq!(
                json.get("duration_ms").and_then(serde_json::Value::as_u64),
                f.duration_ms
            );
            assert!(timestamp(line).is_some(), "{line}");
            let shown = render(line);
            assert!(shown.ends_with(&f.message), "{shown}");
            assert!(!shown.contains('{'), "{shown}");
        }
    }

    #[test]
    fn other_lines_are_shown_as_they_are() {
        assert_eq!(render("not json"), "not json");
        assert_eq!(render("{\"kind\":\"ban\"}"), "{\"kind\":\"ban\"}");
        assert_eq!(render("[1]"), "[1]");
        assert_eq!(timestamp("{\"timestamp\":\"yesterday\"}"), None);
    }
}

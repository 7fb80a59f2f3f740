//! The plugin's `plugin_opt_*` lines of mosquitto.conf, parsed once at load time, so a typo
//! stops the broker at start-up instead of silently changing what is limited.

use std::{path::PathBuf, time::Duration};

/// Where the agent listens by default (the agent's own default `--socket`).
pub const DEFAULT_SOCKET: &str = "/run/limiter/limiter.sock";
/// How long a callback waits for the agent by default: long enough for a local round trip
/// under load, short enough that a stuck agent cannot stall the broker.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(100);

/// What the plugin asks the agent about.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Actions {
    /// `auth` per client address on every CONNECT, and failed-password reports.
    pub auth: bool,
    /// `publish` per username on every PUBLISH.
    pub publish: bool,
    /// `subscribe` per username on every SUBSCRIBE.
    pub subscribe: bool,
}

/// What a callback answers when the agent cannot (not running, too slow, an error reply).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailMode {
    /// Let the broker's other checks decide, as if the agent had allowed.
    Open,
    /// Refuse the login, publish or subscribe.
    Closed,
}

/// What an ACL check answers when the agent allows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AclDefault {
    /// `MOSQ_ERR_PLUGIN_DEFER`: an `acl_file` or another plugin decides. Mosquitto 2.0 treats
    /// "every callback deferred" as a denial, so this needs one of them configured.
    Defer,
    /// `MOSQ_ERR_SUCCESS`: for brokers with no ACL of their own, where deferring would deny
    /// every publish and subscribe.
    Allow,
}

/// What an allowed login answers: whether the broker has a login check of its own.
///
/// Mosquitto 2.0 decides on `allow_anonymous` alone while no login callback is registered,
/// but once one is and every callback defers it accepts only a login without a username. A
/// plugin cannot see `allow_anonymous` nor whether a password file or another auth plugin
/// exists, so the operator says so.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoginCheck {
    /// `MOSQ_ERR_PLUGIN_DEFER`: a password file or another plugin decides after `auth`.
    Broker,
    /// `MOSQ_ERR_SUCCESS`: the broker has no login check of its own (`allow_anonymous true`,
    /// no password file, no other auth plugin), where deferring would refuse every login that
    /// sends a username. On a broker that has one, this would skip it.
    None,
}

/// The parsed options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// `plugin_opt_socket`: the agent's Unix socket.
    pub socket: PathBuf,
    /// `plugin_opt_actions`: comma-separated `auth`, `publish`, `subscribe`.
    pub actions: Actions,
    /// `plugin_opt_fail`: `open` (default) or `closed`.
    pub fail: FailMode,
    /// `plugin_opt_timeout`: milliseconds a callback waits for the agent.
    pub timeout: Duration,
    /// `plugin_opt_acl_default`: `defer` (default) or `allow`.
    pub acl_default: AclDefault,
    /// `plugin_opt_login_check`: `broker` (default) or `none`.
    pub login_check: LoginCheck,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            socket: PathBuf::from(DEFAULT_SOCKET),
            actions: Actions {
                auth: true,
                publish: true,
                subscribe: true,
            },
            fail: FailMode::Open,
            timeout: DEFAULT_TIMEOUT,
            acl_default: AclDefault::Defer,
            login_check: LoginCheck::Broker,
        }
    }
}

impl Options {
    /// Parses `(key, value)` pairs, keys without the `plugin_opt_` prefix (as the broker
    /// passes them). Unknown keys are errors: they are typos of a setting that would
    /// otherwise silently keep its default.
    pub fn parse<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Result<Self, String> {
        let mut options = Self::default();
        for (key, value) in pairs {
            let value = value.trim();
            match key {
                "socket" => options.socket = PathBuf::from(value),
                "actions" => options.actions = parse_actions(value)?,
                "fail" => {
                    options.fail = match value {
                        "open" => FailMode::Open,
                        "closed" => FailMode::Closed,
                        _ => {
                            return Err(format!(
                                "plugin_opt_fail: `{value}` is not open or closed"
                            ));
                        }
                    }
                }
                "timeout" => {
                    let ms: u64 = value.parse().ok().filter(|ms| *ms > 0).ok_or_else(|| {
                        format!(
                            "plugin_opt_timeout: `{value}` is not a positive number of milliseconds"
                        )
                    })?;
                    options.timeout = Duration::from_millis(ms);
                }
                "acl_default" => {
                    options.acl_default = match value {
                        "defer" => AclDefault::Defer,
                        "allow" => AclDefault::Allow,
                        _ => {
                            return Err(format!(
                                "plugin_opt_acl_default: `{value}` is not defer or allow"
                            ));
                        }
                    }
                }
                "login_check" => {
                    options.login_check = match value {
                        "broker" => LoginCheck::Broker,
                        "none" => LoginCheck::None,
                        _ => {
                            return Err(format!(
                                "plugin_opt_login_check: `{value}` is not broker or none"
                            ));
                        }
                    }
                }
                _ => return Err(format!("unknown option plugin_opt_{key}")),
            }
        }
        Ok(options)
    }
}

fn parse_actions(value: &str) -> Result<Actions, String> {
    let mut actions = Actions::default();
    for name in value.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        match name {
            "auth" => actions.auth = true,
            "publish" => actions.publish = true,
            "subscribe" => actions.subscribe = true,
            _ => {
                return Err(format!(
                    "plugin_opt_actions: unknown action `{name}` (auth, publish, subscribe)"
                ));
            }
        }
    }
    Ok(actions)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_ask_about_everything_and_fail_open() {
        let o = Options::parse([]).unwrap();
        assert_eq!(o, Options::default());
        assert!(o.actions.auth && o.actions.publish && o.actions.subscribe);
        assert_eq!(o.fail, FailMode::Open);
        assert_eq!(o.login_check, LoginCheck::Broker);
    }

    #[test]
    fn every_option_is_read() {
        let o = Options::parse([
            ("socket", "/tmp/x.sock"),
            ("actions", "auth, publish"),
            ("fail", "closed"),
            ("timeout", "250"),
            ("acl_default", "allow"),
            ("login_check", "none"),
        ])
        .unwrap();
        assert_eq!(o.socket, PathBuf::from("/tmp/x.sock"));
        assert_eq!(
            o.actions,
            Actions {
                auth: true,
                publish: true,
                subscribe: false
            }
        );
        assert_eq!(o.fail, FailMode::Closed);
        assert_eq!(o.timeout, Duration::from_millis(250));
        assert_eq!(o.acl_default, AclDefault::Allow);
        assert_eq!(o.login_check, LoginCheck::None);
    }

    #[test]
    fn typos_are_errors_naming_the_option() {
        for (pairs, needle) in [
            (vec![("fail", "shut")], "plugin_opt_fail"),
            (vec![("timeout", "0")], "plugin_opt_timeout"),
            (vec![("timeout", "fast")], "plugin_opt_timeout"),
            (vec![("actions", "auth,pubish")], "pubish"),
            (vec![("sokcet", "/x")], "plugin_opt_sokcet"),
            (vec![("login_check", "off")], "plugin_opt_login_check"),
        ] {
            let err = Options::parse(pairs).unwrap_err();
            assert!(err.contains(needle), "{err}");
        }
    }
}

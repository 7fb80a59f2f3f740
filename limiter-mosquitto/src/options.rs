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

/// What an ACL check answers when the agent allows it (see [`crate::passes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AclDefault {
    /// Read from the broker's configuration: defer where it has an ACL of its own
    /// (`acl_file`, another plugin), else allow.
    Auto,
    /// `MOSQ_ERR_PLUGIN_DEFER`: an `acl_file` or another plugin decides. Mosquitto 2.0 treats
    /// "every callback deferred" as a denial, so without one this denies everything.
    Defer,
    /// `MOSQ_ERR_SUCCESS`: grant it. On a broker with an ACL of its own, that ACL is skipped.
    Allow,
}

/// What an allowed login answers (see [`crate::passes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoginCheck {
    /// Read from the broker's configuration: defer where it has a login check of its own
    /// (`password_file`, another plugin), else what `allow_anonymous` alone would answer.
    Auto,
    /// `MOSQ_ERR_PLUGIN_DEFER`: a password file or another plugin decides after `auth`.
    /// Without one, mosquitto 2.0 then refuses every login that sends a username.
    Broker,
    /// `MOSQ_ERR_SUCCESS`: accept it. On a broker that has a login check of its own, this
    /// skips it.
    None,
}

/// Why the options were refused; each names the option.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OptionsError {
    #[error("plugin_opt_{key}: `{value}` is not {expected}")]
    Invalid {
        key: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("plugin_opt_actions: unknown action `{0}` (auth, publish, subscribe)")]
    UnknownAction(String),
    #[error("unknown option plugin_opt_{0}")]
    Unknown(String),
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
    /// `plugin_opt_acl_default`: `auto` (default), `defer` or `allow`.
    pub acl_default: AclDefault,
    /// `plugin_opt_login_check`: `auto` (default), `broker` or `none`.
    pub login_check: LoginCheck,
    /// `plugin_opt_strikes`: the agent's action (keyed by `connection`) checked with the
    /// client id and the payload's size on every PUBLISH; a client it answers `disconnect`
    /// is kicked. Default: none.
    pub strikes: Option<String>,
    /// `plugin_opt_sessions`: the agent's concurrency action keyed by username, a session
    /// taken at each CONNECT with a username and released at its disconnect. Default: none.
    pub sessions: Option<String>,
    /// `plugin_opt_publish_bytes`: the agent's action (keyed by `user`, its limit bytes per
    /// window) charged each PUBLISH's payload length by its username. Default: none.
    pub publish_bytes: Option<String>,
    /// `plugin_opt_publish_topic`: the agent's action (keyed by `user+topic`) charged one
    /// per PUBLISH by its username and topic. Default: none.
    pub publish_topic: Option<String>,
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
            acl_default: AclDefault::Auto,
            login_check: LoginCheck::Auto,
            strikes: None,
            sessions: None,
            publish_bytes: None,
            publish_topic: None,
        }
    }
}

impl Options {
    /// Parses `(key, value)` pairs, keys without the `plugin_opt_` prefix (as the broker
    /// passes them). Unknown keys are errors: they are typos of a setting that would
    /// otherwise silently keep its default.
    pub fn parse<'a>(
        pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Self, OptionsError> {
        let mut options = Self::default();
        for (key, value) in pairs {
            let value = value.trim();
            let invalid = |key, expected| OptionsError::Invalid {
                key,
                value: value.to_owned(),
                expected,
            };
            match key {
                "socket" => options.socket = PathBuf::from(value),
                "actions" => options.actions = parse_actions(value)?,
                "fail" => {
                    options.fail = match value {
                        "open" => FailMode::Open,
                        "closed" => FailMode::Closed,
                        _ => return Err(invalid("fail", "open or closed")),
                    }
                }
                "timeout" => {
                    let ms: u64 =
                        value.parse().ok().filter(|ms| *ms > 0).ok_or_else(|| {
                            invalid("timeout", "a positive number of milliseconds")
                        })?;
                    options.timeout = Duration::from_millis(ms);
                }
                "acl_default" => {
                    options.acl_default = match value {
                        "auto" => AclDefault::Auto,
                        "defer" => AclDefault::Defer,
                        "allow" => AclDefault::Allow,
                        _ => return Err(invalid("acl_default", "auto, defer or allow")),
                    }
                }
                "login_check" => {
                    options.login_check = match value {
                        "auto" => LoginCheck::Auto,
                        "broker" => LoginCheck::Broker,
                        "none" => LoginCheck::None,
                        _ => return Err(invalid("login_check", "auto, broker or none")),
                    }
                }
                "strikes" | "sessions" | "publish_bytes" | "publish_topic" => {
                    let valid = !value.is_empty()
                        && value.len() <= limiter_client::MAX_ACTION_NAME
                        && value.bytes().all(|b| {
                            b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.'
                        });
                    let (key, slot) = match key {
                        "strikes" => ("strikes", &mut options.strikes),
                        "sessions" => ("sessions", &mut options.sessions),
                        "publish_bytes" => ("publish_bytes", &mut options.publish_bytes),
                        _ => ("publish_topic", &mut options.publish_topic),
                    };
                    if !valid {
                        return Err(invalid(key, "an action name (1 to 64 of A-Za-z0-9_.-)"));
                    }
                    *slot = Some(value.to_owned());
                }
                _ => return Err(OptionsError::Unknown(key.to_owned())),
            }
        }
        Ok(options)
    }

    /// Whether the broker's configuration must be read to answer allowed checks.
    pub fn needs_broker_conf(&self) -> bool {
        self.login_check == LoginCheck::Auto || self.acl_default == AclDefault::Auto
    }
}

fn parse_actions(value: &str) -> Result<Actions, OptionsError> {
    let mut actions = Actions::default();
    for name in value.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        match name {
            "auth" => actions.auth = true,
            "publish" => actions.publish = true,
            "subscribe" => actions.subscribe = true,
            _ => return Err(OptionsError::UnknownAction(name.to_owned())),
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
        assert_eq!(o.login_check, LoginCheck::Auto);
        assert_eq!(o.acl_default, AclDefault::Auto);
        assert!(o.needs_broker_conf());
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
            ("strikes", "publish_conn"),
            ("sessions", "logins"),
            ("publish_bytes", "pub_bytes"),
            ("publish_topic", "pub_topic"),
        ])
        .unwrap();
        assert_eq!(o.publish_bytes.as_deref(), Some("pub_bytes"));
        assert_eq!(o.publish_topic.as_deref(), Some("pub_topic"));
        assert_eq!(o.strikes.as_deref(), Some("publish_conn"));
        assert_eq!(o.sessions.as_deref(), Some("logins"));
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
        assert!(!o.needs_broker_conf());
        for (value, want) in [("auto", LoginCheck::Auto), ("broker", LoginCheck::Broker)] {
            let o = Options::parse([("login_check", value)]).unwrap();
            assert_eq!(o.login_check, want);
        }
        for (value, want) in [("auto", AclDefault::Auto), ("defer", AclDefault::Defer)] {
            let o = Options::parse([("acl_default", value)]).unwrap();
            assert_eq!(o.acl_default, want);
        }
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
            (vec![("acl_default", "deny")], "plugin_opt_acl_default"),
            (vec![("strikes", "")], "plugin_opt_strikes"),
            (vec![("strikes", "pub conn")], "plugin_opt_strikes"),
            (vec![("sessions", "")], "plugin_opt_sessions"),
            (vec![("publish_bytes", "")], "plugin_opt_publish_bytes"),
            (vec![("publish_bytes", "a b")], "plugin_opt_publish_bytes"),
            (vec![("publish_topic", "x/y")], "plugin_opt_publish_topic"),
        ] {
            let err = Options::parse(pairs).unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        }
    }
}

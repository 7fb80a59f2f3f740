//! The agent's settings for the broker-facing limiter: where it listens, escalation, and quick
//! overrides of the built-in actions. The agent flattens [`AppArgs`] into `limiter run`; the
//! config file's `[broker]` table ([`BrokerFile`]) sits under the flags, and its `[actions]`
//! tables under the per-action flags.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use limiter_client::DEFAULT_MAX_FRAME;

use crate::buckets::{
    ActionConfig, ConfigError, EscalationConfig, LimiterConfig, Window, escalation, resolve_actions,
};

pub const DEFAULT_SOCKET: &str = "/run/limiter/limiter.sock";

/// The `[broker]` table of the configuration file: the same settings as the flags, which win.
#[derive(serde::Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct BrokerFile {
    pub socket: Option<PathBuf>,
    pub listen: Option<SocketAddr>,
    pub escalate_after: Option<u32>,
    #[serde(default, deserialize_with = "crate::config::duration")]
    pub escalate_window: Option<Duration>,
    #[serde(default, deserialize_with = "crate::config::duration")]
    pub escalate_ban: Option<Duration>,
}

#[derive(clap::Args, Clone, Debug, PartialEq, Eq)]
pub struct AppArgs {
    /// Unix socket the broker connects to (created mode 0660, its directory if missing).
    /// [default: /run/limiter/limiter.sock]
    #[arg(long, env = "LIMITER_SOCKET")]
    pub socket: Option<PathBuf>,
    /// Also serve the protocol over TCP: `PORT` (on 127.0.0.1) or `ADDR:PORT`.
    #[arg(long, env = "LIMITER_LISTEN", value_parser = parse_listen)]
    pub listen: Option<SocketAddr>,
    /// Ban an address after more than this many auth failures within the window
    /// (escalation is off unless set).
    #[arg(long, env = "LIMITER_ESCALATE_AFTER")]
    pub escalate_after: Option<u32>,
    /// The window failures are counted in. [default: 60s]
    #[arg(long, env = "LIMITER_ESCALATE_WINDOW", value_parser = humantime::parse_duration)]
    pub escalate_window: Option<Duration>,
    /// How long an escalated ban lasts. [default: 10m]
    #[arg(long, env = "LIMITER_ESCALATE_BAN", value_parser = humantime::parse_duration)]
    pub escalate_ban: Option<Duration>,
    /// Override `auth`'s limit (0 refuses every attempt).
    #[arg(long, env = "LIMITER_AUTH_LIMIT")]
    pub auth_limit: Option<u32>,
    /// Override `auth`'s window.
    #[arg(long, env = "LIMITER_AUTH_WINDOW", value_parser = humantime::parse_duration)]
    pub auth_window: Option<Duration>,
    /// Override `dashboard_auth`'s limit (0 refuses every attempt).
    #[arg(long, env = "LIMITER_DASHBOARD_AUTH_LIMIT")]
    pub dashboard_auth_limit: Option<u32>,
    /// Override `dashboard_auth`'s window.
    #[arg(long, env = "LIMITER_DASHBOARD_AUTH_WINDOW", value_parser = humantime::parse_duration)]
    pub dashboard_auth_window: Option<Duration>,
    /// Override `dashboard_api`'s limit (0 = no limit).
    #[arg(long, env = "LIMITER_DASHBOARD_API_LIMIT")]
    pub dashboard_api_limit: Option<u32>,
    /// Override `dashboard_api`'s window.
    #[arg(long, env = "LIMITER_DASHBOARD_API_WINDOW", value_parser = humantime::parse_duration)]
    pub dashboard_api_window: Option<Duration>,
    /// Override `publish`'s limit (0 = no limit, the default).
    #[arg(long, env = "LIMITER_PUBLISH_LIMIT")]
    pub publish_limit: Option<u32>,
    /// Override `publish`'s window.
    #[arg(long, env = "LIMITER_PUBLISH_WINDOW", value_parser = humantime::parse_duration)]
    pub publish_window: Option<Duration>,
    /// Override `subscribe`'s limit (0 = no limit, the default).
    #[arg(long, env = "LIMITER_SUBSCRIBE_LIMIT")]
    pub subscribe_limit: Option<u32>,
    /// Override `subscribe`'s window.
    #[arg(long, env = "LIMITER_SUBSCRIBE_WINDOW", value_parser = humantime::parse_duration)]
    pub subscribe_window: Option<Duration>,
}

/// A bare port means loopback: exposing the limiter beyond the host must be spelled out.
fn parse_listen(text: &str) -> Result<SocketAddr, String> {
    if let Ok(port) = text.parse::<u16>() {
        return Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port));
    }
    text.parse()
        .map_err(|_| format!("{text:?} is neither a port nor ADDR:PORT"))
}

/// Where and how the protocol is served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServeConfig {
    pub socket: PathBuf,
    pub listen: Option<SocketAddr>,
    pub socket_mode: u32,
    pub max_frame: usize,
}

impl ServeConfig {
    pub fn unix(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
            listen: None,
            socket_mode: 0o660,
            max_frame: DEFAULT_MAX_FRAME,
        }
    }
}

impl AppArgs {
    /// These flags over the file's `[broker]` table: every setting left unset comes from it.
    pub fn over(mut self, file: &BrokerFile) -> AppArgs {
        self.socket = self.socket.or_else(|| file.socket.clone());
        self.listen = self.listen.or(file.listen);
        self.escalate_after = self.escalate_after.or(file.escalate_after);
        self.escalate_window = self.escalate_window.or(file.escalate_window);
        self.escalate_ban = self.escalate_ban.or(file.escalate_ban);
        self
    }

    pub fn serve_config(&self) -> ServeConfig {
        ServeConfig {
            listen: self.listen,
            ..ServeConfig::unix(
                self.socket
                    .clone()
                    .unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET)),
            )
        }
    }

    /// Built-ins, then the config file's `[actions.NAME]` tables, then these flags.
    pub fn limiter_config(
        &self,
        actions: &BTreeMap<String, ActionConfig>,
    ) -> Result<LimiterConfig, ConfigError> {
        let flag = |limit: Option<u32>, window: Option<Duration>| ActionConfig {
            limit,
            window: window.map(Window),
            ..ActionConfig::default()
        };
        let overrides = [
            ("auth", flag(self.auth_limit, self.auth_window)),
            (
                "dashboard_auth",
                flag(self.dashboard_auth_limit, self.dashboard_auth_window),
            ),
            (
                "dashboard_api",
                flag(self.dashboard_api_limit, self.dashboard_api_window),
            ),
            ("publish", flag(self.publish_limit, self.publish_window)),
            (
                "subscribe",
                flag(self.subscribe_limit, self.subscribe_window),
            ),
        ];
        let overrides: Vec<_> = overrides
            .into_iter()
            .filter(|(_, c)| *c != ActionConfig::default())
            .collect();
        let actions = resolve_actions(actions, &overrides)?;
        let escalation = match self.escalate_after {
            None => None,
            Some(0) => {
                return Err(ConfigError::new(
                    "escalate-after",
                    "must be at least 1 (leave it out to turn escalation off)",
                ));
            }
            Some(after) => {
                let window = self.escalate_window.unwrap_or(Duration::from_secs(60));
                let ban = self.escalate_ban.unwrap_or(Duration::from_secs(600));
                for (flag, value) in [("escalate-window", window), ("escalate-ban", ban)] {
                    if value.is_zero() {
                        return Err(ConfigError::new(flag, "must be longer than zero"));
                    }
                }
                Some(EscalationConfig {
                    after,
                    window,
                    ban,
                    max_addresses: escalation::DEFAULT_MAX_ADDRESSES,
                })
            }
        };
        Ok(LimiterConfig {
            actions,
            escalation,
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        app: AppArgs,
    }

    fn parse(args: &[&str]) -> AppArgs {
        Cli::try_parse_from(std::iter::once("limiter").chain(args.iter().copied()))
            .unwrap()
            .app
    }

    #[test]
    fn defaults_and_listen_forms() {
        let args = parse(&[]);
        assert_eq!(args.serve_config().socket, PathBuf::from(DEFAULT_SOCKET));
        assert_eq!(args.listen, None);
        assert_eq!(
            args.limiter_config(&BTreeMap::new()).unwrap().escalation,
            None
        );
        assert_eq!(
            parse(&["--listen", "7070"]).listen,
            Some("127.0.0.1:7070".parse().unwrap())
        );
        assert_eq!(
            parse(&["--listen", "[::1]:7070"]).listen,
            Some("[::1]:7070".parse().unwrap())
        );
        assert!(Cli::try_parse_from(["limiter", "--listen", "nowhere"]).is_err());
    }

    #[test]
    fn flags_override_the_file_and_escalation_is_opt_in() {
        let args = parse(&[
            "--auth-limit",
            "3",
            "--escalate-after",
            "5",
            "--escalate-ban",
            "1h",
        ]);
        let mut table = BTreeMap::new();
        table.insert(
            "auth".to_owned(),
            ActionConfig {
                limit: Some(7),
                window: Some(Window(Duration::from_secs(30))),
                ..ActionConfig::default()
            },
        );
        let config = args.limiter_config(&table).unwrap();
        let auth = config.actions.iter().find(|a| a.name == "auth").unwrap();
        assert_eq!((auth.limit, auth.window), (3, Duration::from_secs(30)));
        let escalation = config.escalation.unwrap();
        assert_eq!(
            (escalation.after, escalation.window, escalation.ban),
            (5, Duration::from_secs(60), Duration::from_secs(3600))
        );
        let error = parse(&["--escalate-after", "0"])
            .limiter_config(&BTreeMap::new())
            .unwrap_err();
        assert_eq!(error.setting, "escalate-after");
    }

    #[test]
    fn the_broker_table_sits_under_the_flags() {
        let file: BrokerFile = toml::from_str(
            "socket = \"/tmp/x.sock\"\nescalate-after = 4\nescalate-window = \"2m\"\n",
        )
        .unwrap();
        let args = parse(&["--escalate-after", "9"]).over(&file);
        assert_eq!(args.serve_config().socket, PathBuf::from("/tmp/x.sock"));
        let escalation = args
            .limiter_config(&BTreeMap::new())
            .unwrap()
            .escalation
            .unwrap();
        assert_eq!(
            (escalation.after, escalation.window, escalation.ban),
            (9, Duration::from_secs(120), Duration::from_secs(600))
        );
        assert!(toml::from_str::<BrokerFile>("sockett = \"/x\"\n").is_err());
    }
}

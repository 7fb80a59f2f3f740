//! The broker-facing settings: where the protocol is served, escalation into kernel bans, and
//! the actions' limits. Flags, the file's `[broker]` table and its `[actions.NAME]` tables meet
//! here; [`BrokerLayer`] is both the flags and the `[broker]` table.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use limiter_client::DEFAULT_MAX_FRAME;
use serde::{Deserialize, Serialize};

use super::{defaults, flags::text_duration};
use crate::buckets::{
    ActionConfig, BanIncrement, ConfigError, Enforcement, EscalationConfig, LimiterConfig, Window,
    escalation, resolve_actions,
};

/// The broker protocol's flags, and the file's `[broker]` table under them.
#[derive(clap::Args, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct BrokerLayer {
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
    /// Kernel escalation: ban a source whose connection attempts the kernel refuses at their
    /// handshakes, over its cap or SYN rate, for this long without a pause of more than 10 s.
    /// Only a completed handshake counts (a forged SYN's never completes), so over-cap SYNs
    /// then reach the host and are refused at their ACK. Bans last as escalated ones do
    /// (escalate-ban, escalate-factor, ...); unset = off.
    #[arg(long, env = "LIMITER_ESCALATE_REFUSED_FOR", value_parser = humantime::parse_duration)]
    #[serde(default, with = "text_duration")]
    pub escalate_refused_for: Option<Duration>,
    /// The window failures are counted in. [default: 60s]
    #[arg(long, env = "LIMITER_ESCALATE_WINDOW", value_parser = humantime::parse_duration)]
    #[serde(default, with = "text_duration")]
    pub escalate_window: Option<Duration>,
    /// How long an escalated ban lasts. [default: 10m]
    #[arg(long, env = "LIMITER_ESCALATE_BAN", value_parser = humantime::parse_duration)]
    #[serde(default, with = "text_duration")]
    pub escalate_ban: Option<Duration>,
    /// A source banned again within `escalate-memory` of its last ban's end is banned this
    /// many times longer than the last time, up to `escalate-max-ban`; 1 keeps every ban at
    /// `escalate-ban`. [default: 1]
    #[arg(long, env = "LIMITER_ESCALATE_FACTOR")]
    pub escalate_factor: Option<u32>,
    /// The longest an escalated ban grows to. [default: 1d]
    #[arg(long, env = "LIMITER_ESCALATE_MAX_BAN", value_parser = humantime::parse_duration)]
    #[serde(default, with = "text_duration")]
    pub escalate_max_ban: Option<Duration>,
    /// How long after a ban's end a next ban still counts as a repeat. [default: 1d]
    #[arg(long, env = "LIMITER_ESCALATE_MEMORY", value_parser = humantime::parse_duration)]
    #[serde(default, with = "text_duration")]
    pub escalate_memory: Option<Duration>,
    /// Users whose processes may send ban, unban and reset over the Unix socket.
    /// [default: 0 (root)]
    #[arg(long, env = "LIMITER_ADMIN_UIDS", value_delimiter = ',')]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub admin_uids: Vec<u32>,
    /// Groups whose processes may send ban, unban and reset over the Unix socket.
    /// [default: the socket's group]
    #[arg(long, env = "LIMITER_ADMIN_GIDS", value_delimiter = ',')]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub admin_gids: Vec<u32>,
    /// Token a broker-protocol client presents (the authenticate request) to be allowed ban,
    /// unban and reset on its connection: the only way over TCP. Without one, TCP clients
    /// never are.
    #[arg(
        id = "broker_admin_token",
        long = "broker-admin-token",
        env = "LIMITER_BROKER_ADMIN_TOKEN"
    )]
    pub admin_token: Option<String>,
}

/// Declares the quick per-action overrides once: each built-in action gets a `--NAME-limit`
/// and a `--NAME-window` flag, which win over its `[actions.NAME]` table.
macro_rules! action_flags {
    ($($action:literal: $limit:ident $limit_env:literal, $window:ident $window_env:literal, $limit_help:literal;)*) => {
        /// Quick overrides of the built-in actions' limits and windows.
        #[derive(clap::Args, Clone, Debug, Default, PartialEq, Eq)]
        pub struct ActionFlags {
            $(
                #[arg(long, env = $limit_env, help = $limit_help)]
                pub $limit: Option<u32>,
                #[arg(long, env = $window_env, value_parser = humantime::parse_duration,
                      help = concat!("Override `", $action, "`'s window."))]
                pub $window: Option<Duration>,
            )*
        }

        impl ActionFlags {
            /// The overrides given, as `[actions.NAME]` tables.
            pub fn overrides(&self) -> Vec<(&'static str, ActionConfig)> {
                let mut out = Vec::new();
                $(
                    if self.$limit.is_some() || self.$window.is_some() {
                        out.push(($action, ActionConfig {
                            limit: self.$limit,
                            window: self.$window.map(Window),
                            ..ActionConfig::default()
                        }));
                    }
                )*
                out
            }
        }
    };
}

action_flags! {
    "auth": auth_limit "LIMITER_AUTH_LIMIT", auth_window "LIMITER_AUTH_WINDOW",
        "Override `auth`'s limit (0 refuses every attempt).";
    "dashboard_auth": dashboard_auth_limit "LIMITER_DASHBOARD_AUTH_LIMIT",
        dashboard_auth_window "LIMITER_DASHBOARD_AUTH_WINDOW",
        "Override `dashboard_auth`'s limit (0 refuses every attempt).";
    "dashboard_api": dashboard_api_limit "LIMITER_DASHBOARD_API_LIMIT",
        dashboard_api_window "LIMITER_DASHBOARD_API_WINDOW",
        "Override `dashboard_api`'s limit (0 = no limit).";
    "publish": publish_limit "LIMITER_PUBLISH_LIMIT", publish_window "LIMITER_PUBLISH_WINDOW",
        "Override `publish`'s limit (0 = no limit, the default).";
    "subscribe": subscribe_limit "LIMITER_SUBSCRIBE_LIMIT",
        subscribe_window "LIMITER_SUBSCRIBE_WINDOW",
        "Override `subscribe`'s limit (0 = no limit, the default).";
}

/// A bare port means loopback: exposing the limiter beyond the host must be spelled out.
fn parse_listen(text: &str) -> Result<SocketAddr, String> {
    if let Ok(port) = text.parse::<u16>() {
        return Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port));
    }
    text.parse()
        .map_err(|_| format!("{text:?} is neither a port nor ADDR:PORT"))
}

/// What one listener grants its clients, so that idle or slow connections cannot take every
/// file descriptor the agent has and blind it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientLimits {
    /// Connections served at once; past it, a newcomer takes the slot of the oldest one
    /// without a whole request yet, or waits (`admission`).
    pub max: u32,
    /// Time to the first request's headers (HTTP) or first whole frame (broker protocol).
    pub header_timeout: Duration,
    /// Time between frames after which a broker connection is closed.
    pub idle_timeout: Duration,
}

impl Default for ClientLimits {
    fn default() -> Self {
        Self {
            max: defaults::MAX_CLIENTS,
            header_timeout: defaults::HEADER_TIMEOUT,
            idle_timeout: defaults::CLIENT_IDLE_TIMEOUT,
        }
    }
}

/// Who may change bans and buckets: over the Unix socket a peer whose uid or gid (from the
/// kernel's `SO_PEERCRED`, which a client cannot forge) is listed, and over either listener a
/// connection that presented the token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdminPeers {
    pub uids: Vec<u32>,
    /// `None`: the socket file's group, the group brokers are put in to reach it.
    pub gids: Option<Vec<u32>>,
    pub token: Option<String>,
}

impl Default for AdminPeers {
    fn default() -> Self {
        Self {
            uids: vec![0],
            gids: None,
            token: None,
        }
    }
}

/// Where and how the protocol is served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServeConfig {
    pub socket: PathBuf,
    pub listen: Option<SocketAddr>,
    pub socket_mode: u32,
    pub max_frame: usize,
    pub clients: ClientLimits,
    pub admin: AdminPeers,
}

impl ServeConfig {
    pub fn unix(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
            listen: None,
            socket_mode: 0o660,
            max_frame: DEFAULT_MAX_FRAME,
            clients: ClientLimits::default(),
            admin: AdminPeers::default(),
        }
    }
}

/// The broker side's settings that a reload can change, checked; where the protocol is
/// served is restart-only ([`super::RestartOnly`]).
#[derive(Clone, Debug)]
pub struct BrokerSettings {
    pub admin: AdminPeers,
    pub limiter: LimiterConfig,
}

impl BrokerLayer {
    /// The Unix socket, defaulted.
    pub fn socket(&self) -> PathBuf {
        self.socket
            .clone()
            .unwrap_or_else(|| PathBuf::from(defaults::SOCKET))
    }

    /// Checks these settings with the actions' tables (flags already merged in).
    pub fn resolve(
        &self,
        actions: &BTreeMap<String, ActionConfig>,
        overrides: &[(&str, ActionConfig)],
        fleet: bool,
    ) -> Result<BrokerSettings, ConfigError> {
        if self
            .admin_token
            .as_deref()
            .is_some_and(|t| t.trim().is_empty() || t.len() > limiter_client::MAX_TOKEN_LEN)
        {
            return Err(ConfigError::new(
                "broker.admin-token",
                format!(
                    "must be 1 to {} bytes and not blank (leave it out to turn it off)",
                    limiter_client::MAX_TOKEN_LEN
                ),
            ));
        }
        if self.escalate_after == Some(0) {
            return Err(ConfigError::new(
                "escalate-after",
                "must be at least 1 (leave it out to turn escalation off)",
            ));
        }
        if self.escalate_refused_for.is_some_and(|d| d.is_zero()) {
            return Err(ConfigError::new(
                "escalate-refused-for",
                "must be longer than zero (leave it out to turn kernel escalation off)",
            ));
        }
        let escalation = if self.escalate_after.is_none() && self.escalate_refused_for.is_none() {
            None
        } else {
            let window = self.escalate_window.unwrap_or(defaults::ESCALATE_WINDOW);
            let ban = self.escalate_ban.unwrap_or(defaults::ESCALATE_BAN);
            if window.is_zero() {
                return Err(ConfigError::new(
                    "escalate-window",
                    "must be longer than zero",
                ));
            }
            crate::api::ban_ttl(ban).map_err(|e| ConfigError::new("escalate-ban", e))?;
            Some(EscalationConfig {
                after: self.escalate_after,
                refused_for: self.escalate_refused_for,
                window,
                ban,
                increment: self.increment(ban)?,
                max_addresses: escalation::DEFAULT_MAX_ADDRESSES,
            })
        };
        Ok(BrokerSettings {
            admin: AdminPeers {
                uids: if self.admin_uids.is_empty() {
                    AdminPeers::default().uids
                } else {
                    self.admin_uids.clone()
                },
                gids: (!self.admin_gids.is_empty()).then(|| self.admin_gids.clone()),
                token: self.admin_token.clone(),
            },
            limiter: LimiterConfig {
                actions: resolve_actions(actions, overrides, fleet)?,
                escalation,
                // The top level's, which `Layer::resolve` sets.
                mode: Enforcement::Enforce,
            },
        })
    }
}

impl BrokerLayer {
    /// `escalate-factor`, `escalate-max-ban` and `escalate-memory`, checked against the first
    /// ban's length `ban`.
    fn increment(&self, ban: Duration) -> Result<BanIncrement, ConfigError> {
        let factor = self.escalate_factor.unwrap_or(1);
        let max_ban = self.escalate_max_ban.unwrap_or(defaults::ESCALATE_MAX_BAN);
        let memory = self.escalate_memory.unwrap_or(defaults::ESCALATE_MEMORY);
        if factor == 0 {
            return Err(ConfigError::new(
                "escalate-factor",
                "must be at least 1 (1 keeps every ban at escalate-ban)",
            ));
        }
        crate::api::ban_ttl(max_ban).map_err(|e| ConfigError::new("escalate-max-ban", e))?;
        if max_ban < ban {
            return Err(ConfigError::new(
                "escalate-max-ban",
                format!(
                    "{} is shorter than escalate-ban ({})",
                    humantime::format_duration(max_ban),
                    humantime::format_duration(ban)
                ),
            ));
        }
        if memory.is_zero() {
            return Err(ConfigError::new(
                "escalate-memory",
                "must be longer than zero",
            ));
        }
        Ok(BanIncrement {
            factor,
            max_ban,
            memory,
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
        broker: BrokerLayer,
    }

    #[test]
    fn listen_takes_a_port_or_an_address() {
        let parse = |args: &[&str]| {
            Cli::try_parse_from(std::iter::once("limiter").chain(args.iter().copied()))
                .map(|c| c.broker.listen)
        };
        assert_eq!(parse(&[]).unwrap(), None);
        assert_eq!(
            parse(&["--listen", "7070"]).unwrap(),
            Some("127.0.0.1:7070".parse().unwrap())
        );
        assert_eq!(
            parse(&["--listen", "[::1]:7070"]).unwrap(),
            Some("[::1]:7070".parse().unwrap())
        );
        assert!(parse(&["--listen", "nowhere"]).is_err());
    }

    #[test]
    fn escalation_is_opt_in() {
        let off = BrokerLayer::default()
            .resolve(&BTreeMap::new(), &[], false)
            .unwrap();
        assert_eq!(off.limiter.escalation, None);
        assert_eq!(
            BrokerLayer::default().socket(),
            PathBuf::from(defaults::SOCKET)
        );
    }
}

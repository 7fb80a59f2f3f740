//! Checks a merged [`Layer`] and fills in the defaults: the one path from what the operator
//! wrote to the [`Settings`] the agent runs with, taken alike at start and on SIGHUP.

use std::{path::PathBuf, time::Duration};

use limiter_common::{Config, Limits, Refusal};

use super::{
    BrokerLayer, BrokerSettings, CheckAccess, ClientLimits, ConfigError, ListFile, ListFiles,
    RestartOnly, Settings, SweepSettings,
    cidr_text::parse_cidrs,
    defaults,
    flags::{Layer, RefusalArg, SynCookiesArg, TunnelsArg, XdpModeArg},
};
use crate::{
    buckets::Enforcement,
    datapath::{CookieMode, Policy},
    fleet::FleetConfig,
};

impl Layer {
    /// Fills in the defaults and checks every setting; `broker_layer` and `fleet` give the
    /// restart-only settings of the `[broker]` and `[cluster]` tables.
    pub fn resolve(
        &self,
        mut broker: BrokerSettings,
        broker_layer: &BrokerLayer,
        fleet: Option<FleetConfig>,
    ) -> Result<Settings, ConfigError> {
        let sweep = SweepSettings {
            interval: self.sweep_interval.unwrap_or(defaults::SWEEP_INTERVAL),
            syn_timeout: self.syn_timeout.unwrap_or(defaults::SYN_TIMEOUT),
            idle_timeout: self.idle_timeout,
            batch: self.sweep_batch.unwrap_or(defaults::SWEEP_BATCH),
        };
        for (setting, value) in [
            ("sweep-interval", sweep.interval),
            ("syn-timeout", sweep.syn_timeout),
            ("idle-timeout", sweep.idle_timeout.unwrap_or(Duration::MAX)),
        ] {
            if value.is_zero() {
                return Err(ConfigError::new(setting, "must be longer than zero"));
            }
        }
        if sweep.batch == 0 {
            return Err(ConfigError::new("sweep-batch", "must be at least 1"));
        }
        for (setting, token) in [
            ("admin-token", &self.admin_token),
            ("check-token", &self.check_token),
        ] {
            if token.as_deref().is_some_and(|t| t.trim().is_empty()) {
                return Err(ConfigError::new(
                    setting,
                    "is empty (leave it out to turn the token off)",
                ));
            }
        }
        let check = match (&self.check_token, self.check_open.unwrap_or(false)) {
            (Some(_), true) => {
                return Err(ConfigError::new(
                    "check-open",
                    "cannot be set with check-token (a token set is required; leave out one)",
                ));
            }
            (Some(token), false) => CheckAccess::Token(token.clone()),
            (None, true) => CheckAccess::Open,
            (None, false) => CheckAccess::Closed,
        };
        let mut policy = self.policy()?;
        // Kernel escalation, a broker setting for its ban lengths, is the kernel's to judge.
        if broker
            .limiter
            .escalation
            .is_some_and(|e| e.refused_for.is_some())
        {
            policy.base.offense_gap_ns = crate::duration_units::duration_ns(defaults::OFFENSE_GAP);
        }
        broker.limiter.mode = self.mode.unwrap_or_default();
        if self
            .state_file
            .as_ref()
            .is_some_and(|p| p.as_os_str().is_empty())
        {
            return Err(ConfigError::new("state-file", "is empty"));
        }
        let state_file = self
            .state_file
            .clone()
            .unwrap_or_else(|| PathBuf::from(defaults::STATE_FILE));
        let event_log = super::event_log::resolve(self.event_log.as_deref(), &state_file)?;
        let lists = ListFiles {
            allow: self
                .allow_file
                .as_deref()
                .map(|path| ListFile::read("allow-file", path))
                .transpose()?,
            deny: self
                .deny_file
                .as_deref()
                .map(|path| ListFile::read("deny-file", path))
                .transpose()?,
        };
        Ok(Settings {
            restart: RestartOnly {
                ifaces: self
                    .iface
                    .iter()
                    .map(|i| i.trim().to_string())
                    .filter(|i| !i.is_empty())
                    .collect(),
                pin_dir: self
                    .pin_dir
                    .clone()
                    .unwrap_or_else(|| PathBuf::from(defaults::PIN_DIR)),
                http: self.http.unwrap_or(defaults::HTTP),
                flow_table_size: table_size(
                    "flow-table-size",
                    self.flow_table_size.unwrap_or(defaults::FLOW_TABLE_SIZE),
                )?,
                half_open_table_size: table_size(
                    "half-open-table-size",
                    self.half_open_table_size
                        .unwrap_or(defaults::HALF_OPEN_TABLE_SIZE),
                )?,
                xdp_mode: self.xdp_mode.unwrap_or(XdpModeArg::Auto).into(),
                kernel_debug: self.kernel_debug.unwrap_or(false),
                allow_private_bpffs: self.allow_private_bpffs.unwrap_or(false),
                broker_socket: broker_layer.socket(),
                broker_listen: broker_layer.listen,
                fleet,
                state_file,
            },
            policy,
            lists,
            sweep,
            admin_token: self.admin_token.clone(),
            check,
            clients: self.clients()?,
            broker,
            event_log,
            pinned: Vec::new(),
            restart_required: Vec::new(),
        })
    }

    fn policy(&self) -> Result<Policy, ConfigError> {
        let ports = self
            .ports
            .iter()
            .map(|p| parse_port(*p))
            .collect::<Result<Vec<_>, _>>()?;
        let ipv4_prefix = self.ipv4_prefix.unwrap_or(defaults::IPV4_PREFIX);
        let ipv6_prefix = self.ipv6_prefix.unwrap_or(defaults::IPV6_PREFIX);
        if ipv4_prefix > 32 {
            return Err(ConfigError::new(
                "ipv4-prefix",
                format!("{ipv4_prefix} is longer than an IPv4 address (32 bits)"),
            ));
        }
        if ipv6_prefix > 128 {
            return Err(ConfigError::new(
                "ipv6-prefix",
                format!("{ipv6_prefix} is longer than an IPv6 address (128 bits)"),
            ));
        }
        let syn_rate = self.syn_rate.unwrap_or(defaults::SYN_RATE);
        if syn_rate > 1_000_000_000 {
            return Err(ConfigError::new(
                "syn-rate",
                "more than one SYN per nanosecond cannot be metered",
            ));
        }
        let syn_burst = self.syn_burst.unwrap_or(syn_rate.saturating_mul(2));
        if syn_rate != 0 && syn_burst == 0 {
            return Err(ConfigError::new(
                "syn-burst",
                "must be at least 1 when a SYN rate is set",
            ));
        }
        let conn_rate = self.conn_rate.unwrap_or(0);
        if conn_rate > 1_000_000_000 {
            return Err(ConfigError::new(
                "conn-rate",
                "more than one connection per nanosecond cannot be metered",
            ));
        }
        let conn_burst = self.conn_burst.unwrap_or(conn_rate);
        if conn_rate != 0 && conn_burst == 0 {
            return Err(ConfigError::new(
                "conn-burst",
                "must be at least 1 when a connection rate is set",
            ));
        }
        let threshold = self
            .syn_cookies_threshold
            .unwrap_or(defaults::SYN_COOKIES_THRESHOLD);
        if threshold == 0 {
            return Err(ConfigError::new(
                "syn-cookies-threshold",
                "must be at least 1 SYN a second",
            ));
        }
        let cookies = match self.syn_cookies.unwrap_or(SynCookiesArg::Off) {
            SynCookiesArg::Off => CookieMode::Off,
            SynCookiesArg::Auto => CookieMode::Auto { threshold },
            SynCookiesArg::Always => CookieMode::Always,
        };
        let allow = parse_cidrs("allow", &self.allow)?;
        let deny = parse_cidrs("deny", &self.deny)?;
        let refusal =
            |arg: Option<RefusalArg>, default| Refusal::from(arg.unwrap_or(default)) as u8;
        let mut limits = Limits {
            max_conn_per_ip: self.max_conn_per_ip.unwrap_or(defaults::MAX_CONN_PER_IP),
            max_conn_total: self.max_conn_total.unwrap_or(defaults::MAX_CONN_TOTAL),
            syn_rate,
            syn_burst,
            conn_rate,
            conn_burst,
            reject_conn: refusal(self.reject_conn, RefusalArg::Rst),
            reject_rate: refusal(self.reject_rate, RefusalArg::Drop),
            monitor: (self.mode.unwrap_or_default() == Enforcement::Monitor).into(),
            ..Limits::UNLIMITED
        };
        limits.derive_rate_terms();
        let base = Config {
            limits,
            ipv4_prefix,
            ipv6_prefix,
            reject_ban: refusal(self.reject_ban, RefusalArg::Drop),
            reject_deny: refusal(self.reject_deny, RefusalArg::Drop),
            fail_closed: self.fail_closed.unwrap_or(false).into(),
            rst_xdp_tx: self.rst_xdp_tx.unwrap_or(false).into(),
            tunnels_pass: (self.tunnels.unwrap_or(TunnelsArg::Drop) == TunnelsArg::Pass).into(),
            ..Config::UNCONFIGURED
        };
        let overrides = super::source_overrides::resolve(&self.overrides, &base)?;
        let profiles = super::port_profiles::resolve(&self.profiles, &base.limits, &ports)?;
        Ok(Policy {
            base,
            cookies,
            ports,
            profiles,
            allow,
            deny,
            overrides,
        })
    }

    fn clients(&self) -> Result<ClientLimits, ConfigError> {
        let limits = ClientLimits {
            max: self.max_clients.unwrap_or(defaults::MAX_CLIENTS),
            header_timeout: self.header_timeout.unwrap_or(defaults::HEADER_TIMEOUT),
            idle_timeout: self
                .client_idle_timeout
                .unwrap_or(defaults::CLIENT_IDLE_TIMEOUT),
        };
        if limits.max == 0 {
            return Err(ConfigError::new("max-clients", "must be at least 1"));
        }
        for (setting, value) in [
            ("header-timeout", limits.header_timeout),
            ("client-idle-timeout", limits.idle_timeout),
        ] {
            if value.is_zero() {
                return Err(ConfigError::new(setting, "must be longer than zero"));
            }
        }
        Ok(limits)
    }
}

fn parse_port(port: u32) -> Result<u16, ConfigError> {
    match port {
        1..=65_535 => Ok(port as u16),
        _ => Err(ConfigError::new(
            "ports",
            format!("{port} is not a TCP port (1-65535)"),
        )),
    }
}

/// A table size, checked here, before the kernel is asked for the maps, so a size it would
/// refuse is reported as this setting rather than as a map.
fn table_size(setting: &'static str, size: u32) -> Result<u32, ConfigError> {
    match size {
        0 => Err(ConfigError::new(setting, "must be at least 1")),
        size if size > defaults::MAX_FLOW_TABLE_SIZE => Err(ConfigError::new(
            setting,
            format!(
                "{size} is more than the {} slots the agent supports",
                defaults::MAX_FLOW_TABLE_SIZE
            ),
        )),
        size => Ok(size),
    }
}

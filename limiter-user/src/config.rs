//! The agent's settings: parsed from flags and `LIMITER_<NAME>` variables (clap), checked, and
//! turned into what the kernel maps hold. A bad value stops the agent before anything attaches,
//! with a message naming the setting.

use std::{
    collections::BTreeMap,
    fmt,
    net::{IpAddr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use clap::ValueEnum;
use ipnet::IpNet;
use limiter_common::{Config, Refusal};
use serde::Deserialize;
use thiserror::Error;

use crate::loader::XdpAttachMode;

/// A setting that cannot be used; the agent exits with status 2 on it.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("invalid setting `{setting}`: {message}")]
pub struct ConfigError {
    pub setting: String,
    pub message: String,
}

impl ConfigError {
    pub fn new(setting: impl Into<String>, message: impl fmt::Display) -> Self {
        Self {
            setting: setting.into(),
            message: message.to_string(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RefusalArg {
    /// Answer the SYN with RST|ACK: the client sees "connection refused" at once.
    Rst,
    /// Drop silently: the client retries into a timeout.
    Drop,
}

impl From<RefusalArg> for Refusal {
    fn from(arg: RefusalArg) -> Self {
        match arg {
            RefusalArg::Rst => Refusal::Rst,
            RefusalArg::Drop => Refusal::Drop,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum XdpModeArg {
    Auto,
    Native,
    Skb,
}

impl From<XdpModeArg> for XdpAttachMode {
    fn from(mode: XdpModeArg) -> Self {
        match mode {
            XdpModeArg::Auto => XdpAttachMode::Auto,
            XdpModeArg::Native => XdpAttachMode::Native,
            XdpModeArg::Skb => XdpAttachMode::Skb,
        }
    }
}

/// One layer of settings: the command line (flags, each also `LIMITER_<NAME>`), or the TOML
/// file (the same names, in kebab-case). Unset is `None` / empty so that layers can be merged:
/// flags > environment > file > defaults.
#[derive(clap::Args, Deserialize, Clone, Debug, Default)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Layer {
    /// Interface to protect (repeatable); default: the interface of the default route.
    #[arg(long, env = "LIMITER_IFACE", value_delimiter = ',')]
    #[serde(default)]
    pub iface: Vec<String>,
    /// How XDP attaches: `native` needs driver support, `skb` works everywhere, `auto` tries
    /// native first. [default: auto]
    #[arg(long, env = "LIMITER_XDP_MODE", value_enum)]
    pub xdp_mode: Option<XdpModeArg>,
    /// Where maps and links are pinned, so enforcement outlives the agent and a new agent
    /// adopts them. [default: /sys/fs/bpf/limiter]
    #[arg(long, env = "LIMITER_PIN_DIR")]
    pub pin_dir: Option<PathBuf>,
    /// Protected local TCP ports, comma-separated; none protects every port.
    #[arg(long, env = "LIMITER_PORTS", value_delimiter = ',')]
    #[serde(default)]
    pub ports: Vec<u32>,
    /// Concurrent connections per source (address masked to its prefix); 0 = no limit.
    /// [default: 100]
    #[arg(long, env = "LIMITER_MAX_CONN_PER_IP")]
    pub max_conn_per_ip: Option<u32>,
    /// Concurrent connections to the host; 0 = no limit. [default: 10000]
    #[arg(long, env = "LIMITER_MAX_CONN_TOTAL")]
    pub max_conn_total: Option<u32>,
    /// New connections per second per source; 0 = no limit. [default: 20]
    #[arg(long, env = "LIMITER_SYN_RATE")]
    pub syn_rate: Option<u32>,
    /// New connections a source may open back to back before the rate applies.
    /// [default: twice the rate]
    #[arg(long, env = "LIMITER_SYN_BURST")]
    pub syn_burst: Option<u32>,
    /// Prefix an IPv4 source is masked to before it is counted. [default: 32]
    #[arg(long, env = "LIMITER_IPV4_PREFIX")]
    pub ipv4_prefix: Option<u8>,
    /// Prefix an IPv6 source is masked to (one client usually holds a whole /64). [default: 64]
    #[arg(long, env = "LIMITER_IPV6_PREFIX")]
    pub ipv6_prefix: Option<u8>,
    /// How a SYN over a connection cap is refused. [default: rst]
    #[arg(long, env = "LIMITER_REJECT_CONN", value_enum)]
    pub reject_conn: Option<RefusalArg>,
    /// How a SYN over the SYN rate is refused. [default: drop]
    #[arg(long, env = "LIMITER_REJECT_RATE", value_enum)]
    pub reject_rate: Option<RefusalArg>,
    /// How a SYN from a banned source is refused (other packets are dropped). [default: drop]
    #[arg(long, env = "LIMITER_REJECT_BAN", value_enum)]
    pub reject_ban: Option<RefusalArg>,
    /// How a SYN from a denylisted source is refused (other packets are dropped).
    /// [default: drop]
    #[arg(long, env = "LIMITER_REJECT_DENY", value_enum)]
    pub reject_deny: Option<RefusalArg>,
    /// Source CIDR never limited (repeatable).
    #[arg(long, env = "LIMITER_ALLOW", value_delimiter = ',')]
    #[serde(default)]
    pub allow: Vec<String>,
    /// Source CIDR whose packets to protected ports are dropped (repeatable).
    #[arg(long, env = "LIMITER_DENY", value_delimiter = ',')]
    #[serde(default)]
    pub deny: Vec<String>,
    /// Connections the flow table can track; sizes the per-source tables too. Applies when
    /// the maps are created, not to maps adopted from a pin. [default: 131072]
    #[arg(long, env = "LIMITER_FLOW_TABLE_SIZE")]
    pub flow_table_size: Option<u32>,
    /// Refuse new connections when the flow table is full, instead of passing them untracked.
    #[arg(long, env = "LIMITER_FAIL_CLOSED", num_args = 0..=1, default_missing_value = "true")]
    pub fail_closed: Option<bool>,
    /// Send RSTs with XDP_TX (fastest, but on a veth only reaches peers that run XDP) instead
    /// of through the TC ingress program (works on every interface).
    #[arg(long, env = "LIMITER_RST_XDP_TX", num_args = 0..=1, default_missing_value = "true")]
    pub rst_xdp_tx: Option<bool>,
    /// Forward the kernel programs' debug log (aya-log) to the agent's log.
    #[arg(long, env = "LIMITER_KERNEL_DEBUG", num_args = 0..=1, default_missing_value = "true")]
    pub kernel_debug: Option<bool>,
    /// How often the sweeper runs. [default: 5s]
    #[arg(long, env = "LIMITER_SWEEP_INTERVAL", value_parser = humantime::parse_duration)]
    #[serde(default, deserialize_with = "duration")]
    pub sweep_interval: Option<Duration>,
    /// Half-open connections older than this are evicted. [default: 30s]
    #[arg(long, env = "LIMITER_SYN_TIMEOUT", value_parser = humantime::parse_duration)]
    #[serde(default, deserialize_with = "duration")]
    pub syn_timeout: Option<Duration>,
    /// Established connections idle longer than this are evicted. [default: 1h]
    #[arg(long, env = "LIMITER_IDLE_TIMEOUT", value_parser = humantime::parse_duration)]
    #[serde(default, deserialize_with = "duration")]
    pub idle_timeout: Option<Duration>,
    /// Entries one sweep pass examines at most, so a huge table never stalls the agent.
    /// [default: 65536]
    #[arg(long, env = "LIMITER_SWEEP_BATCH")]
    pub sweep_batch: Option<u32>,
    /// Address of the HTTP listener (metrics, status, admin). [default: 127.0.0.1:9090]
    #[arg(long, env = "LIMITER_HTTP")]
    pub http: Option<SocketAddr>,
    /// Bearer token the admin endpoints require; without one they are off.
    #[arg(long, env = "LIMITER_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
}

/// A duration written as text ("30s", "1h"), for optional settings in the file.
pub fn duration<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let text = String::deserialize(d)?;
    humantime::parse_duration(&text)
        .map(Some)
        .map_err(|e| serde::de::Error::custom(format!("`{text}` is not a duration: {e}")))
}

pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/limiter";
pub const DEFAULT_HTTP: SocketAddr =
    SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 9090);

/// The sweeper's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SweepSettings {
    pub interval: Duration,
    pub syn_timeout: Duration,
    pub idle_timeout: Duration,
    pub batch: u32,
}

/// Every setting of a running agent, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    pub ifaces: Vec<String>,
    pub xdp_mode: XdpAttachMode,
    pub pin_dir: PathBuf,
    pub kernel: KernelSettings,
    pub kernel_debug: bool,
    pub sweep: SweepSettings,
    pub http: SocketAddr,
    pub admin_token: Option<String>,
}

/// Checked kernel settings, ready for the maps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelSettings {
    pub config: Config,
    /// Protected ports; empty means every port.
    pub ports: Vec<u16>,
    pub allow: Vec<IpNet>,
    pub deny: Vec<IpNet>,
    pub flow_table_size: u32,
}

/// What a configuration file holds: the settings layer at the top level, the broker
/// protocol's settings under `[broker]`, and the broker limiter's actions under `[actions]`.
#[derive(Clone, Debug, Default)]
pub struct FileConfig {
    pub layer: Layer,
    pub broker: crate::protocol::config::BrokerFile,
    pub actions: BTreeMap<String, crate::buckets::ActionConfig>,
}

impl FileConfig {
    pub fn read(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::new("config", format!("reading {}: {e}", path.display())))?;
        Self::parse(&text).map_err(|e| ConfigError {
            setting: e.setting,
            message: format!("{}: {}", path.display(), e.message),
        })
    }

    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let mut table: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| ConfigError::new("config", e.message()))?;
        let actions = match table.remove("actions") {
            None => BTreeMap::new(),
            Some(value) => value
                .try_into()
                .map_err(|e: toml::de::Error| ConfigError::new("actions", e.message()))?,
        };
        let broker = match table.remove("broker") {
            None => Default::default(),
            Some(value) => value
                .try_into()
                .map_err(|e: toml::de::Error| ConfigError::new("broker", e.message()))?,
        };
        let layer = Layer::deserialize(toml::Value::Table(table)).map_err(|e| {
            // serde names the offending key in its message ("unknown field `x`").
            ConfigError::new("config", e.message())
        })?;
        Ok(Self {
            layer,
            broker,
            actions,
        })
    }
}

impl Layer {
    /// This layer over `lower`: every setting this one leaves unset comes from `lower`.
    pub fn over(self, lower: Layer) -> Layer {
        fn list<T>(upper: Vec<T>, lower: Vec<T>) -> Vec<T> {
            if upper.is_empty() { lower } else { upper }
        }
        Layer {
            iface: list(self.iface, lower.iface),
            xdp_mode: self.xdp_mode.or(lower.xdp_mode),
            pin_dir: self.pin_dir.or(lower.pin_dir),
            ports: list(self.ports, lower.ports),
            max_conn_per_ip: self.max_conn_per_ip.or(lower.max_conn_per_ip),
            max_conn_total: self.max_conn_total.or(lower.max_conn_total),
            syn_rate: self.syn_rate.or(lower.syn_rate),
            syn_burst: self.syn_burst.or(lower.syn_burst),
            ipv4_prefix: self.ipv4_prefix.or(lower.ipv4_prefix),
            ipv6_prefix: self.ipv6_prefix.or(lower.ipv6_prefix),
            reject_conn: self.reject_conn.or(lower.reject_conn),
            reject_rate: self.reject_rate.or(lower.reject_rate),
            reject_ban: self.reject_ban.or(lower.reject_ban),
            reject_deny: self.reject_deny.or(lower.reject_deny),
            allow: list(self.allow, lower.allow),
            deny: list(self.deny, lower.deny),
            flow_table_size: self.flow_table_size.or(lower.flow_table_size),
            fail_closed: self.fail_closed.or(lower.fail_closed),
            rst_xdp_tx: self.rst_xdp_tx.or(lower.rst_xdp_tx),
            kernel_debug: self.kernel_debug.or(lower.kernel_debug),
            sweep_interval: self.sweep_interval.or(lower.sweep_interval),
            syn_timeout: self.syn_timeout.or(lower.syn_timeout),
            idle_timeout: self.idle_timeout.or(lower.idle_timeout),
            sweep_batch: self.sweep_batch.or(lower.sweep_batch),
            http: self.http.or(lower.http),
            admin_token: self.admin_token.or(lower.admin_token),
        }
    }

    /// Fills in the defaults and checks every setting.
    pub fn resolve(&self) -> Result<Settings, ConfigError> {
        let sweep = SweepSettings {
            interval: self.sweep_interval.unwrap_or(Duration::from_secs(5)),
            syn_timeout: self.syn_timeout.unwrap_or(Duration::from_secs(30)),
            idle_timeout: self.idle_timeout.unwrap_or(Duration::from_secs(3600)),
            batch: self.sweep_batch.unwrap_or(65_536),
        };
        for (setting, value) in [
            ("sweep-interval", sweep.interval),
            ("syn-timeout", sweep.syn_timeout),
            ("idle-timeout", sweep.idle_timeout),
        ] {
            if value.is_zero() {
                return Err(ConfigError::new(setting, "must be longer than zero"));
            }
        }
        if sweep.batch == 0 {
            return Err(ConfigError::new("sweep-batch", "must be at least 1"));
        }
        if self
            .admin_token
            .as_deref()
            .is_some_and(|t| t.trim().is_empty())
        {
            return Err(ConfigError::new(
                "admin-token",
                "is empty (leave it out to turn the admin endpoints off)",
            ));
        }
        Ok(Settings {
            ifaces: self
                .iface
                .iter()
                .map(|i| i.trim().to_string())
                .filter(|i| !i.is_empty())
                .collect(),
            xdp_mode: self.xdp_mode.unwrap_or(XdpModeArg::Auto).into(),
            pin_dir: self
                .pin_dir
                .clone()
                .unwrap_or_else(|| PathBuf::from(DEFAULT_PIN_DIR)),
            kernel: self.kernel()?,
            kernel_debug: self.kernel_debug.unwrap_or(false),
            sweep,
            http: self.http.unwrap_or(DEFAULT_HTTP),
            admin_token: self.admin_token.clone(),
        })
    }

    fn kernel(&self) -> Result<KernelSettings, ConfigError> {
        let ports = self
            .ports
            .iter()
            .map(|p| parse_port(*p))
            .collect::<Result<Vec<_>, _>>()?;
        let ipv4_prefix = self.ipv4_prefix.unwrap_or(32);
        let ipv6_prefix = self.ipv6_prefix.unwrap_or(64);
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
        let syn_rate = self.syn_rate.unwrap_or(20);
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
        let flow_table_size = self
            .flow_table_size
            .unwrap_or(limiter_common::maps::FLOWS.default_entries);
        if flow_table_size == 0 {
            return Err(ConfigError::new("flow-table-size", "must be at least 1"));
        }
        let allow = parse_cidrs("allow", &self.allow)?;
        let deny = parse_cidrs("deny", &self.deny)?;
        let refusal =
            |arg: Option<RefusalArg>, default| Refusal::from(arg.unwrap_or(default)) as u8;
        let config = Config {
            max_conn_per_ip: self.max_conn_per_ip.unwrap_or(100),
            max_conn_total: self.max_conn_total.unwrap_or(10_000),
            syn_rate,
            syn_burst,
            ipv4_prefix,
            ipv6_prefix,
            reject_conn: refusal(self.reject_conn, RefusalArg::Rst),
            reject_rate: refusal(self.reject_rate, RefusalArg::Drop),
            reject_ban: refusal(self.reject_ban, RefusalArg::Drop),
            reject_deny: refusal(self.reject_deny, RefusalArg::Drop),
            fail_closed: self.fail_closed.unwrap_or(false).into(),
            all_ports: ports.is_empty().into(),
            has_allow: (!allow.is_empty()).into(),
            has_deny: (!deny.is_empty()).into(),
            // `Maps::apply` keeps the live value: it follows the ban table, not the settings.
            has_bans: 0,
            rst_xdp_tx: self.rst_xdp_tx.unwrap_or(false).into(),
        };
        Ok(KernelSettings {
            config,
            ports,
            allow,
            deny,
            flow_table_size,
        })
    }
}

impl KernelSettings {
    /// These settings with extra list entries (the admin API's) added to the file's.
    pub fn with_lists(&self, allow: &[IpNet], deny: &[IpNet]) -> KernelSettings {
        let mut out = self.clone();
        for (list, extra) in [(&mut out.allow, allow), (&mut out.deny, deny)] {
            for net in extra {
                if !list.contains(net) {
                    list.push(*net);
                }
            }
        }
        out.config.has_allow = (!out.allow.is_empty()).into();
        out.config.has_deny = (!out.deny.is_empty()).into();
        out
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

/// Parses CIDRs (a bare address is a host route); host bits set below the prefix are refused,
/// since they usually mean a typo in the prefix.
pub fn parse_cidrs(setting: &'static str, texts: &[String]) -> Result<Vec<IpNet>, ConfigError> {
    texts
        .iter()
        .filter(|t| !t.trim().is_empty())
        .map(|text| parse_cidr(setting, text))
        .collect()
}

pub fn parse_cidr(setting: &'static str, text: &str) -> Result<IpNet, ConfigError> {
    let text = text.trim();
    let net = match text.parse::<IpNet>() {
        Ok(net) => net,
        Err(_) => match text.parse::<IpAddr>() {
            Ok(addr) => IpNet::from(addr),
            Err(_) => return Err(ConfigError::new(setting, format!("`{text}` is not a CIDR"))),
        },
    };
    // An IPv4-mapped network is the IPv4 network it maps: IPv4 packets consult the IPv4 tries.
    let net = match net {
        IpNet::V6(v6) if v6.prefix_len() >= 96 => match v6.addr().to_ipv4_mapped() {
            Some(v4) => IpNet::new(IpAddr::V4(v4), v6.prefix_len() - 96).unwrap_or(net),
            None => net,
        },
        _ => net,
    };
    if net.trunc() != net {
        return Err(ConfigError::new(
            setting,
            format!(
                "`{text}` has host bits set below its prefix (did you mean {}?)",
                net.trunc()
            ),
        ));
    }
    Ok(net)
}

/// An address as the kernel keys it: IPv4 as IPv4-mapped IPv6.
pub fn mapped(addr: IpAddr) -> Ipv6Addr {
    match addr {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Wrapper {
        #[command(flatten)]
        layer: Layer,
    }

    fn flags(args: &[&str]) -> Layer {
        let mut argv = vec!["limiter"];
        argv.extend_from_slice(args);
        Wrapper::try_parse_from(argv).unwrap().layer
    }

    fn settings(args: &[&str]) -> Result<KernelSettings, ConfigError> {
        flags(args).resolve().map(|s| s.kernel)
    }

    #[test]
    fn defaults_suit_a_broker_host() {
        let all = flags(&[]).resolve().unwrap();
        let s = &all.kernel;
        assert_eq!(s.config.max_conn_per_ip, 100);
        assert_eq!(s.config.syn_burst, 40);
        assert_eq!(s.config.ipv6_prefix, 64);
        assert_eq!(s.config.reject_conn, Refusal::Rst as u8);
        assert_eq!(s.config.reject_rate, Refusal::Drop as u8);
        assert_eq!(s.config.all_ports, 1);
        assert_eq!(all.pin_dir, PathBuf::from(DEFAULT_PIN_DIR));
        assert_eq!(all.http, DEFAULT_HTTP);
        assert_eq!(all.admin_token, None);
    }

    #[test]
    fn errors_name_the_setting() {
        for (args, setting) in [
            (&["--ports", "70000"][..], "ports"),
            (&["--ports", "0"][..], "ports"),
            (&["--ipv4-prefix", "33"][..], "ipv4-prefix"),
            (&["--ipv6-prefix", "129"][..], "ipv6-prefix"),
            (&["--allow", "10.0.0.0/33"][..], "allow"),
            (&["--allow", "not-a-net"][..], "allow"),
            (&["--deny", "10.0.0.1/8"][..], "deny"),
            (&["--syn-rate", "5", "--syn-burst", "0"][..], "syn-burst"),
            (&["--flow-table-size", "0"][..], "flow-table-size"),
            (&["--syn-timeout", "0s"][..], "syn-timeout"),
        ] {
            let error = settings(args).unwrap_err();
            assert_eq!(error.setting, setting, "{args:?}: {error}");
            assert!(error.to_string().contains(setting));
        }
    }

    #[test]
    fn lists_and_ports_reach_the_kernel_config() {
        let s = settings(&[
            "--ports",
            "5672,8883",
            "--allow",
            "10.1.0.0/16,::1",
            "--fail-closed",
        ])
        .unwrap();
        assert_eq!(s.ports, vec![5672, 8883]);
        assert_eq!(s.config.all_ports, 0);
        assert_eq!(s.config.has_allow, 1);
        assert_eq!(s.config.has_deny, 0);
        assert_eq!(s.config.fail_closed, 1);
        assert_eq!(s.allow[1].to_string(), "::1/128");
        let mapped = settings(&["--deny", "::ffff:10.9.0.0/112"]).unwrap();
        assert_eq!(mapped.deny[0].to_string(), "10.9.0.0/16");
    }

    #[test]
    fn flags_win_over_the_file_and_the_file_over_defaults() {
        let file = FileConfig::parse(
            "max-conn-per-ip = 7\nmax-conn-total = 70\nsyn-timeout = \"10s\"\nports = [5672]\n\n[actions.login]\nlimit = 3\nwindow = \"1m\"\n",
        )
        .unwrap();
        assert!(file.actions.contains_key("login"));
        let s = flags(&["--max-conn-per-ip", "9"])
            .over(file.layer)
            .resolve()
            .unwrap();
        assert_eq!(s.kernel.config.max_conn_per_ip, 9);
        assert_eq!(s.kernel.config.max_conn_total, 70);
        assert_eq!(s.kernel.ports, vec![5672]);
        assert_eq!(s.sweep.syn_timeout, Duration::from_secs(10));
        assert_eq!(s.sweep.idle_timeout, Duration::from_secs(3600));
    }

    #[test]
    fn file_errors_name_the_key() {
        for (text, needle) in [
            (
                "max-conn-per-ip = 1\nmax-conn-per-ipp = 2\n",
                "max-conn-per-ipp",
            ),
            ("ipv4-prefix = 300\n", "300"),
            ("idle-timeout = \"soon\"\n", "soon"),
            ("reject-conn = \"maybe\"\n", "maybe"),
            ("max-conn-total = \n", "config"),
        ] {
            let error = FileConfig::parse(text).unwrap_err();
            assert!(error.to_string().contains(needle), "{text:?}: {error}");
        }
    }
}

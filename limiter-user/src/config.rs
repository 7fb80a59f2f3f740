//! The agent's settings: parsed from flags and `LIMITER_<NAME>` variables (clap), checked, and
//! turned into what the kernel maps hold. A bad value stops the agent before anything attaches,
//! with a message naming the setting.

use std::{
    fmt,
    net::{IpAddr, Ipv6Addr},
};

use clap::ValueEnum;
use ipnet::IpNet;
use limiter_common::{Config, Refusal};
use thiserror::Error;

use crate::loader::XdpAttachMode;

/// A setting that cannot be used; the agent exits with status 2 on it.
#[derive(Debug, Error)]
#[error("invalid setting `{setting}`: {message}")]
pub struct ConfigError {
    pub setting: &'static str,
    pub message: String,
}

impl ConfigError {
    pub fn new(setting: &'static str, message: impl fmt::Display) -> Self {
        Self {
            setting,
            message: message.to_string(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
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

/// The kernel datapath's settings. Every flag also reads `LIMITER_<NAME>`; 0 for a limit means
/// no limit.
#[derive(clap::Args, Clone, Debug)]
pub struct KernelArgs {
    /// Interface to protect (repeatable); default: the interface of the default route.
    #[arg(long, env = "LIMITER_IFACE", value_delimiter = ',')]
    pub iface: Vec<String>,
    /// How XDP attaches: `native` needs driver support, `skb` works everywhere, `auto` tries
    /// native first.
    #[arg(long, env = "LIMITER_XDP_MODE", value_enum, default_value_t = XdpModeArg::Auto)]
    pub xdp_mode: XdpModeArg,
    /// Protected local TCP ports, comma-separated; empty protects every port.
    #[arg(long, env = "LIMITER_PORTS", value_delimiter = ',')]
    pub ports: Vec<String>,
    /// Concurrent connections per source (address masked to its prefix).
    #[arg(long, env = "LIMITER_MAX_CONN_PER_IP", default_value_t = 100)]
    pub max_conn_per_ip: u32,
    /// Concurrent connections to the host.
    #[arg(long, env = "LIMITER_MAX_CONN_TOTAL", default_value_t = 10_000)]
    pub max_conn_total: u32,
    /// New connections per second per source.
    #[arg(long, env = "LIMITER_SYN_RATE", default_value_t = 20)]
    pub syn_rate: u32,
    /// New connections a source may open back to back before the rate applies
    /// (default: twice the rate).
    #[arg(long, env = "LIMITER_SYN_BURST")]
    pub syn_burst: Option<u32>,
    /// Prefix an IPv4 source is masked to before it is counted.
    #[arg(long, env = "LIMITER_IPV4_PREFIX", default_value_t = 32)]
    pub ipv4_prefix: u8,
    /// Prefix an IPv6 source is masked to (one client usually holds a whole /64).
    #[arg(long, env = "LIMITER_IPV6_PREFIX", default_value_t = 64)]
    pub ipv6_prefix: u8,
    /// How a SYN over a connection cap is refused.
    #[arg(long, env = "LIMITER_REJECT_CONN", value_enum, default_value_t = RefusalArg::Rst)]
    pub reject_conn: RefusalArg,
    /// How a SYN over the SYN rate is refused.
    #[arg(long, env = "LIMITER_REJECT_RATE", value_enum, default_value_t = RefusalArg::Drop)]
    pub reject_rate: RefusalArg,
    /// How a SYN from a banned source is refused (other packets are dropped).
    #[arg(long, env = "LIMITER_REJECT_BAN", value_enum, default_value_t = RefusalArg::Drop)]
    pub reject_ban: RefusalArg,
    /// How a SYN from a denylisted source is refused (other packets are dropped).
    #[arg(long, env = "LIMITER_REJECT_DENY", value_enum, default_value_t = RefusalArg::Drop)]
    pub reject_deny: RefusalArg,
    /// Source CIDR never limited (repeatable).
    #[arg(long, env = "LIMITER_ALLOW", value_delimiter = ',')]
    pub allow: Vec<String>,
    /// Source CIDR whose packets to protected ports are dropped (repeatable).
    #[arg(long, env = "LIMITER_DENY", value_delimiter = ',')]
    pub deny: Vec<String>,
    /// Connections the flow table can track; sizes the per-source tables too.
    #[arg(long, env = "LIMITER_FLOW_TABLE_SIZE", default_value_t = 131_072)]
    pub flow_table_size: u32,
    /// Refuse new connections when the flow table is full, instead of passing them untracked.
    #[arg(long, env = "LIMITER_FAIL_CLOSED")]
    pub fail_closed: bool,
    /// Forward the kernel programs' debug log (aya-log) to the agent's log.
    #[arg(long, env = "LIMITER_KERNEL_DEBUG")]
    pub kernel_debug: bool,
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

impl KernelArgs {
    pub fn settings(&self) -> Result<KernelSettings, ConfigError> {
        let ports = self
            .ports
            .iter()
            .filter(|p| !p.trim().is_empty())
            .map(|p| parse_port(p))
            .collect::<Result<Vec<_>, _>>()?;
        if self.ipv4_prefix > 32 {
            return Err(ConfigError::new(
                "ipv4-prefix",
                format!(
                    "{} is longer than an IPv4 address (32 bits)",
                    self.ipv4_prefix
                ),
            ));
        }
        if self.ipv6_prefix > 128 {
            return Err(ConfigError::new(
                "ipv6-prefix",
                format!(
                    "{} is longer than an IPv6 address (128 bits)",
                    self.ipv6_prefix
                ),
            ));
        }
        if self.syn_rate > 1_000_000_000 {
            return Err(ConfigError::new(
                "syn-rate",
                "more than one SYN per nanosecond cannot be metered",
            ));
        }
        let syn_burst = self.syn_burst.unwrap_or(self.syn_rate.saturating_mul(2));
        if self.syn_rate != 0 && syn_burst == 0 {
            return Err(ConfigError::new(
                "syn-burst",
                "must be at least 1 when a SYN rate is set",
            ));
        }
        if self.flow_table_size == 0 {
            return Err(ConfigError::new("flow-table-size", "must be at least 1"));
        }
        let allow = parse_cidrs("allow", &self.allow)?;
        let deny = parse_cidrs("deny", &self.deny)?;
        let config = Config {
            max_conn_per_ip: self.max_conn_per_ip,
            max_conn_total: self.max_conn_total,
            syn_rate: self.syn_rate,
            syn_burst,
            ipv4_prefix: self.ipv4_prefix,
            ipv6_prefix: self.ipv6_prefix,
            reject_conn: Refusal::from(self.reject_conn) as u8,
            reject_rate: Refusal::from(self.reject_rate) as u8,
            reject_ban: Refusal::from(self.reject_ban) as u8,
            reject_deny: Refusal::from(self.reject_deny) as u8,
            fail_closed: self.fail_closed.into(),
            all_ports: ports.is_empty().into(),
            has_allow: (!allow.is_empty()).into(),
            has_deny: (!deny.is_empty()).into(),
            _pad: [0; 2],
        };
        Ok(KernelSettings {
            config,
            ports,
            allow,
            deny,
            flow_table_size: self.flow_table_size,
        })
    }
}

fn parse_port(text: &str) -> Result<u16, ConfigError> {
    match text.trim().parse::<u32>() {
        Ok(port @ 1..=65_535) => Ok(port as u16),
        Ok(port) => Err(ConfigError::new(
            "ports",
            format!("{port} is not a TCP port (1-65535)"),
        )),
        Err(_) => Err(ConfigError::new(
            "ports",
            format!("`{text}` is not a port number"),
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
        kernel: KernelArgs,
    }

    fn settings(args: &[&str]) -> Result<KernelSettings, ConfigError> {
        let mut argv = vec!["limiter"];
        argv.extend_from_slice(args);
        Wrapper::try_parse_from(argv).unwrap().kernel.settings()
    }

    #[test]
    fn defaults_suit_a_broker_host() {
        let s = settings(&[]).unwrap();
        assert_eq!(s.config.max_conn_per_ip, 100);
        assert_eq!(s.config.syn_burst, 40);
        assert_eq!(s.config.ipv6_prefix, 64);
        assert_eq!(s.config.reject_conn, Refusal::Rst as u8);
        assert_eq!(s.config.reject_rate, Refusal::Drop as u8);
        assert_eq!(s.config.all_ports, 1);
    }

    #[test]
    fn errors_name_the_setting() {
        for (args, setting) in [
            (&["--ports", "70000"][..], "ports"),
            (&["--ports", "0"][..], "ports"),
            (&["--ports", "amqp"][..], "ports"),
            (&["--ipv4-prefix", "33"][..], "ipv4-prefix"),
            (&["--ipv6-prefix", "129"][..], "ipv6-prefix"),
            (&["--allow", "10.0.0.0/33"][..], "allow"),
            (&["--deny", "10.0.0.1/8"][..], "deny"),
            (&["--syn-rate", "5", "--syn-burst", "0"][..], "syn-burst"),
            (&["--flow-table-size", "0"][..], "flow-table-size"),
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
    }
}

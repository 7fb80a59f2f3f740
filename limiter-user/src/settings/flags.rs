//! The settings as flags and file keys: one [`Layer`] type is both the command line (each flag
//! also a `LIMITER_<NAME>` variable) and the file's top level, so a setting is declared once.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

use limiter_common::Refusal;

use crate::{buckets::Enforcement, datapath::XdpAttachMode};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
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

/// When the programs answer SYNs with cookies themselves (see `syn-cookies`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SynCookiesArg {
    /// Never: every SYN the limits admit reaches the host.
    Off,
    /// While the SYNs reaching the host pass `syn-cookies-threshold` a second.
    Auto,
    /// For every SYN from a source that holds no connection.
    Always,
}

/// What the programs do with tunnelled packets (IP in IP, IPv6 in IP, GRE) on ingress.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TunnelsArg {
    /// Drop them: the host would take the packet inside off its tunnel device, unjudged.
    Drop,
    /// Let them through, for a host that ends tunnels (limiter attached to the tunnel's
    /// device too judges what comes out of it).
    Pass,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
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
#[derive(clap::Args, Serialize, Deserialize, Clone, Debug, Default)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Layer {
    /// Interface to protect (repeatable); default: the interface of the default route.
    #[arg(long, env = "LIMITER_IFACE", value_delimiter = ',')]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
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
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
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
    /// New connections per second admitted from all sources together (the reconnect storm
    /// after an outage); 0 = no limit. [default: 0]
    #[arg(long, env = "LIMITER_CONN_RATE")]
    pub conn_rate: Option<u32>,
    /// New connections admitted back to back before the connection rate applies.
    /// [default: the rate]
    #[arg(long, env = "LIMITER_CONN_BURST")]
    pub conn_burst: Option<u32>,
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
    /// Answer SYNs from sources holding no connection with SYN cookies made in the kernel
    /// programs, so a spoofed flood never reaches the host's TCP stack (the host needs
    /// net.ipv4.tcp_syncookies = 2; see README). [default: off]
    #[arg(long, env = "LIMITER_SYN_COOKIES", value_enum)]
    pub syn_cookies: Option<SynCookiesArg>,
    /// With `syn-cookies = auto`: SYNs a second reaching the host (or answered with cookies)
    /// that turn cookies on; they go off once the rate stays under half of it for ten
    /// seconds. [default: 2000]
    #[arg(long, env = "LIMITER_SYN_COOKIES_THRESHOLD")]
    pub syn_cookies_threshold: Option<u32>,
    /// Tunnelled packets (IPv4 protocol or IPv6 next header 4, 41, 47: IPIP, SIT, GRE) on a
    /// protected interface: dropped, or passed for a host that ends tunnels (attach limiter
    /// to the tunnel's device too). [default: drop]
    #[arg(long, env = "LIMITER_TUNNELS", value_enum)]
    pub tunnels: Option<TunnelsArg>,
    /// Source CIDR never limited (repeatable).
    #[arg(long, env = "LIMITER_ALLOW", value_delimiter = ',')]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
    /// Source CIDR whose packets to protected ports are dropped (repeatable).
    #[arg(long, env = "LIMITER_DENY", value_delimiter = ',')]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<String>,
    /// A source prefix held to limits of its own, `CIDR:KEY=VALUE,...` with any of
    /// `max-conn-per-ip`, `syn-rate`, `syn-burst` (repeatable; `;` between them in the
    /// variable); in the file, `[[overrides]]` tables. The most specific prefix wins.
    #[arg(long = "override", env = "LIMITER_OVERRIDES", value_delimiter = ';')]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overrides: Vec<super::OverrideArg>,
    /// A group of ports held to limits of its own and counted apart from every other port,
    /// `NAME:ports=P+P,KEY=VALUE,...` with any of `max-conn-per-ip`, `max-conn-total`,
    /// `syn-rate`, `syn-burst`, `conn-rate`, `conn-burst`, `reject-conn`, `reject-rate`,
    /// `mode` (repeatable; `;` between them in the variable); in the file, `[profiles.NAME]`
    /// tables. What a profile leaves out is the top level's.
    #[arg(long = "profile", env = "LIMITER_PROFILES", value_delimiter = ';')]
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        with = "super::port_profiles::by_name"
    )]
    pub profiles: Vec<super::ProfileArg>,
    /// `enforce`, or `monitor`: the dry run. The kernel's caps, rates, bans and lists, the
    /// broker's actions (those that set no `mode` of their own) and escalation judge and
    /// count everything as they would, but refuse, close and ban nothing. [default: enforce]
    #[arg(long, env = "LIMITER_MODE", value_enum)]
    pub mode: Option<Enforcement>,
    /// File of source CIDRs never limited, one a line (`#` comments); watched, and applied as
    /// it changes. Its entries join `allow`.
    #[arg(long, env = "LIMITER_ALLOW_FILE")]
    pub allow_file: Option<PathBuf>,
    /// File of source CIDRs refused, one a line (`#` comments); watched, and applied as it
    /// changes. Its entries join `deny`.
    #[arg(long, env = "LIMITER_DENY_FILE")]
    pub deny_file: Option<PathBuf>,
    /// Where the bans in force and the list entries added over HTTP or the CLI are kept, so
    /// they outlive a restart and a reboot; written atomically, read at the start.
    /// [default: /var/lib/limiter/state.json]
    #[arg(long, env = "LIMITER_STATE_FILE")]
    pub state_file: Option<PathBuf>,
    /// Where enforcement events (bans and their cause, disconnects by strikes, SYN-cookie
    /// switches, mode changes, fleet fallbacks) are written, one JSON line each: `off`,
    /// `journald` (`journalctl -t limiter-events`) or an absolute file path; `limiter events`
    /// follows it. SIGHUP reopens the file. [default: events.log beside state-file]
    #[arg(long, env = "LIMITER_EVENT_LOG")]
    pub event_log: Option<String>,
    /// Connections the flow table can track; sizes the per-source tables too. Applies when
    /// the maps are created, not to maps adopted from a pin. [default: 131072]
    #[arg(long, env = "LIMITER_FLOW_TABLE_SIZE")]
    pub flow_table_size: Option<u32>,
    /// Half-open connections (SYN seen, handshake not completed) remembered, least recently
    /// used first out; they hold no connection slot. Applies when the maps are created.
    /// [default: 65536]
    #[arg(long, env = "LIMITER_HALF_OPEN_TABLE_SIZE")]
    pub half_open_table_size: Option<u32>,
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
    #[serde(default, with = "text_duration")]
    pub sweep_interval: Option<Duration>,
    /// Half-open connections older than this are evicted. [default: 30s]
    #[arg(long, env = "LIMITER_SYN_TIMEOUT", value_parser = humantime::parse_duration)]
    #[serde(default, with = "text_duration")]
    pub syn_timeout: Option<Duration>,
    /// Connections the host's socket table cannot speak for (no listener on their port in the
    /// agent's network namespace) are released this long after their handshake. Others are
    /// released when their socket is gone, however idle. [default: never]
    #[arg(long, env = "LIMITER_IDLE_TIMEOUT", value_parser = humantime::parse_duration)]
    #[serde(default, with = "text_duration")]
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
    /// Bearer token `POST /v1/check` requires; without one (or check-open) the endpoint
    /// refuses every caller.
    #[arg(long, env = "LIMITER_CHECK_TOKEN", hide_env_values = true)]
    pub check_token: Option<String>,
    /// Answer `POST /v1/check` without a token. Any local user can then spend any key's
    /// bucket, a victim address's `auth` attempts included; cannot be set with check-token.
    #[arg(long, env = "LIMITER_CHECK_OPEN", num_args = 0..=1, default_missing_value = "true")]
    pub check_open: Option<bool>,
    /// Connections each listener (HTTP, Unix socket, TCP) holds at once; a newcomer to a full
    /// listener takes the slot of the oldest connection without a whole request yet, or waits
    /// if there is none. [default: 512]
    #[arg(long, env = "LIMITER_MAX_CLIENTS")]
    pub max_clients: Option<u32>,
    /// Time a new connection has to send its first request's headers (HTTP) or its first
    /// whole frame (broker protocol); an HTTP keep-alive connection gets as long for each next
    /// request's headers. [default: 10s]
    #[arg(long, env = "LIMITER_HEADER_TIMEOUT", value_parser = humantime::parse_duration)]
    #[serde(default, with = "text_duration")]
    pub header_timeout: Option<Duration>,
    /// A broker connection without a whole frame for this long is closed. [default: 5m]
    #[arg(long, env = "LIMITER_CLIENT_IDLE_TIMEOUT", value_parser = humantime::parse_duration)]
    #[serde(default, with = "text_duration")]
    pub client_idle_timeout: Option<Duration>,
    /// Mount the BPF filesystem even in a private mount namespace (`ip netns exec`), where
    /// the pins die with the agent.
    #[arg(long, env = "LIMITER_ALLOW_PRIVATE_BPFFS", num_args = 0..=1, default_missing_value = "true")]
    pub allow_private_bpffs: Option<bool>,
}

/// Durations as text ("30s", "1h") in the file, and in the merged layers.
pub mod text_duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(d) => s.serialize_str(&humantime::format_duration(*d).to_string()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let text = String::deserialize(d)?;
        humantime::parse_duration(&text)
            .map(Some)
            .map_err(|e| serde::de::Error::custom(format!("`{text}` is not a duration: {e}")))
    }
}

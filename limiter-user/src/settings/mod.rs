//! The agent's settings: declared once as flags that double as file keys ([`Layer`],
//! [`BrokerLayer`], [`ActionFlags`]), merged by one generic rule (flags and `LIMITER_*` over the
//! TOML file over the defaults), and checked into [`Settings`] by the one resolve that start
//! and SIGHUP share. A bad value stops the agent before anything attaches, with a message
//! naming the setting.

mod broker;
mod cidr_text;
mod cluster;
mod event_log;
mod file;
mod flags;
mod list_file;
mod port_profiles;
mod resolve;
mod source_overrides;

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, RwLock},
    time::Duration,
};

pub use broker::{ActionFlags, AdminPeers, BrokerLayer, BrokerSettings, ClientLimits, ServeConfig};
pub use cidr_text::{parse_cidr, parse_cidrs};
pub use cluster::ClusterLayer;
pub use event_log::{EventLog, JOURNALD_IDENTIFIER};
pub use file::FileConfig;
pub use flags::{Layer, RefusalArg, TunnelsArg, XdpModeArg};
pub use list_file::{ListFile, ListFiles, parse_list};
pub use port_profiles::ProfileArg;
pub use source_overrides::OverrideArg;

pub use crate::errors::ConfigError;
use crate::{
    datapath::{Policy, XdpAttachMode},
    fleet::FleetConfig,
};

/// Every default, in one place.
pub mod defaults {
    use std::{
        net::{IpAddr, Ipv4Addr, SocketAddr},
        time::Duration,
    };

    pub const PIN_DIR: &str = "/sys/fs/bpf/limiter";
    pub const HTTP: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9090);
    pub const SOCKET: &str = "/run/limiter/limiter.sock";
    /// systemd's `StateDirectory=limiter`.
    pub const STATE_FILE: &str = "/var/lib/limiter/state.json";
    /// The file the systemd unit runs the agent with (`--config`), which `limiter events`
    /// reads when it exists and no other is named.
    pub const CONFIG: &str = "/etc/limiter.toml";
    pub const MAX_CONN_PER_IP: u32 = 100;
    pub const MAX_CONN_TOTAL: u32 = 10_000;
    pub const SYN_RATE: u32 = 20;
    pub const SYN_COOKIES_THRESHOLD: u32 = 2_000;
    pub const IPV4_PREFIX: u8 = 32;
    pub const IPV6_PREFIX: u8 = 64;
    pub const FLOW_TABLE_SIZE: u32 = limiter_common::map_catalogue::FLOWS.default_entries;
    pub const HALF_OPEN_TABLE_SIZE: u32 = limiter_common::map_catalogue::HALF_OPEN.default_entries;
    pub const SWEEP_INTERVAL: Duration = Duration::from_secs(5);
    pub const SYN_TIMEOUT: Duration = Duration::from_secs(30);
    pub const SWEEP_BATCH: u32 = 65_536;
    pub const ESCALATE_WINDOW: Duration = Duration::from_secs(60);
    pub const ESCALATE_BAN: Duration = Duration::from_secs(600);
    pub const ESCALATE_MAX_BAN: Duration = Duration::from_secs(86_400);
    pub const ESCALATE_MEMORY: Duration = Duration::from_secs(86_400);
    /// How long a pause between two refusals at a source's proven handshakes ends its streak,
    /// for kernel escalation (`escalate-refused-for`): the kernel starts a new streak after
    /// it, and the sweeper forgets one that has paused this long.
    pub const OFFENSE_GAP: Duration = Duration::from_secs(10);
    pub const MAX_CLIENTS: u32 = 512;
    pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
    pub const CLIENT_IDLE_TIMEOUT: Duration = Duration::from_secs(300);
    /// The largest flow table the kernel programs are built for: 2^24 slots (some 1.5 GB of
    /// maps), far beyond the default.
    pub const MAX_FLOW_TABLE_SIZE: u32 = 1 << 24;
}

/// Where `limiter run` takes its settings from.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct RunArgs {
    /// TOML configuration file; flags and environment variables win over it. SIGHUP re-reads it.
    #[arg(long, env = "LIMITER_CONFIG")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub layer: Layer,
    #[command(flatten)]
    pub broker: BrokerLayer,
    #[command(flatten)]
    pub actions: ActionFlags,
    #[command(flatten)]
    pub cluster: ClusterLayer,
}

impl RunArgs {
    /// Reads the file, puts the flags over it and checks the result: what `limiter run`
    /// starts with and what SIGHUP reloads, by the same path.
    pub fn resolve(&self) -> Result<Settings, ConfigError> {
        let file = match &self.config {
            Some(path) => FileConfig::read(path)?,
            None => FileConfig::default(),
        };
        let layer = file::merge(&self.layer, &file.layer)?;
        let broker_layer = file::merge(&self.broker, &file.broker)?;
        let fleet = file::merge(&self.cluster, &file.cluster)?.resolve()?;
        let broker =
            broker_layer.resolve(&file.actions, &self.actions.overrides(), fleet.is_some())?;
        let mut settings = layer.resolve(broker, &broker_layer, fleet)?;
        settings.pinned = file::keys(&self.layer)?
            .into_iter()
            .chain(
                file::keys(&self.broker)?
                    .into_iter()
                    .map(|k| format!("broker.{k}")),
            )
            .chain(
                file::keys(&self.cluster)?
                    .into_iter()
                    .map(|k| format!("cluster.{k}")),
            )
            .chain(
                self.actions
                    .overrides()
                    .into_iter()
                    .map(|(name, _)| format!("actions.{name}")),
            )
            .collect();
        Ok(settings)
    }
}

/// `event-log` as an agent started with `config` (and these flags or `LIMITER_*` values over
/// it) resolves it: what `limiter events` reads, by the agent's own rule.
pub fn event_log_of(
    config: Option<&std::path::Path>,
    event_log: Option<&str>,
    state_file: Option<&std::path::Path>,
) -> Result<EventLog, ConfigError> {
    let file = match config {
        Some(path) => FileConfig::read(path)?.layer,
        None => Layer::default(),
    };
    let state_file = state_file
        .map(PathBuf::from)
        .or(file.state_file)
        .unwrap_or_else(|| PathBuf::from(defaults::STATE_FILE));
    event_log::resolve(event_log.or(file.event_log.as_deref()), &state_file)
}

/// The sweeper's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SweepSettings {
    pub interval: Duration,
    pub syn_timeout: Duration,
    /// For flows the host's socket table cannot speak for (no listener on their port in the
    /// agent's namespace): how long after the handshake they are released. `None`: never, since
    /// releasing a live connection lets its source past its cap.
    pub idle_timeout: Option<Duration>,
    pub batch: u32,
}

/// Every setting of a running agent, checked.
#[derive(Clone, Debug)]
pub struct Settings {
    /// In the live settings, always the start's values: what the agent was built with.
    pub restart: RestartOnly,
    pub policy: Policy,
    /// `allow-file` and `deny-file`, as read by this resolve.
    pub lists: ListFiles,
    pub sweep: SweepSettings,
    pub admin_token: Option<String>,
    pub check: CheckAccess,
    /// Connection cap and timeouts of every listener.
    pub clients: ClientLimits,
    pub broker: BrokerSettings,
    /// Where enforcement events go (`event-log`); a reload reopens it.
    pub event_log: EventLog,
    /// Settings the command line or the environment set, which the file cannot change.
    pub pinned: Vec<String>,
    /// Settings the file changed since the start that apply only on a restart (reload fills
    /// it in).
    pub restart_required: Vec<String>,
}

/// Who `POST /v1/check` answers. A check spends the key's bucket, and `auth` is keyed by
/// address, so an endpoint open to every local user lets any of them spend a victim's
/// attempts: it stays closed unless the operator chooses a token or opens it outright.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CheckAccess {
    /// Callers presenting this bearer token (`check-token`).
    Token(String),
    /// Every caller that reaches the listener (`check-open`).
    Open,
    /// Nobody, until one of the two is set.
    Closed,
}

/// The settings the agent is built from once (maps sized, programs loaded and attached,
/// listeners bound, the fleet connected), which a reload therefore cannot apply. One struct,
/// so a reload keeps them all and compares them as a whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestartOnly {
    /// Empty: the interface of the default route, found at the start.
    pub ifaces: Vec<String>,
    pub pin_dir: PathBuf,
    pub http: SocketAddr,
    /// Sizes the flow table and the per-source tables when the maps are created.
    pub flow_table_size: u32,
    /// Sizes the half-open table when the maps are created.
    pub half_open_table_size: u32,
    pub xdp_mode: XdpAttachMode,
    pub kernel_debug: bool,
    pub allow_private_bpffs: bool,
    pub broker_socket: PathBuf,
    pub broker_listen: Option<SocketAddr>,
    /// The fleet's Redis, when the agents share their buckets (`[cluster]`).
    pub fleet: Option<FleetConfig>,
    /// Read once, at the start; written from then on.
    pub state_file: PathBuf,
}

impl RestartOnly {
    /// The settings, by the names the operator writes, whose values differ in `other`.
    pub fn differences(&self, other: &Self) -> Vec<&'static str> {
        if self == other {
            return Vec::new();
        }
        // No `..`: a new field does not compile until it is named here.
        let Self {
            ifaces,
            pin_dir,
            http,
            flow_table_size,
            half_open_table_size,
            xdp_mode,
            kernel_debug,
            allow_private_bpffs,
            broker_socket,
            broker_listen,
            fleet,
            state_file,
        } = self;
        [
            ("iface", *ifaces != other.ifaces),
            ("pin-dir", *pin_dir != other.pin_dir),
            ("http", *http != other.http),
            ("flow-table-size", *flow_table_size != other.flow_table_size),
            (
                "half-open-table-size",
                *half_open_table_size != other.half_open_table_size,
            ),
            ("xdp-mode", *xdp_mode != other.xdp_mode),
            ("kernel-debug", *kernel_debug != other.kernel_debug),
            (
                "allow-private-bpffs",
                *allow_private_bpffs != other.allow_private_bpffs,
            ),
            ("broker.socket", *broker_socket != other.broker_socket),
            ("broker.listen", *broker_listen != other.broker_listen),
            ("cluster", *fleet != other.fleet),
            ("state-file", *state_file != other.state_file),
        ]
        .into_iter()
        .filter_map(|(name, changed)| changed.then_some(name))
        .collect()
    }
}

impl Settings {
    /// What the agent serves the broker protocol with; the addresses are the start's.
    pub fn serve(&self) -> ServeConfig {
        ServeConfig {
            listen: self.restart.broker_listen,
            clients: self.clients,
            admin: self.broker.admin.clone(),
            ..ServeConfig::unix(self.restart.broker_socket.clone())
        }
    }

    /// `new`, a reload's resolve, as the running agent takes it: every live setting from
    /// `new`, the restart-only ones kept from these, and those the file changed named, each
    /// compared with what the agent runs, so a file changed back needs no restart.
    pub fn reloaded(&self, new: Settings) -> Settings {
        Settings {
            restart: self.restart.clone(),
            restart_required: self
                .restart
                .differences(&new.restart)
                .into_iter()
                .map(str::to_owned)
                .collect(),
            ..new
        }
    }
}

/// The settings in force, shared by the services and replaced whole on SIGHUP; services read
/// them per use, so a reload applies without restarting them.
#[derive(Clone, Debug)]
pub struct Live(Arc<RwLock<Settings>>);

impl Live {
    pub fn new(settings: Settings) -> Self {
        Self(Arc::new(RwLock::new(settings)))
    }

    pub fn get(&self) -> Settings {
        self.0.read().expect("settings lock").clone()
    }

    /// One reading of the settings in force, without copying them all.
    pub fn read<R>(&self, f: impl FnOnce(&Settings) -> R) -> R {
        f(&self.0.read().expect("settings lock"))
    }

    pub fn replace(&self, settings: Settings) {
        *self.0.write().expect("settings lock") = settings;
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use clap::Parser;
    use limiter_common::Refusal;

    use super::*;

    #[derive(Parser)]
    struct Wrapper {
        #[command(flatten)]
        run: RunArgs,
    }

    fn args(args: &[&str]) -> RunArgs {
        let mut argv = vec!["limiter"];
        argv.extend_from_slice(args);
        Wrapper::try_parse_from(argv).unwrap().run
    }

    fn policy(flags: &[&str]) -> Result<Policy, ConfigError> {
        args(flags).resolve().map(|s| s.policy)
    }

    #[test]
    fn defaults_suit_a_broker_host() {
        let all = args(&[]).resolve().unwrap();
        let config = all.policy.config();
        assert_eq!(config.limits.max_conn_per_ip, 100);
        assert_eq!(config.limits.syn_burst, 40);
        assert_eq!(config.ipv6_prefix, 64);
        assert_eq!(config.limits.reject_conn, Refusal::Rst as u8);
        assert_eq!(config.limits.reject_rate, Refusal::Drop as u8);
        assert_eq!(config.all_ports, 1);
        assert_eq!(all.restart.pin_dir, PathBuf::from(defaults::PIN_DIR));
        assert_eq!(all.restart.http, defaults::HTTP);
        assert_eq!(all.admin_token, None);
        assert_eq!(all.check, CheckAccess::Closed);
        assert_eq!(all.restart.flow_table_size, defaults::FLOW_TABLE_SIZE);
        assert!(all.pinned.is_empty());
    }

    #[test]
    fn errors_name_the_setting() {
        for (flags, setting) in [
            (&["--ports", "70000"][..], "ports"),
            (&["--event-log", "jounald"][..], "event-log"),
            (&["--ports", "0"][..], "ports"),
            (&["--ipv4-prefix", "33"][..], "ipv4-prefix"),
            (&["--ipv6-prefix", "129"][..], "ipv6-prefix"),
            (&["--allow", "10.0.0.0/33"][..], "allow"),
            (&["--allow", "not-a-net"][..], "allow"),
            (&["--deny", "10.0.0.1/8"][..], "deny"),
            (&["--syn-rate", "5", "--syn-burst", "0"][..], "syn-burst"),
            (&["--conn-rate", "5", "--conn-burst", "0"][..], "conn-burst"),
            (&["--conn-rate", "2000000000"][..], "conn-rate"),
            (&["--flow-table-size", "0"][..], "flow-table-size"),
            (&["--allow-file", "/nonexistent/allow"][..], "allow-file"),
            (&["--deny-file", "/nonexistent/deny"][..], "deny-file"),
            (&["--syn-timeout", "0s"][..], "syn-timeout"),
            (&["--escalate-after", "0"][..], "escalate-after"),
            (
                &["--escalate-refused-for", "0s"][..],
                "escalate-refused-for",
            ),
            (
                &["--profile", "a:ports=5672", "--ports", "5672"][..],
                "profiles.a.ports",
            ),
            (
                &["--escalate-after", "3", "--escalate-factor", "0"][..],
                "escalate-factor",
            ),
            (
                &["--escalate-after", "3", "--escalate-max-ban", "5m"][..],
                "escalate-max-ban",
            ),
            (
                &["--escalate-after", "3", "--escalate-max-ban", "400d"][..],
                "escalate-max-ban",
            ),
            (
                &["--escalate-after", "3", "--escalate-memory", "0s"][..],
                "escalate-memory",
            ),
            (&["--broker-admin-token", " "][..], "broker.admin-token"),
            (&["--check-token", " "][..], "check-token"),
            (&["--check-token", "t", "--check-open"][..], "check-open"),
            (&["--redis", "http://x"][..], "cluster.redis"),
            (&["--redis", "redis+cluster://"][..], "cluster.redis"),
            (
                &["--redis", "redis://h", "--check-timeout", "0s"][..],
                "cluster.check-timeout",
            ),
            (
                &["--redis", "redis://h", "--check-timeout", "1h"][..],
                "cluster.check-timeout",
            ),
            (
                &["--redis", "redis://h", "--expected-replicas", "0"][..],
                "cluster.expected-replicas",
            ),
            (
                &["--redis", "redis://h", "--key-prefix", "a{b}"][..],
                "cluster.key-prefix",
            ),
            (
                &["--expected-replicas", "3"][..],
                "cluster.expected-replicas",
            ),
            (
                &["--redis", "redis://h", "--session-lease", "500ms"][..],
                "cluster.session-lease",
            ),
            (
                &["--redis", "redis://h", "--session-lease", "2h"][..],
                "cluster.session-lease",
            ),
            (
                &["--redis", "redis://h", "--session-lease", "1000500us"][..],
                "cluster.session-lease",
            ),
            (&["--session-lease", "10s"][..], "cluster.session-lease"),
        ] {
            let error = args(flags).resolve().unwrap_err();
            assert_eq!(error.setting, setting, "{flags:?}: {error}");
            assert!(error.to_string().contains(setting));
        }
    }

    #[test]
    fn lists_and_ports_reach_the_kernel_config() {
        let p = policy(&[
            "--ports",
            "5672,8883",
            "--allow",
            "10.1.0.0/16,::1",
            "--fail-closed",
        ])
        .unwrap();
        assert_eq!(p.ports, vec![5672, 8883]);
        let config = p.config();
        assert_eq!(config.all_ports, 0);
        assert_eq!(config.has_allow, 1);
        assert_eq!(config.has_deny, 0);
        assert_eq!(config.fail_closed, 1);
        assert_eq!(p.allow[1].to_string(), "::1/128");
        let mapped = policy(&["--deny", "::ffff:10.9.0.0/112"]).unwrap();
        assert_eq!(mapped.deny[0].to_string(), "10.9.0.0/16");
    }

    #[test]
    fn tunnels_are_dropped_unless_passed_by_flag_or_file() {
        assert_eq!(policy(&[]).unwrap().config().tunnels_pass, 0);
        assert_eq!(
            policy(&["--tunnels", "pass"])
                .unwrap()
                .config()
                .tunnels_pass,
            1
        );
        let file = with_file("tunnels = \"pass\"\n", &[]).unwrap();
        assert_eq!(file.policy.config().tunnels_pass, 1);
        let flag_wins = with_file("tunnels = \"pass\"\n", &["--tunnels", "drop"]).unwrap();
        assert_eq!(flag_wins.policy.config().tunnels_pass, 0);
        let mut argv = vec!["limiter", "--tunnels", "decapsulate"];
        let error = Wrapper::try_parse_from(argv.drain(..)).err().unwrap();
        assert!(error.to_string().contains("--tunnels"), "{error}");
    }

    fn with_file(text: &str, flags: &[&str]) -> Result<Settings, ConfigError> {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(text.as_bytes()).unwrap();
        let path = file.path().to_str().unwrap().to_owned();
        let mut all = vec!["--config", path.as_str()];
        all.extend_from_slice(flags);
        args(&all).resolve()
    }

    #[test]
    fn flags_win_over_the_file_and_the_file_over_defaults() {
        let s = with_file(
            "max-conn-per-ip = 7\nmax-conn-total = 70\nsyn-timeout = \"10s\"\nports = [5672]\n\n\
             [broker]\nsocket = \"/tmp/x.sock\"\nescalate-after = 4\nescalate-window = \"2m\"\n\n\
             [actions.login]\nlimit = 3\nwindow = \"1m\"\n\n[actions.auth]\nlimit = 7\nwindow = \"30s\"\n",
            &["--max-conn-per-ip", "9", "--escalate-after", "9", "--auth-limit", "3"],
        )
        .unwrap();
        let config = s.policy.config();
        assert_eq!(config.limits.max_conn_per_ip, 9);
        assert_eq!(config.limits.max_conn_total, 70);
        assert_eq!(s.policy.ports, vec![5672]);
        assert_eq!(s.sweep.syn_timeout, Duration::from_secs(10));
        assert_eq!(s.sweep.idle_timeout, None);
        assert_eq!(s.restart.broker_socket, PathBuf::from("/tmp/x.sock"));
        let escalation = s.broker.limiter.escalation.unwrap();
        assert_eq!(
            (escalation.after, escalation.window, escalation.ban),
            (Some(9), Duration::from_secs(120), defaults::ESCALATE_BAN)
        );
        assert_eq!(escalation.increment.factor, 1, "off unless set");
        let incremented = with_file(
            "[broker]\nescalate-after = 4\nescalate-factor = 3\nescalate-max-ban = \"2h\"\n\
             escalate-memory = \"12h\"\n",
            &[],
        )
        .unwrap();
        let increment = incremented.broker.limiter.escalation.unwrap().increment;
        assert_eq!(
            (increment.factor, increment.max_ban, increment.memory),
            (3, Duration::from_secs(7200), Duration::from_secs(43_200))
        );
        let actions = &s.broker.limiter.actions;
        assert!(actions.iter().any(|a| a.name == "login"));
        let auth = actions.iter().find(|a| a.name == "auth").unwrap();
        assert_eq!((auth.limit, auth.window), (3, Duration::from_secs(30)));
        let mut pinned = s.pinned.clone();
        pinned.sort();
        assert_eq!(
            pinned,
            ["actions.auth", "broker.escalate-after", "max-conn-per-ip"]
        );
    }

    #[test]
    fn a_redis_makes_a_fleet_whose_actions_are_shared_unless_said_otherwise() {
        let s = with_file(
            "[cluster]\nredis = \"redis+cluster://127.0.0.1:7000,127.0.0.1:7001\"\n\
             expected-replicas = 4\nsession-lease = \"5s\"\n\n[actions.publish]\nlimit = 5\nwindow = \"1s\"\nshared = false\n",
            &["--check-timeout", "20ms"],
        )
        .unwrap();
        let fleet = s.restart.fleet.unwrap();
        assert!(fleet.redis.is_cluster());
        assert_eq!(fleet.redis.nodes().len(), 2);
        assert_eq!(fleet.key_prefix, "limiter");
        assert_eq!(fleet.check_timeout, Duration::from_millis(20));
        assert_eq!(fleet.expected_replicas, 4);
        assert_eq!(fleet.session_lease, Duration::from_secs(5));
        let actions = &s.broker.limiter.actions;
        assert!(actions.iter().find(|a| a.name == "auth").unwrap().shared);
        assert!(!actions.iter().find(|a| a.name == "publish").unwrap().shared);
        assert_eq!(s.pinned, ["cluster.check-timeout"]);
        let plain = args(&[]).resolve().unwrap();
        assert!(plain.restart.fleet.is_none());
        assert!(plain.broker.limiter.actions.iter().all(|a| !a.shared));
        let error = with_file(
            "[cluster]\nredis = \"redis://h\"\nchek-timeout = \"1s\"\n",
            &[],
        )
        .unwrap_err();
        assert!(error.to_string().contains("chek-timeout"), "{error}");
    }

    #[test]
    fn a_reload_names_restart_only_changes_and_keeps_what_runs() {
        let start = with_file("pin-dir = \"/a\"\nmax-conn-per-ip = 5\n", &[]).unwrap();
        let same =
            start.reloaded(with_file("pin-dir = \"/a\"\nmax-conn-per-ip = 5\n", &[]).unwrap());
        assert!(
            same.restart_required.is_empty(),
            "{:?}",
            same.restart_required
        );

        let changed = start.reloaded(
            with_file(
                "pin-dir = \"/b\"\nmax-conn-per-ip = 7\n[broker]\nlisten = \"127.0.0.1:7070\"\n",
                &[],
            )
            .unwrap(),
        );
        assert_eq!(changed.restart_required, ["pin-dir", "broker.listen"]);
        assert_eq!(changed.restart, start.restart);
        assert_eq!(changed.serve().listen, None);
        assert_eq!(changed.policy.config().limits.max_conn_per_ip, 7);

        // Compared with what runs, not with the last file: changed back, nothing waits.
        let back = changed.reloaded(with_file("pin-dir = \"/a\"\n", &[]).unwrap());
        assert!(
            back.restart_required.is_empty(),
            "{:?}",
            back.restart_required
        );
    }

    #[test]
    fn restart_only_settings_go_by_the_names_operators_write() {
        let start = args(&[]).resolve().unwrap().restart;
        let other = args(&[
            "--iface=x",
            "--pin-dir=/x",
            "--http=127.0.0.1:1",
            "--flow-table-size=9",
            "--half-open-table-size=9",
            "--xdp-mode=skb",
            "--kernel-debug",
            "--allow-private-bpffs",
            "--socket=/x.sock",
            "--listen=7070",
            "--redis=redis://h",
            "--state-file=/x.json",
        ])
        .resolve()
        .unwrap()
        .restart;
        assert_eq!(
            start.differences(&other),
            [
                "iface",
                "pin-dir",
                "http",
                "flow-table-size",
                "half-open-table-size",
                "xdp-mode",
                "kernel-debug",
                "allow-private-bpffs",
                "broker.socket",
                "broker.listen",
                "cluster",
                "state-file",
            ]
        );
    }

    #[test]
    fn mode_is_read_at_the_top_and_per_action() {
        use crate::buckets::Enforcement;
        let s = with_file(
            "mode = \"monitor\"\n[actions.publish]\nlimit = 5\nwindow = \"1s\"\nmode = \"enforce\"\n",
            &[],
        )
        .unwrap();
        assert_eq!(s.broker.limiter.mode, Enforcement::Monitor);
        let publish = s
            .broker
            .limiter
            .actions
            .iter()
            .find(|a| a.name == "publish");
        assert_eq!(publish.unwrap().mode, Some(Enforcement::Enforce));
        assert_eq!(
            args(&["--mode", "monitor"])
                .resolve()
                .unwrap()
                .broker
                .limiter
                .mode,
            Enforcement::Monitor
        );
        assert_eq!(
            args(&[]).resolve().unwrap().broker.limiter.mode,
            Enforcement::Enforce
        );
        for text in [
            "mode = \"dry-run\"\n",
            "[actions.publish]\nmode = \"off\"\n",
        ] {
            let error = with_file(text, &[]).unwrap_err();
            assert!(error.to_string().contains("enforce"), "{text}: {error}");
        }
    }

    #[test]
    fn list_and_state_files_are_checked_by_the_resolve() {
        let error = with_file("state-file = \"\"\n", &[]).unwrap_err();
        assert_eq!(error.setting, "state-file", "{error}");
        let mut list = tempfile::NamedTempFile::new().unwrap();
        list.write_all(b"# ok\n10.0.0.0/8\n10.0.0.0/33\n").unwrap();
        let path = list.path().to_str().unwrap();
        let error = with_file(&format!("deny-file = {path:?}\n"), &[]).unwrap_err();
        assert_eq!(error.setting, "deny-file", "{error}");
        assert!(error.message.contains(":3:"), "{error}");
        list.as_file().set_len(0).unwrap();
        let s = with_file(&format!("allow-file = {path:?}\n"), &[]).unwrap();
        assert_eq!(s.lists.allow.unwrap().entries.len(), 0);
        assert_eq!(s.restart.state_file, PathBuf::from(defaults::STATE_FILE));
    }

    #[test]
    fn start_and_reload_reject_the_same_files() {
        // An action with a limit and no window is refused by the one resolve both use.
        let error = with_file("[actions.login]\nlimit = 3\n", &[]).unwrap_err();
        assert!(error.setting.starts_with("actions.login"), "{error}");
    }

    #[test]
    fn check_is_closed_unless_a_token_or_check_open_is_set() {
        let check = |text: &str, flags: &[&str]| with_file(text, flags).unwrap().check;
        assert_eq!(check("", &[]), CheckAccess::Closed);
        assert_eq!(check("check-open = false\n", &[]), CheckAccess::Closed);
        assert_eq!(check("check-open = true\n", &[]), CheckAccess::Open);
        assert_eq!(check("", &["--check-open"]), CheckAccess::Open);
        assert_eq!(
            check("check-token = \"t\"\n", &[]),
            CheckAccess::Token("t".into())
        );
        let error = with_file("check-token = \"t\"\ncheck-open = true\n", &[]).unwrap_err();
        assert_eq!(error.setting, "check-open", "{error}");
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
            ("tunnels = \"decapsulate\"\n", "tunnels"),
            ("max-conn-total = \n", "config"),
            ("[broker]\nsockett = \"/x\"\n", "sockett"),
        ] {
            let error = FileConfig::parse(text).unwrap_err();
            assert!(error.to_string().contains(needle), "{text:?}: {error}");
        }
    }
}

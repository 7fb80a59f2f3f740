//! `limiter run`: the one place that wires the layers together. It resolves the settings,
//! loads or adopts the datapath, builds the broker limiter, binds the listeners, attaches, and
//! serves until SIGTERM or SIGINT; SIGHUP reloads through the same resolve as the start.

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    process::ExitCode,
    sync::Arc,
    time::Duration,
};

use anyhow::Context;

use crate::{
    admission::Admission,
    buckets::{BanError, Banner, EscalationConfig, Limiter, MonotonicClock},
    datapath::{
        Datapath, EnforceError, Enforcer, KernelLogger, LoadOptions, default_route_interface, pins,
    },
    errors::error_chain,
    events,
    fleet::{FleetBans, FleetConfig, LogId, Redis, SharedGcra},
    protocol::{ServeControl, Server},
    services::{
        event_sink,
        fleet_bans::FleetBanning,
        http::HttpServer,
        list_watch::{self, ListPaths},
        saved_state,
        sweeper::{self, SweepStats, SweepTargets},
        syn_cookies, systemd_notify,
    },
    settings::{ConfigError, Live, RestartOnly, RunArgs, Settings},
};

/// Exit status for settings that cannot be used, before anything is attached.
pub const EXIT_CONFIG: u8 = 2;

/// Bans from the broker limiter's escalation and protocol go straight to the kernel map.
pub struct KernelBans(pub Arc<Enforcer>);

impl Banner for KernelBans {
    fn ban(&self, addr: IpAddr, ttl: Duration) -> Result<(), BanError> {
        self.0.ban(addr, ttl).map_err(|e| BanError::Failed {
            addr,
            source: Box::new(e),
        })
    }

    fn unban(&self, addr: IpAddr) -> Result<bool, BanError> {
        self.0.unban(addr).map_err(|e| BanError::Failed {
            addr,
            source: Box::new(e),
        })
    }
}

/// The longest a starting agent waits for the fleet's bans in force before it reports ready
/// without them (they are applied as soon as Redis answers).
const FLEET_BANS_WITHIN: Duration = Duration::from_secs(5);

/// The fleet's shared bans, written through `redis` (the agent's shared connection), and the
/// log reader's own connection (reading blocks it).
fn fleet_banning(
    fleet: &FleetConfig,
    redis: Redis,
    local: Arc<dyn Banner>,
    escalation: Option<EscalationConfig>,
) -> anyhow::Result<(FleetBanning, FleetBans)> {
    // Tells this agent's entries in the ban log apart from the others'.
    let origin = format!(
        "{}:{}",
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .unwrap_or_default()
            .trim(),
        std::process::id()
    );
    let bans = FleetBans::new(redis, &fleet.key_prefix, origin);
    let reader = bans
        .with_connection(Redis::connect(&fleet.redis).context("connecting to the fleet's Redis")?);
    Ok((FleetBanning::new(local, bans, escalation), reader))
}

/// Why a reload was refused. A kernel map that cannot be written is not the file's fault, so
/// it is not reported as a setting.
#[derive(Debug, thiserror::Error)]
enum ReloadError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("writing the kernel policy")]
    Policy(#[source] EnforceError),
    #[error("opening event-log")]
    EventLog(#[source] event_sink::SinkError),
}

/// The running agent as the signal handlers see it.
struct Agent {
    args: RunArgs,
    settings: Live,
    enforcer: Arc<Enforcer>,
    limiter: Arc<Limiter>,
    protocol: ServeControl,
    http_slots: Arc<Admission>,
    /// The list files the watcher watches.
    list_paths: tokio::sync::watch::Sender<ListPaths>,
}

impl Agent {
    /// Re-reads the configuration (SIGHUP) through the start's own resolve, and applies
    /// everything that can change live: the kernel limits, lists, refusal modes and ports, the
    /// sweeper's timeouts, the admin and check tokens and check-open, the actions (limits,
    /// windows, bursts, key caps; see [`Limiter::reconfigure`] for keys and new, removed or
    /// re-keyed actions), escalation, the listeners' caps and timeouts (timeouts for new
    /// connections), who is trusted with admin requests and the event log (reopened). What only a restart can change ([`RestartOnly`]) is
    /// named, in the log and in `/v1/status`, as waiting for a restart, and so are the
    /// settings flags or environment pin. A bad file changes nothing.
    fn reload(&self) -> Result<(), ReloadError> {
        let new = self.settings.get().reloaded(self.args.resolve()?);
        for what in &new.restart_required {
            tracing::warn!(setting = %what, "changed in the file; takes effect on restart");
        }
        if !new.pinned.is_empty() {
            tracing::info!(
                pinned = ?new.pinned,
                "set by flags or the environment, which the file cannot change"
            );
        }
        // First, so a sink that cannot be opened changes nothing; reopened even when unchanged:
        // logrotate's `postrotate` sends SIGHUP for a new file.
        event_sink::open(&new.event_log).map_err(ReloadError::EventLog)?;
        self.enforcer
            .set_policy(new.policy.clone())
            .map_err(ReloadError::Policy)?;
        list_watch::apply(&self.enforcer, &new.lists).map_err(ReloadError::Policy)?;
        self.list_paths.send_replace(ListPaths::of(&new.lists));
        let modes = self
            .settings
            .read(|old| old.broker.limiter.mode_changes(&new.broker.limiter));
        let changes = self.limiter.reconfigure(new.broker.limiter.clone());
        modes.iter().for_each(events::emit);
        if !changes.is_empty() {
            tracing::info!(
                changed = ?changes.changed,
                added = ?changes.added,
                removed = ?changes.removed,
                "actions reloaded; their keys keep their buckets"
            );
        }
        if !changes.rekeyed.is_empty() {
            tracing::warn!(
                actions = ?changes.rekeyed,
                "key kind changed: these actions' buckets start empty"
            );
        }
        self.protocol.apply(&new.serve());
        self.http_slots.resize(new.clients.max);
        self.settings.replace(new);
        tracing::info!("configuration reloaded");
        Ok(())
    }
}

/// Raises the soft limit on open files to the hard limit: the listeners' caps are sized so the
/// agent never runs out of descriptors, and the default soft limit (1024) is below them.
/// Returns the limit now in force.
pub fn raise_fd_limit() -> nix::Result<u64> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    Ok(hard)
}

/// Checks every setting before touching the kernel (exit 2 on a bad one), loads or adopts the
/// pinned datapath, attaches, then serves until SIGTERM or SIGINT. The programs stay attached
/// after it exits; `limiter detach` removes them.
pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let settings = match args.resolve() {
        Ok(settings) => settings,
        Err(error) => {
            tracing::error!("{error}");
            return Ok(ExitCode::from(EXIT_CONFIG));
        }
    };
    if let Err(error) = event_sink::open(&settings.event_log) {
        tracing::error!("event-log: {}", error_chain(&error));
        return Ok(ExitCode::from(EXIT_CONFIG));
    }
    warn_of_fd_limit(settings.clients.max);
    let ifaces = match preflight(&settings.restart)? {
        Ok(ifaces) => ifaces,
        Err(refused) => return Ok(refused),
    };
    let mut leftovers = Leftovers::before_start(&settings.restart.pin_dir, &ifaces);
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    let result = runtime.block_on(start(args, settings, ifaces, &mut leftovers));
    leftovers.clean_up();
    result
}

/// A full listener holds `max_clients` descriptors, and there are three of them.
fn warn_of_fd_limit(max_clients: u32) {
    match raise_fd_limit() {
        Ok(limit) => {
            let needed = 3 * u64::from(max_clients) + 256;
            if limit < needed {
                tracing::warn!(
                    limit,
                    needed,
                    "the open-file limit is below what three full listeners need; lower max-clients or raise the hard limit"
                );
            }
        }
        Err(error) => tracing::warn!(%error, "could not raise the open-file limit"),
    }
}

/// The interfaces to enforce on, once the host is fit for this start: they exist, the pin
/// directory is the host's bpffs (unless allowed otherwise), and no other agent enforces
/// through it. Checked before anything is created, so a refusal leaves nothing behind; it is
/// logged here and comes back as the exit status.
fn preflight(restart: &RestartOnly) -> anyhow::Result<Result<Vec<String>, ExitCode>> {
    let ifaces = if restart.ifaces.is_empty() {
        vec![default_route_interface()?]
    } else {
        restart.ifaces.clone()
    };
    for iface in &ifaces {
        if nix::net::if_::if_nametoindex(iface.as_str()).is_err() {
            tracing::error!(
                "{}",
                ConfigError::new("iface", format!("no interface is named {iface:?}"))
            );
            return Ok(Err(ExitCode::from(EXIT_CONFIG)));
        }
    }
    if !restart.allow_private_bpffs
        && let Err(error) = pins::refuse_private_bpffs(&restart.pin_dir)
    {
        tracing::error!("{error}");
        return Ok(Err(ExitCode::from(EXIT_CONFIG)));
    }
    if let Some(pid) = pins::live_agent(&restart.pin_dir) {
        tracing::error!(
            pid,
            pin_dir = %restart.pin_dir.display(),
            "another agent (pid {pid}) enforces through {}; this one leaves it alone and exits \
             (stop that agent first, or give this one its own --pin-dir and interfaces)",
            restart.pin_dir.display()
        );
        return Ok(Err(ExitCode::FAILURE));
    }
    Ok(Ok(ifaces))
}

/// What a start creates (the pin directory with its maps, links, the socket file, the pid
/// file), so that a start that fails removes it again and leaves the host as it found it.
struct Leftovers {
    pin_dir: PathBuf,
    /// The pin directory did not exist: everything in it is this start's.
    new_pins: bool,
    /// Interfaces without pinned links before this start.
    new_links: Vec<String>,
    socket: Option<PathBuf>,
    /// Set once the agent is up: from then on a stop leaves the enforcement in place.
    started: bool,
}

impl Leftovers {
    fn before_start(pin_dir: &Path, ifaces: &[String]) -> Self {
        Self {
            new_pins: !pins::maps(pin_dir).exists(),
            new_links: ifaces
                .iter()
                .filter(|i| !pins::links(pin_dir, i).exists())
                .cloned()
                .collect(),
            pin_dir: pin_dir.to_owned(),
            socket: None,
            started: false,
        }
    }

    fn clean_up(&self) {
        if self.started {
            pins::remove_pid_file(&self.pin_dir);
            return;
        }
        if let Some(socket) = &self.socket {
            let _ = std::fs::remove_file(socket);
        }
        let removed = if self.new_pins {
            pins::detach(&self.pin_dir, None).map(drop)
        } else {
            self.new_links
                .iter()
                .try_for_each(|iface| pins::unpin_links(&self.pin_dir, iface).map(drop))
        };
        match removed {
            Ok(()) => tracing::info!("the failed start left nothing behind"),
            Err(error) => {
                let error = anyhow::Error::from(error);
                tracing::warn!("removing what the failed start created: {error:#}");
            }
        }
    }
}

/// Attaching fails with `EEXIST` when a program is attached that this agent's pins do not
/// hold: another agent with its own pin directory, or another tool.
fn explain_attach(error: crate::datapath::LoadError, iface: &str, pin_dir: &Path) -> anyhow::Error {
    let error = anyhow::Error::from(error);
    let taken = error.chain().any(|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.raw_os_error() == Some(libc::EEXIST))
    });
    if taken {
        error.context(format!(
            "{iface} is already enforced by a program this agent's pins ({}) do not hold: another \
             agent with its own --pin-dir, or another tool; nothing was changed on {iface}",
            pin_dir.display()
        ))
    } else {
        error.context(format!("attaching to {iface}"))
    }
}

/// The start, phase by phase; each phase's failure stops it, and `leftovers` learns what each
/// created so that a failed start removes it.
async fn start(
    args: RunArgs,
    settings: Settings,
    ifaces: Vec<String>,
    leftovers: &mut Leftovers,
) -> anyhow::Result<ExitCode> {
    // The handlers are in place before anything is attached: a SIGTERM sent while the agent
    // starts, or on the word that it is ready, stops it cleanly rather than killing it with
    // the default action.
    let signals = Signals::install()?;
    let enforcer = load(&settings, load_options(&settings.restart))?;
    let kernel_bans: Arc<dyn Banner> = Arc::new(KernelBans(Arc::clone(&enforcer)));
    let Buckets {
        limiter,
        fleet_bans,
    } = fleet(&settings, kernel_bans).await?;
    let restart = settings.restart.clone();
    let settings = Live::new(settings);
    let sweep = SweepStats::new();
    let listeners = listeners(&settings, &enforcer, &limiter, &sweep, leftovers).await?;
    let follower = attach(&enforcer, &ifaces, &restart, fleet_bans, leftovers).await?;
    let (list_paths, _) = tokio::sync::watch::channel(settings.read(|s| ListPaths::of(&s.lists)));
    let agent = Agent {
        args,
        settings,
        enforcer,
        limiter,
        protocol: listeners.protocol.control(),
        http_slots: listeners.http.slots(),
        list_paths,
    };
    Ok(serve(agent, signals, listeners, sweep, ifaces, follower).await)
}

/// How `limiter run` loads the programs: the table sizes and debug log it was given, pinned
/// under its pin directory. The tests' in-process agents take these and leave out the pins.
pub fn load_options(restart: &RestartOnly) -> LoadOptions {
    LoadOptions {
        flow_table_size: restart.flow_table_size,
        half_open_size: restart.half_open_table_size,
        kernel_debug: restart.kernel_debug,
        pin_dir: Some(restart.pin_dir.clone()),
    }
}

/// Phase 1: the kernel programs loaded (or the pinned ones adopted), attached nowhere yet,
/// with the settings' policy, the list files and the state file's bans and entries in their
/// maps.
pub fn load(settings: &Settings, options: LoadOptions) -> anyhow::Result<Arc<Enforcer>> {
    let mut datapath = Datapath::load(options).context("loading the kernel programs")?;
    if let Some(logger) = datapath.take_logger() {
        tokio::spawn(forward_kernel_log(logger));
    }
    let enforcer = Arc::new(Enforcer::new(datapath, settings.policy.clone()));
    enforcer
        .set_policy(settings.policy.clone())
        .context("writing the settings to the kernel maps")?;
    list_watch::apply(&enforcer, &settings.lists)
        .context("writing allow-file and deny-file to the kernel maps")?;
    let state_file = &settings.restart.state_file;
    if let Some(state) = saved_state::load(state_file) {
        let restored = saved_state::restore(&enforcer, &state, std::time::SystemTime::now());
        tracing::info!(
            path = %state_file.display(),
            bans = restored.bans,
            expired = restored.expired,
            entries = restored.entries,
            "state restored"
        );
    }
    Ok(enforcer)
}

/// The broker limiter, and in a fleet the shared bans it bans through, not yet loaded.
pub struct Buckets {
    pub limiter: Arc<Limiter>,
    pub fleet_bans: Option<(FleetBanning, FleetBans)>,
}

/// Phase 2: the broker limiter, banning through the kernel; in a fleet its shared actions are
/// checked in Redis and its bans shared through it. Before the listeners, so that the first
/// broker to connect meets the limiter it will keep (a Redis that is away only delays this
/// phase a little; shared checks are decided locally until it answers). Bans go to
/// `kernel_bans` (the agent's [`KernelBans`]), in a fleet shared through Redis first.
pub async fn fleet(settings: &Settings, kernel_bans: Arc<dyn Banner>) -> anyhow::Result<Buckets> {
    let clock = Arc::new(MonotonicClock::new());
    let Some(fleet) = &settings.restart.fleet else {
        return Ok(Buckets {
            limiter: Arc::new(Limiter::new(
                settings.broker.limiter.clone(),
                clock,
                kernel_bans,
            )),
            fleet_bans: None,
        });
    };
    let gcra = SharedGcra::start(fleet)
        .await
        .context("setting up the fleet's Redis")?;
    tracing::info!(
        redis = %fleet.redis,
        expected_replicas = fleet.expected_replicas,
        check_timeout = ?fleet.check_timeout,
        "fleet mode: shared actions are checked in Redis"
    );
    let (banning, reader) = fleet_banning(
        fleet,
        gcra.redis().clone(),
        kernel_bans,
        settings.broker.limiter.escalation,
    )?;
    let limiter = Limiter::new(
        settings.broker.limiter.clone(),
        clock,
        banning.banner.clone(),
    )
    .shared_by(gcra);
    Ok(Buckets {
        limiter: Arc::new(limiter),
        fleet_bans: Some((banning, reader)),
    })
}

/// Both listeners, bound and not yet serving.
struct Listeners {
    protocol: Server,
    http: HttpServer,
}

/// Phase 3: both listeners bind before anything attaches: a taken port or socket stops the
/// agent here, with an error, rather than leaving it enforcing half-observable.
async fn listeners(
    settings: &Live,
    enforcer: &Arc<Enforcer>,
    limiter: &Arc<Limiter>,
    sweep: &SweepStats,
    leftovers: &mut Leftovers,
) -> anyhow::Result<Listeners> {
    let serve = settings.read(Settings::serve);
    let protocol = Server::bind(&serve, Arc::clone(limiter))
        .await
        .context("binding the broker protocol socket")?;
    leftovers.socket = Some(serve.socket);
    let http = HttpServer::bind(
        Arc::clone(enforcer),
        Arc::clone(limiter),
        settings.clone(),
        sweep,
    )
    .await
    .context("binding the HTTP listener")?;
    Ok(Listeners { protocol, http })
}

/// The fleet's ban log follower, and where it reads on from once the start loaded the bans
/// in force.
struct Follower {
    banning: FleetBanning,
    reader: FleetBans,
    from: Option<LogId>,
}

/// Phase 4: enforcing on every interface, then the fleet's bans in the kernel, then ready:
/// from here on a stop leaves the enforcement in place.
async fn attach(
    enforcer: &Enforcer,
    ifaces: &[String],
    restart: &RestartOnly,
    fleet_bans: Option<(FleetBanning, FleetBans)>,
    leftovers: &mut Leftovers,
) -> anyhow::Result<Option<Follower>> {
    for iface in ifaces {
        let how = enforcer
            .datapath()
            .attach(iface, restart.xdp_mode)
            .map_err(|e| explain_attach(e, iface, &restart.pin_dir))?;
        tracing::info!(iface, ?how, "enforcing");
    }
    // The fleet's bans are in the kernel before the agent says it is ready.
    let follower = match fleet_bans {
        Some((banning, reader)) => {
            let from = banning.load(FLEET_BANS_WITHIN).await;
            Some(Follower {
                banning,
                reader,
                from,
            })
        }
        None => None,
    };
    pins::write_pid_file(&restart.pin_dir).context("writing the pid file")?;
    leftovers.started = true;
    enforcer.set_ready();
    warn_of_stale_links(&restart.pin_dir, ifaces);
    Ok(follower)
}

/// Phase 5: the sweeper, both listeners and the fleet's ban follower run until SIGTERM or
/// SIGINT, and SIGHUP reloads; then each task is stopped and waited for.
async fn serve(
    agent: Agent,
    signals: Signals,
    listeners: Listeners,
    sweep: SweepStats,
    ifaces: Vec<String>,
    follower: Option<Follower>,
) -> ExitCode {
    let stop = tokio_util::sync::CancellationToken::new();
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(sweeper::run(
        SweepTargets {
            interfaces: ifaces,
            enforcer: Arc::clone(&agent.enforcer),
            limiter: Arc::clone(&agent.limiter),
            stats: sweep,
            settings: agent.settings.clone(),
        },
        stop.clone().cancelled_owned(),
    ));
    tasks.spawn(syn_cookies::run(
        Arc::clone(&agent.enforcer),
        stop.clone().cancelled_owned(),
    ));
    tasks.spawn(listeners.protocol.run(stop.clone().cancelled_owned()));
    tasks.spawn(saved_state::run(
        Arc::clone(&agent.enforcer),
        agent.settings.read(|s| s.restart.state_file.clone()),
        stop.clone(),
    ));
    tasks.spawn(list_watch::run(
        Arc::clone(&agent.enforcer),
        agent.list_paths.subscribe(),
        stop.clone(),
    ));
    if let Some(follower) = follower {
        tasks.spawn(
            follower
                .banning
                .run(follower.reader, follower.from, stop.clone()),
        );
    }
    let http = listeners.http;
    let http_stop = stop.clone().cancelled_owned();
    tasks.spawn(async move {
        if let Err(error) = http.run(http_stop).await {
            let error = anyhow::Error::from(error);
            tracing::error!("the HTTP listener failed: {error:#}");
        }
    });
    tasks.spawn(systemd_notify::watchdog(stop.clone().cancelled_owned()));
    // Both listeners were bound in phase 3 and now serve: a unit ordered after this one
    // (the broker) may start.
    systemd_notify::ready();
    tracing::info!("limiter is ready");
    signals.wait(&agent).await;
    systemd_notify::stopping();
    tracing::info!("stopping; the programs stay attached (limiter detach removes them)");
    stop.cancel();
    while tasks.join_next().await.is_some() {}
    ExitCode::SUCCESS
}

/// Links an earlier agent pinned for interfaces this one was not given keep enforcing (with
/// the shared maps); say so, since only `limiter detach` removes them.
fn warn_of_stale_links(pin_dir: &Path, ifaces: &[String]) {
    let Ok(entries) = std::fs::read_dir(pin_dir.join("links")) else {
        return;
    };
    for entry in entries.filter_map(Result::ok) {
        let iface = entry.file_name().to_string_lossy().into_owned();
        if !ifaces.contains(&iface) {
            tracing::warn!(
                iface,
                "still enforcing through links an earlier agent pinned; `limiter detach --iface {iface}` removes them"
            );
        }
    }
}

/// The signals the agent handles, registered once.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate()).context("handling SIGTERM")?,
            int: signal(SignalKind::interrupt()).context("handling SIGINT")?,
            hup: signal(SignalKind::hangup()).context("handling SIGHUP")?,
        })
    }

    /// Reloads on SIGHUP; returns on SIGTERM or SIGINT.
    async fn wait(mut self, agent: &Agent) {
        loop {
            tokio::select! {
                _ = self.term.recv() => return,
                _ = self.int.recv() => return,
                _ = self.hup.recv() => {
                    systemd_notify::reloading();
                    if let Err(error) = agent.reload() {
                        let error = error_chain(&error);
                        tracing::error!("reload refused, the old settings stay: {error}");
                    }
                    // Serving again, with the new settings or the old ones.
                    systemd_notify::ready();
                }
            }
        }
    }
}

/// Reads the kernel programs' aya-log ring buffer whenever it has records; they reach
/// `tracing` through the `log` bridge.
async fn forward_kernel_log(logger: KernelLogger) {
    // SAFETY: the ring buffer's fd is owned by `logger`, which the AsyncFd owns from here on,
    // so the fd outlives its registration.
    let registered = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE)
    };
    let mut fd = match registered {
        Ok(fd) => fd,
        Err(error) => {
            tracing::warn!(%error, "kernel log not forwarded");
            return;
        }
    };
    loop {
        let Ok(mut guard) = fd.readable_mut().await else {
            return;
        };
        guard.get_inner_mut().flush();
        guard.clear_ready();
    }
}

//! The running agent: one loaded datapath shared by its tasks (the sweeper, the HTTP listener,
//! the broker protocol, the signal handlers), and the settings it enforces.

use std::{
    net::IpAddr,
    path::PathBuf,
    sync::{
        Arc, Mutex, MutexGuard, RwLock,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use ipnet::IpNet;
use thiserror::Error;

use crate::{
    buckets::{BanError, Banner, Limiter},
    config::{ConfigError, FileConfig, Layer, Settings},
    loader::{Datapath, LoadError},
    maps::{Maps, MapsError},
    sweeper::SweepStats,
};

#[derive(Debug, Error)]
pub enum AgentError {
    #[error(transparent)]
    Maps(#[from] MapsError),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("{0} comes from the configuration; change it there")]
    Configured(IpNet),
}

/// Which source list an admin change is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListKind {
    Allow,
    Deny,
}

/// List entries added through the admin API, kept on top of the configuration's until the
/// agent restarts (entries meant to last belong in the configuration file).
#[derive(Default)]
struct Extra {
    allow: Vec<IpNet>,
    deny: Vec<IpNet>,
}

pub struct Agent {
    datapath: Arc<Mutex<Datapath>>,
    settings: RwLock<Settings>,
    extra: Mutex<Extra>,
    /// The command line's layer, which wins over the file on every reload.
    args: Layer,
    config_path: Option<PathBuf>,
    pub sweep: SweepStats,
    pub limiter: Arc<Limiter>,
    ready: AtomicBool,
}

impl Agent {
    pub fn new(
        datapath: Arc<Mutex<Datapath>>,
        settings: Settings,
        args: Layer,
        config_path: Option<PathBuf>,
        limiter: Arc<Limiter>,
    ) -> Self {
        Self {
            datapath,
            settings: RwLock::new(settings),
            extra: Mutex::new(Extra::default()),
            args,
            config_path,
            sweep: SweepStats::new(),
            limiter,
            ready: AtomicBool::new(false),
        }
    }

    pub fn settings(&self) -> Settings {
        self.settings.read().expect("settings lock").clone()
    }

    /// The datapath, locked. Every map operation is a short syscall; hold it briefly and never
    /// across an `.await`.
    pub fn datapath(&self) -> MutexGuard<'_, Datapath> {
        self.datapath.lock().expect("datapath lock")
    }

    pub fn with_maps<T>(&self, f: impl FnOnce(&mut Maps) -> T) -> T {
        f(&mut self.datapath().maps)
    }

    /// Programs attached and the maps answering.
    pub fn ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed) && self.with_maps(|m| m.config().is_ok())
    }

    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Relaxed);
    }

    pub fn ban(&self, addr: IpAddr, ttl: Duration) -> Result<(), AgentError> {
        self.with_maps(|m| m.ban(addr, ttl))?;
        tracing::info!(%addr, ?ttl, "banned");
        Ok(())
    }

    pub fn unban(&self, addr: IpAddr) -> Result<bool, AgentError> {
        let lifted = self.with_maps(|m| m.unban(addr))?;
        tracing::info!(%addr, lifted, "unbanned");
        Ok(lifted)
    }

    /// The lists in force: the configuration's and the admin API's.
    pub fn lists(&self) -> (Vec<IpNet>, Vec<IpNet>) {
        let kernel = self.effective_kernel();
        (kernel.allow, kernel.deny)
    }

    /// Adds a list entry; false if it was already there.
    pub fn list_add(&self, kind: ListKind, net: IpNet) -> Result<bool, AgentError> {
        let net = net.trunc();
        let (allow, deny) = self.lists();
        let present = match kind {
            ListKind::Allow => allow.contains(&net),
            ListKind::Deny => deny.contains(&net),
        };
        if present {
            return Ok(false);
        }
        {
            let mut extra = self.extra.lock().expect("lists lock");
            match kind {
                ListKind::Allow => extra.allow.push(net),
                ListKind::Deny => extra.deny.push(net),
            }
        }
        self.apply_kernel()?;
        Ok(true)
    }

    /// Removes an entry the admin API added; false if there was none, an error if the entry
    /// comes from the configuration.
    pub fn list_del(&self, kind: ListKind, net: IpNet) -> Result<bool, AgentError> {
        let net = net.trunc();
        let configured = {
            let settings = self.settings.read().expect("settings lock");
            match kind {
                ListKind::Allow => settings.kernel.allow.contains(&net),
                ListKind::Deny => settings.kernel.deny.contains(&net),
            }
        };
        if configured {
            return Err(AgentError::Configured(net));
        }
        let removed = {
            let mut extra = self.extra.lock().expect("lists lock");
            let list = match kind {
                ListKind::Allow => &mut extra.allow,
                ListKind::Deny => &mut extra.deny,
            };
            let before = list.len();
            list.retain(|n| *n != net);
            before != list.len()
        };
        if removed {
            self.apply_kernel()?;
        }
        Ok(removed)
    }

    fn effective_kernel(&self) -> crate::config::KernelSettings {
        let settings = self.settings.read().expect("settings lock");
        let extra = self.extra.lock().expect("lists lock");
        settings.kernel.with_lists(&extra.allow, &extra.deny)
    }

    /// Writes the settings in force to the kernel maps.
    pub fn apply_kernel(&self) -> Result<(), AgentError> {
        let kernel = self.effective_kernel();
        self.with_maps(|m| m.apply(&kernel))?;
        Ok(())
    }

    /// Re-reads the configuration file (SIGHUP) and applies what can change live: limits,
    /// lists, refusal modes, ports, timeouts and the admin token. A bad file changes nothing.
    pub fn reload(&self) -> Result<(), ConfigError> {
        let file = match &self.config_path {
            Some(path) => FileConfig::read(path)?,
            None => FileConfig::default(),
        };
        let new = self.args.clone().over(file.layer).resolve()?;
        {
            let mut settings = self.settings.write().expect("settings lock");
            for (what, changed) in [
                ("iface", new.ifaces != settings.ifaces),
                ("pin-dir", new.pin_dir != settings.pin_dir),
                ("http", new.http != settings.http),
                (
                    "flow-table-size",
                    new.kernel.flow_table_size != settings.kernel.flow_table_size,
                ),
                ("xdp-mode", new.xdp_mode != settings.xdp_mode),
                ("kernel-debug", new.kernel_debug != settings.kernel_debug),
            ] {
                if changed {
                    tracing::warn!(
                        setting = what,
                        "changed in the file; takes effect on restart"
                    );
                }
            }
            settings.kernel = new.kernel;
            settings.sweep = new.sweep;
            settings.admin_token = new.admin_token;
        }
        self.apply_kernel()
            .map_err(|e| ConfigError::new("config", e))?;
        tracing::info!("configuration reloaded");
        Ok(())
    }
}

/// Bans from the broker limiter's escalation and protocol go straight to the kernel map.
pub struct KernelBans(pub Arc<Mutex<Datapath>>);

impl Banner for KernelBans {
    fn ban(&self, addr: IpAddr, ttl: Duration) -> Result<(), BanError> {
        let mut dp = self.0.lock().expect("datapath lock");
        dp.maps
            .ban(addr, ttl)
            .map(drop)
            .map_err(|e| BanError::Failed {
                addr,
                reason: e.to_string(),
            })
    }

    fn unban(&self, addr: IpAddr) -> Result<(), BanError> {
        let mut dp = self.0.lock().expect("datapath lock");
        dp.maps.unban(addr).map(drop).map_err(|e| BanError::Failed {
            addr,
            reason: e.to_string(),
        })
    }
}

/// `limiter run`: checks every setting before touching the kernel (exit 2 on a bad one), loads
/// or adopts the pinned datapath, attaches, then serves until SIGTERM or SIGINT. The programs
/// stay attached after it exits; `limiter detach` removes them.
pub fn run(args: crate::cli::RunArgs) -> anyhow::Result<std::process::ExitCode> {
    use anyhow::Context;

    let resolved = (|| -> Result<_, ConfigError> {
        let file = match &args.config {
            Some(path) => FileConfig::read(path)?,
            None => FileConfig::default(),
        };
        let settings = args.layer.clone().over(file.layer).resolve()?;
        let app = args.app.clone().over(&file.broker);
        let limiter = app.limiter_config(&file.actions)?;
        Ok((settings, limiter, app.serve_config()))
    })();
    let (settings, limiter_config, serve_config) = match resolved {
        Ok(resolved) => resolved,
        Err(error) => {
            tracing::error!("{error}");
            return Ok(std::process::ExitCode::from(crate::cli::EXIT_CONFIG));
        }
    };
    let ifaces = if settings.ifaces.is_empty() {
        vec![crate::loader::default_route_interface()?]
    } else {
        settings.ifaces.clone()
    };
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    runtime.block_on(async move {
        let mut datapath = Datapath::load(crate::loader::LoadOptions {
            flow_table_size: settings.kernel.flow_table_size,
            kernel_debug: settings.kernel_debug,
            pin_dir: Some(settings.pin_dir.clone()),
            ..crate::loader::LoadOptions::default()
        })
        .context("loading the kernel programs")?;
        if let Some(logger) = datapath.take_logger() {
            tokio::spawn(forward_kernel_log(logger));
        }
        let datapath = Arc::new(Mutex::new(datapath));
        let limiter = Arc::new(Limiter::new(
            limiter_config,
            Arc::new(crate::buckets::MonotonicClock::new()),
            Arc::new(KernelBans(Arc::clone(&datapath))),
        ));
        let mode = settings.xdp_mode;
        let agent = Arc::new(Agent::new(
            datapath,
            settings,
            args.layer,
            args.config,
            limiter,
        ));
        agent
            .apply_kernel()
            .context("writing the settings to the kernel maps")?;
        // Both listeners bind before anything attaches: a taken port or socket stops the agent
        // here, with an error, rather than leaving it enforcing half-observable.
        let protocol = crate::protocol::Server::bind(&serve_config, Arc::clone(&agent.limiter))
            .await
            .context("binding the broker protocol socket")?;
        let http = crate::http::HttpServer::bind(Arc::clone(&agent))
            .await
            .context("binding the HTTP listener")?;
        for iface in &ifaces {
            let how = agent
                .datapath()
                .attach(iface, mode)
                .with_context(|| format!("attaching to {iface}"))?;
            tracing::info!(iface, ?how, "enforcing");
        }
        agent.set_ready();
        warn_of_stale_links(&agent.settings().pin_dir, &ifaces);

        let stop = tokio_util::sync::CancellationToken::new();
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(crate::sweeper::run(
            Arc::clone(&agent),
            stop.clone().cancelled_owned(),
        ));
        tasks.spawn(protocol.run(stop.clone().cancelled_owned()));
        {
            let stop = stop.clone();
            tasks.spawn(async move {
                if let Err(error) = http.run(stop.cancelled_owned()).await {
                    let error = anyhow::Error::from(error);
                    tracing::error!("the HTTP listener failed: {error:#}");
                }
            });
        }
        tracing::info!("limiter is ready");
        wait_for_signals(&agent).await?;
        tracing::info!("stopping; the programs stay attached (limiter detach removes them)");
        stop.cancel();
        while tasks.join_next().await.is_some() {}
        Ok(std::process::ExitCode::SUCCESS)
    })
}

/// Links an earlier agent pinned for interfaces this one was not given keep enforcing (with
/// the shared maps); say so, since only `limiter detach` removes them.
fn warn_of_stale_links(pin_dir: &std::path::Path, ifaces: &[String]) {
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

/// Reloads on SIGHUP; returns on SIGTERM or SIGINT.
async fn wait_for_signals(agent: &Agent) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    loop {
        tokio::select! {
            _ = term.recv() => return Ok(()),
            _ = int.recv() => return Ok(()),
            _ = hup.recv() => {
                if let Err(error) = agent.reload() {
                    tracing::error!("reload refused, the old settings stay: {error}");
                }
            }
        }
    }
}

/// Reads the kernel programs' aya-log ring buffer whenever it has records; they reach
/// `tracing` through the `log` bridge.
async fn forward_kernel_log(logger: crate::loader::KernelLogger) {
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

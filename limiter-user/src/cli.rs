//! The `limiter` command line: one subcommand per thing an operator does.

use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

use crate::{
    config::{ConfigError, KernelArgs},
    loader::{Datapath, LoadOptions},
};

/// Exit status for settings that cannot be used, before anything is attached.
pub const EXIT_CONFIG: u8 = 2;

#[derive(Parser)]
#[command(
    name = "limiter",
    version,
    about = "Kernel-level connection limiter for a message broker host"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Load the kernel programs, attach them and enforce until stopped.
    Run(RunArgs),
    /// Ask the running agent for one verdict: exit 0 allowed, 1 refused, 2 could not ask.
    Check(crate::protocol::check_command::CheckArgs),
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub kernel: KernelArgs,
}

impl Cli {
    pub fn execute(self) -> Result<ExitCode> {
        match self.command {
            Command::Run(args) => run(args),
            Command::Check(args) => args.execute(),
        }
    }
}

pub fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("LIMITER_LOG").unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
}

fn run(args: RunArgs) -> Result<ExitCode> {
    let settings = match args.kernel.settings() {
        Ok(settings) => settings,
        Err(error) => return Ok(config_error(&error)),
    };
    let ifaces = if args.kernel.iface.is_empty() {
        vec![crate::loader::default_route_interface()?]
    } else {
        args.kernel.iface.clone()
    };
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    runtime.block_on(async move {
        let mut datapath = Datapath::load(LoadOptions {
            flow_table_size: settings.flow_table_size,
            kernel_debug: args.kernel.kernel_debug,
        })?;
        datapath.maps.apply(&settings)?;
        if let Some(logger) = datapath.take_logger() {
            tokio::spawn(forward_kernel_log(logger));
        }
        for iface in &ifaces {
            let mode = datapath.attach(iface, args.kernel.xdp_mode.into())?;
            tracing::info!(iface, ?mode, "attached");
        }
        shutdown_signal().await?;
        tracing::info!("stopping: detaching the programs");
        drop(datapath);
        Ok(ExitCode::SUCCESS)
    })
}

fn config_error(error: &ConfigError) -> ExitCode {
    tracing::error!("{error}");
    ExitCode::from(EXIT_CONFIG)
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

async fn shutdown_signal() -> Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    Ok(())
}

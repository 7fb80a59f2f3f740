//! The `limiter` command line: one subcommand per thing an operator does.

use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use tracing_subscriber::EnvFilter;

use crate::loader::{Datapath, XdpAttachMode};

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
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Interface to protect (repeatable); default: the interface of the default route.
    #[arg(long, env = "LIMITER_IFACE", value_delimiter = ',')]
    pub iface: Vec<String>,
    /// How XDP attaches: `native` needs driver support, `skb` works everywhere, `auto` tries
    /// native first.
    #[arg(long, env = "LIMITER_XDP_MODE", value_enum, default_value_t = XdpModeArg::Auto)]
    pub xdp_mode: XdpModeArg,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
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

impl Cli {
    pub fn execute(self) -> Result<ExitCode> {
        match self.command {
            Command::Run(args) => run(args),
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
    let ifaces = if args.iface.is_empty() {
        vec![crate::loader::default_route_interface()?]
    } else {
        args.iface
    };
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    runtime.block_on(async move {
        let mut datapath = Datapath::load()?;
        for iface in &ifaces {
            let mode = datapath.attach(iface, args.xdp_mode.into())?;
            tracing::info!(iface, ?mode, "attached");
        }
        shutdown_signal().await?;
        tracing::info!("stopping: detaching the programs");
        drop(datapath);
        Ok(ExitCode::SUCCESS)
    })
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

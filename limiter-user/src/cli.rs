//! The `limiter` command line: one subcommand per thing an operator does.

use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

use crate::{
    api::ListKind,
    ops,
    settings::{RunArgs, defaults},
};

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
    /// Load the kernel programs, attach them and enforce until stopped (they stay attached).
    Run(Box<RunArgs>),
    /// Remove the programs, links and pins (from one interface, or from all).
    Detach(DetachArgs),
    /// Ask the running agent for one verdict: exit 0 allowed, 1 refused, 2 could not ask.
    Check(crate::protocol::check_command::CheckArgs),
    /// Show the running agent's state (or, when none answers, the pinned maps').
    Status(ops::StatusArgs),
    /// Show the sources with the most connections and the most refusals.
    Top(ops::TopArgs),
    /// Ban an address for a while (needs the admin token).
    Ban(ops::BanArgs),
    /// Lift a ban (needs the admin token).
    Unban(ops::UnbanArgs),
    /// Add or remove an allowlist entry (needs the admin token).
    Allow(ops::ListArgs),
    /// Add or remove a denylist entry (needs the admin token).
    Deny(ops::ListArgs),
    /// Show the event log (bans, disconnects, switches), following it as the agent writes.
    Events(ops::EventsArgs),
}

#[derive(clap::Args, Debug)]
pub struct DetachArgs {
    /// Only this interface; default: every interface limiter is attached to.
    #[arg(long)]
    pub iface: Option<String>,
    /// The agent's pin directory.
    #[arg(long, env = "LIMITER_PIN_DIR", default_value = defaults::PIN_DIR)]
    pub pin_dir: std::path::PathBuf,
}

impl Cli {
    pub fn execute(self) -> Result<ExitCode> {
        match self.command {
            Command::Run(args) => crate::run::run(*args),
            Command::Detach(args) => detach(&args),
            Command::Check(args) => args.execute(),
            Command::Status(args) => args.execute(),
            Command::Top(args) => args.execute(),
            Command::Ban(args) => args.execute(),
            Command::Unban(args) => args.execute(),
            Command::Allow(args) => args.execute(ListKind::Allow),
            Command::Deny(args) => args.execute(ListKind::Deny),
            Command::Events(args) => args.execute(),
        }
    }
}

/// The ordinary log on stderr (`LIMITER_LOG`, default `info`), and the event log's sink,
/// which `limiter run` points where `event-log` says.
pub fn init_tracing() {
    crate::services::event_sink::init(
        EnvFilter::try_from_env("LIMITER_LOG").unwrap_or_else(|_| EnvFilter::new("info")),
    );
}

fn detach(args: &DetachArgs) -> Result<ExitCode> {
    let detached = crate::datapath::detach(&args.pin_dir, args.iface.as_deref())
        .with_context(|| format!("detaching under {}", args.pin_dir.display()))?;
    if detached.is_empty() {
        println!(
            "limiter is not attached (nothing pinned under {})",
            args.pin_dir.display()
        );
    }
    for iface in detached {
        println!("detached from {iface}");
    }
    Ok(ExitCode::SUCCESS)
}

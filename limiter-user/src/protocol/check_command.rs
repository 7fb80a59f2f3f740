//! `limiter check`: one check from a shell, for operators and scripts. The exit status is the
//! answer (0 allowed, 1 refused), so `limiter check auth "$ip" && …` reads naturally; failing
//! to ask at all is 2, so a script can tell "refused" from "could not reach the limiter".

use std::{net::SocketAddr, path::PathBuf, process::ExitCode};

use anyhow::{Context, Result};
use limiter_client::{Client, NEVER_MS, Verdict};

use crate::command_runtime::command_runtime;

#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// The action to check, e.g. `auth`.
    pub action: String,
    /// The key: an address, a session token, a user name, depending on the action.
    pub key: String,
    /// Tokens this request costs.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub cost: u32,
    /// Report what a check would answer without spending anything.
    #[arg(long)]
    pub peek: bool,
    /// The agent's Unix socket.
    #[arg(long, env = "LIMITER_SOCKET", default_value = crate::settings::defaults::SOCKET)]
    pub socket: PathBuf,
    /// Ask over TCP at this address instead of the Unix socket.
    #[arg(long)]
    pub tcp: Option<SocketAddr>,
}

impl CheckArgs {
    pub fn execute(self) -> Result<ExitCode> {
        let runtime = command_runtime()?;
        match runtime.block_on(self.ask()) {
            Ok(verdict) => {
                println!("{}", render(&verdict));
                Ok(ExitCode::from(if verdict.allowed { 0 } else { 1 }))
            }
            Err(error) => {
                eprintln!("limiter check: {error:#}");
                Ok(ExitCode::from(2))
            }
        }
    }

    async fn ask(&self) -> Result<Verdict> {
        let client = match self.tcp {
            Some(addr) => Client::connect_tcp(addr).await?,
            None => Client::connect_unix(&self.socket).await?,
        };
        let verdict = if self.peek {
            client.peek(&self.action, &self.key, self.cost).await
        } else {
            client.check(&self.action, &self.key, self.cost).await
        };
        verdict.with_context(|| format!("checking {} for {:?}", self.action, self.key))
    }
}

fn render(v: &Verdict) -> String {
    let ms = |ms: u64| {
        if ms == NEVER_MS {
            "never".to_owned()
        } else {
            ms.to_string()
        }
    };
    format!(
        "{} remaining={} limit={} retry_after_ms={} reset_after_ms={}",
        v.outcome.as_str(),
        v.remaining,
        v.limit,
        ms(v.retry_after_ms),
        ms(v.reset_after_ms)
    )
}

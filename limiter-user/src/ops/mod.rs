//! The operator commands: `limiter status`, `top`, `ban`, `unban`, `allow` and `deny`. They
//! talk to a running agent over its HTTP listener; `status` and `top` read the pinned maps
//! instead when no agent answers, since enforcement outlives the agent. `limiter events`
//! reads the event log the agent writes.

mod events_command;
mod remote;
mod render;

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    process::ExitCode,
    time::Duration,
};

use anyhow::{Context, Result, anyhow};
use reqwest::Method;
use serde::Serialize;

pub use events_command::EventsArgs;
use remote::{AskError, Remote, open_pinned, root_cause};
pub use render::{render_status, render_top};

use crate::{
    api::{
        BanAnswer, BanRequest, Connections, ListAnswer, ListKind, ListRequest, RateLimits, Status,
    },
    command_runtime::command_runtime,
    datapath::kernel_keys::{key_text, source_key},
    duration_units::duration_ms,
    services::view_builder::{connections_view, kernel_rate_limits, kernel_status},
    settings::defaults,
};

/// How to reach the agent.
#[derive(clap::Args, Clone, Debug)]
pub struct Connect {
    /// The agent's HTTP listener.
    #[arg(long, env = "LIMITER_HTTP", default_value_t = defaults::HTTP)]
    pub http: SocketAddr,
    /// How long to wait for the agent's answer.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

/// How to reach the agent's admin endpoints.
#[derive(clap::Args, Clone, Debug)]
pub struct AdminConnect {
    #[command(flatten)]
    pub connect: Connect,
    /// The agent's admin bearer token.
    #[arg(long, env = "LIMITER_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
}

/// Where `status` and `top` look when no agent answers.
#[derive(clap::Args, Clone, Debug)]
pub struct Fallback {
    /// The pin directory read when no agent answers.
    #[arg(long, env = "LIMITER_PIN_DIR", default_value = defaults::PIN_DIR)]
    pub pin_dir: PathBuf,
    /// Print the JSON the agent serves instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args, Clone, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    pub connect: Connect,
    #[command(flatten)]
    pub fallback: Fallback,
}

#[derive(clap::Args, Clone, Debug)]
pub struct TopArgs {
    #[command(flatten)]
    pub connect: Connect,
    #[command(flatten)]
    pub fallback: Fallback,
    /// Entries per list.
    #[arg(long, short = 'n', default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    pub limit: u32,
}

#[derive(clap::Args, Clone, Debug)]
pub struct BanArgs {
    /// The address to ban (its source key, masked to the configured prefix, is banned).
    pub addr: IpAddr,
    /// How long the ban lasts, e.g. `10m` or `2h` (1s to 366d).
    #[arg(long, value_parser = crate::api::parse_ban_ttl)]
    pub ttl: Duration,
    #[command(flatten)]
    pub admin: AdminConnect,
    /// The pin directory written when no agent answers: bans live in the kernel, so they
    /// apply at once and a later agent keeps them.
    #[arg(long, env = "LIMITER_PIN_DIR", default_value = defaults::PIN_DIR)]
    pub pin_dir: PathBuf,
}

#[derive(clap::Args, Clone, Debug)]
pub struct UnbanArgs {
    pub addr: IpAddr,
    #[command(flatten)]
    pub admin: AdminConnect,
    /// The pin directory written when no agent answers.
    #[arg(long, env = "LIMITER_PIN_DIR", default_value = defaults::PIN_DIR)]
    pub pin_dir: PathBuf,
}

#[derive(clap::Args, Clone, Debug)]
pub struct ListArgs {
    #[command(subcommand)]
    pub change: ListChange,
}

#[derive(clap::Subcommand, Clone, Debug)]
pub enum ListChange {
    /// Add an entry (until the agent restarts; lasting entries belong in the configuration).
    Add(ListEntry),
    /// Remove an entry added through the agent.
    Del(ListEntry),
}

#[derive(clap::Args, Clone, Debug)]
pub struct ListEntry {
    /// A CIDR such as `10.1.0.0/16` or `2001:db8::/48`; a bare address is one host.
    pub cidr: String,
    #[command(flatten)]
    pub admin: AdminConnect,
}

/// What `limiter top` shows, as JSON with `--json`.
#[derive(Serialize)]
struct Top {
    connections: Connections,
    rate_limits: RateLimits,
}

fn print(text: &str) -> ExitCode {
    print!("{text}");
    ExitCode::SUCCESS
}

fn to_json(value: &impl Serialize) -> Result<String> {
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    Ok(text)
}

impl StatusArgs {
    pub fn execute(&self) -> Result<ExitCode> {
        self.output().map(|text| print(&text))
    }

    /// What `limiter status` prints.
    pub fn output(&self) -> Result<String> {
        let status = command_runtime()?.block_on(self.fetch())?;
        if self.fallback.json {
            return to_json(&status);
        }
        Ok(render_status(&status, self.connect.http))
    }

    async fn fetch(&self) -> Result<Status> {
        let remote = Remote::new(&self.connect, None)?;
        match remote.get(&["v1", "status"], &[]).await {
            Ok(status) => Ok(status),
            Err(AskError::Unreachable(why)) => {
                let maps = open_pinned(&self.fallback.pin_dir, self.connect.http, &why)?;
                kernel_status(&maps).context("reading the pinned maps")
            }
            Err(AskError::Failed(e)) => Err(e),
        }
    }
}

impl TopArgs {
    pub fn execute(&self) -> Result<ExitCode> {
        self.output().map(|text| print(&text))
    }

    /// What `limiter top` prints.
    pub fn output(&self) -> Result<String> {
        let (connections, rate_limits) = command_runtime()?.block_on(self.fetch())?;
        if self.fallback.json {
            return to_json(&Top {
                connections,
                rate_limits,
            });
        }
        Ok(render_top(&connections, &rate_limits))
    }

    async fn fetch(&self) -> Result<(Connections, RateLimits)> {
        let remote = Remote::new(&self.connect, None)?;
        let limit = [("limit", self.limit.to_string())];
        let connections = match remote.get(&["connections"], &limit).await {
            Ok(connections) => connections,
            Err(AskError::Unreachable(why)) => {
                let maps = open_pinned(&self.fallback.pin_dir, self.connect.http, &why)?;
                let n = self.limit as usize;
                let connections = connections_view(&maps, n).context("reading the pinned maps")?;
                let kernel = kernel_rate_limits(&maps, n).context("reading the pinned maps")?;
                return Ok((
                    connections,
                    RateLimits {
                        enabled: kernel.limits.enabled(),
                        kernel,
                        broker: None,
                    },
                ));
            }
            Err(AskError::Failed(e)) => return Err(e),
        };
        let rate_limits = remote.get(&["rate_limits"], &limit).await?;
        Ok((connections, rate_limits))
    }
}

/// `limiter top` as text.
impl BanArgs {
    pub fn execute(&self) -> Result<ExitCode> {
        self.output().map(|text| print(&text))
    }

    pub fn output(&self) -> Result<String> {
        let remote = Remote::new(&self.admin.connect, self.admin.admin_token.clone())?;
        let request = BanRequest {
            addr: self.addr.to_string(),
            ttl: humantime::format_duration(self.ttl).to_string(),
        };
        let asked = command_runtime()?.block_on(remote.ask(
            Method::POST,
            remote.url(&["v1", "bans"]),
            &[],
            Some(&request),
        ));
        let answer: BanAnswer = match asked {
            Ok(answer) => answer,
            Err(AskError::Unreachable(why)) => {
                let mut maps = open_pinned(&self.pin_dir, self.admin.connect.http, &why)?;
                let config = maps.config().context("reading the pinned maps")?;
                let source = maps
                    .ban(self.addr, self.ttl)
                    .context("banning in the pinned maps")?;
                BanAnswer {
                    addr: self.addr.to_string(),
                    source: key_text(&source, &config),
                    ttl_ms: Some(duration_ms(self.ttl)),
                    lifted: None,
                }
            }
            Err(AskError::Failed(e)) => return Err(e),
        };
        Ok(format!(
            "banned {} (source {}) for {}\n",
            answer.addr, answer.source, request.ttl
        ))
    }
}

impl UnbanArgs {
    pub fn execute(&self) -> Result<ExitCode> {
        self.output().map(|text| print(&text))
    }

    pub fn output(&self) -> Result<String> {
        let remote = Remote::new(&self.admin.connect, self.admin.admin_token.clone())?;
        let addr = self.addr.to_string();
        let asked = command_runtime()?.block_on(remote.ask(
            Method::DELETE,
            remote.url(&["v1", "bans", &addr]),
            &[],
            None::<&()>,
        ));
        let answer: BanAnswer = match asked {
            Ok(answer) => answer,
            Err(AskError::Unreachable(why)) => {
                let mut maps = open_pinned(&self.pin_dir, self.admin.connect.http, &why)?;
                let config = maps.config().context("reading the pinned maps")?;
                let lifted = maps
                    .unban(self.addr)
                    .context("unbanning in the pinned maps")?;
                BanAnswer {
                    addr,
                    source: key_text(&source_key(self.addr, &config), &config),
                    ttl_ms: None,
                    lifted: Some(lifted),
                }
            }
            Err(AskError::Failed(e)) => return Err(e),
        };
        Ok(if answer.lifted == Some(true) {
            format!(
                "lifted the ban on {} (source {})\n",
                answer.addr, answer.source
            )
        } else {
            format!(
                "{} (source {}) was not banned\n",
                answer.addr, answer.source
            )
        })
    }
}

fn unreachable_admin(error: AskError, http: SocketAddr) -> anyhow::Error {
    match error {
        AskError::Unreachable(e) => anyhow!(
            "no agent answers at {http} ({}); list changes need a running agent, which owns the lists (--http or LIMITER_HTTP)",
            root_cause(&e)
        ),
        AskError::Failed(e) => e,
    }
}

impl ListArgs {
    pub fn execute(&self, list: ListKind) -> Result<ExitCode> {
        self.output(list).map(|text| print(&text))
    }

    pub fn output(&self, list: ListKind) -> Result<String> {
        let (entry, add) = match &self.change {
            ListChange::Add(entry) => (entry, true),
            ListChange::Del(entry) => (entry, false),
        };
        let remote = Remote::new(&entry.admin.connect, entry.admin.admin_token.clone())?;
        let url = remote.url(&["v1", list.name()]);
        let request = ListRequest {
            cidr: entry.cidr.clone(),
        };
        let answer: ListAnswer = command_runtime()?
            .block_on(async {
                if add {
                    remote.ask(Method::POST, url, &[], Some(&request)).await
                } else {
                    let query = [("cidr", request.cidr.clone())];
                    remote.ask(Method::DELETE, url, &query, None::<&()>).await
                }
            })
            .map_err(|e| unreachable_admin(e, entry.admin.connect.http))?;
        let name = list.name();
        Ok(match (add, answer.changed) {
            (true, true) => format!("added {} to the {name} list\n", answer.cidr),
            (true, false) => format!("{} was already on the {name} list\n", answer.cidr),
            (false, true) => format!("removed {} from the {name} list\n", answer.cidr),
            (false, false) => format!("{} was not on the {name} list\n", answer.cidr),
        })
    }
}

#[cfg(test)]
mod tests {
    use reqwest::StatusCode;

    use super::{remote::refusal, *};

    #[test]
    fn refusals_carry_the_problem_detail() {
        let error = refusal(
            StatusCode::UNAUTHORIZED,
            r#"{"title":"Unauthorized","status":401,"detail":"a valid bearer token is required"}"#,
        );
        let text = error.to_string();
        assert!(text.contains("401"), "{text}");
        assert!(text.contains("a valid bearer token is required"), "{text}");
        assert!(text.contains("--admin-token"), "{text}");
        let error = refusal(StatusCode::BAD_GATEWAY, "upstream gone\n");
        assert!(error.to_string().ends_with("upstream gone"), "{error}");
    }

    #[test]
    fn urls_escape_path_segments() {
        let remote = Remote::new(
            &Connect {
                http: "[::1]:9090".parse().unwrap(),
                timeout: Duration::from_secs(1),
            },
            None,
        )
        .unwrap();
        assert_eq!(
            remote.url(&["v1", "bans", "2001:db8::1"]).as_str(),
            "http://[::1]:9090/v1/bans/2001:db8::1"
        );
    }
}

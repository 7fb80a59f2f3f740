//! Agents of a fleet, in process: each a real broker limiter with its own connection to the
//! fleet's Redis, serving the real broker protocol on its own Unix socket, as `limiter run`
//! wires them (minus the kernel, which fleet mode does not touch). Needs no root.

use std::{path::PathBuf, sync::Arc, time::Duration};

use anyhow::Result;
use limiter::{
    buckets::{Limiter, NoBans},
    fleet::{FleetConfig, RedisTarget},
    protocol::Server,
    run,
    settings::ServeConfig,
};
use limiter_client::{Client, Verdict};
use tempfile::TempDir;
use tokio_util::sync::CancellationToken;

/// A runtime with two workers, so that agents and their clients in one process run checks at
/// once, as separate agents on a fleet's hosts would.
pub fn two_workers() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// One agent; stops serving on drop.
pub struct FleetAgent {
    pub limiter: Arc<Limiter>,
    socket: PathBuf,
    stop: CancellationToken,
    _dir: TempDir,
}

impl FleetAgent {
    /// An agent on the Redis at `url` (`redis://` or `redis+cluster://`) with the given
    /// `[actions.NAME]` tables, every action shared.
    pub async fn start(
        url: &str,
        actions: &str,
        check_timeout: Duration,
        expected_replicas: u32,
    ) -> Result<Self> {
        let fleet = FleetConfig {
            check_timeout,
            expected_replicas,
            ..FleetConfig::new(RedisTarget::parse(url).map_err(anyhow::Error::msg)?)
        };
        Self::start_fleet(&fleet, actions).await
    }

    /// An agent of the fleet `fleet` with the given `[actions.NAME]` tables, every action
    /// shared (for settings `start` leaves at their defaults, such as the session lease),
    /// built by `limiter run`'s own phase.
    pub async fn start_fleet(fleet: &FleetConfig, actions: &str) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("limiter.toml");
        std::fs::write(&file, actions)?;
        let redis = fleet.redis.to_string();
        let mut settings = crate::kernel::settings(&[
            "--config",
            file.to_str().expect("a UTF-8 path"),
            "--redis",
            &redis,
        ]);
        settings.restart.fleet = Some(fleet.clone());
        let buckets = run::fleet(&settings, Arc::new(NoBans)).await?;
        let limiter = buckets.limiter;
        let socket = dir.path().join("limiter.sock");
        let server = Server::bind(&ServeConfig::unix(&socket), Arc::clone(&limiter)).await?;
        let stop = CancellationToken::new();
        tokio::spawn(server.run(stop.clone().cancelled_owned()));
        Ok(Self {
            limiter,
            socket,
            stop,
            _dir: dir,
        })
    }

    /// Polls the agent's fleet status until Redis is (or is not) up, bounded.
    pub async fn wait_redis_up(&self, up: bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while self.limiter.shared_status().map(|s| s.redis_up) != Some(up) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "redis_up never became {up}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A new pipelined client on the agent's socket.
    pub async fn client(&self) -> Result<Client> {
        Ok(Client::connect_unix(&self.socket).await?)
    }
}

impl Drop for FleetAgent {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Exactly `limit` checks admitted, and each admitted one saw a different count of tokens
/// left: one bucket, spent one token at a time, however the checks interleaved.
pub fn assert_exactly(verdicts: &[Verdict], limit: u32) {
    let mut remaining: Vec<u32> = verdicts
        .iter()
        .filter(|v| v.allowed)
        .map(|v| v.remaining)
        .collect();
    remaining.sort_unstable();
    assert_eq!(remaining, (0..limit).collect::<Vec<_>>());
}

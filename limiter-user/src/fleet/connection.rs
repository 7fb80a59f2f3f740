//! The fleet's connection to Redis: a standalone server through redis-rs's
//! `ConnectionManager`, a Redis Cluster through its async cluster client. Both multiplex:
//! every clone of [`Redis`] sends on the same connection (one per cluster node), so concurrent
//! checks are pipelined rather than queued, and both reconnect by themselves after a failure.

use std::{sync::Arc, time::Duration};

use redis::{
    Client, Cmd, FromRedisValue, RedisFuture, RedisResult, ScriptInvocation, Value,
    aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig, PubSub},
    cluster::{ClusterClientBuilder, ClusterConfig},
    cluster_async::ClusterConnection,
};

use super::config::RedisTarget;

/// How long one attempt to (re)connect to a server may take. Checks never wait for it
/// longer than their own timeout; it bounds the background reconnection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// How long redis-rs lets one command wait for its answer: callers set their own, shorter
/// timeouts (a check's is `check-timeout`, at most 10 s), which the library's default
/// (500 ms) would otherwise cut short.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error("setting up the Redis client for {target}")]
    Client {
        target: String,
        #[source]
        source: redis::RedisError,
    },
    #[error("no node of {target} accepted a pub/sub connection")]
    PubSub {
        target: String,
        #[source]
        source: redis::RedisError,
    },
}

/// One multiplexed connection to the fleet's Redis, either kind; usable wherever redis-rs
/// takes an async connection (commands, pipelines, scripts).
#[derive(Clone)]
pub enum Connection {
    Server(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Server(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Server(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Server(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// A handle on the fleet's Redis: clone it freely, every clone shares the connection.
#[derive(Clone)]
pub struct Redis {
    connection: Connection,
    target: Arc<RedisTarget>,
}

impl Redis {
    /// Sets up the connection without waiting for Redis: the first command connects, so an
    /// agent starts (and decides locally) while its Redis is away. Call it within a tokio
    /// runtime.
    pub fn connect(target: &RedisTarget) -> Result<Self, FleetError> {
        let failed = |source| FleetError::Client {
            target: target.to_string(),
            source,
        };
        let connection = if target.is_cluster() {
            let client = ClusterClientBuilder::new(target.nodes().to_vec())
                .build()
                .map_err(failed)?;
            Connection::Cluster(
                client.get_pending_async_connection_with_config(
                    ClusterConfig::new()
                        .set_connection_timeout(CONNECT_TIMEOUT)
                        .set_response_timeout(RESPONSE_TIMEOUT),
                ),
            )
        } else {
            let client = Client::open(target.nodes()[0].clone()).map_err(failed)?;
            // Few, quick retries: while Redis is away, checks are decided locally and a
            // background probe brings the connection back.
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(CONNECT_TIMEOUT))
                .set_response_timeout(Some(RESPONSE_TIMEOUT))
                .set_number_of_retries(1)
                .set_max_delay(Duration::from_millis(200));
            Connection::Server(
                ConnectionManager::new_lazy_with_config(client, config).map_err(failed)?,
            )
        };
        Ok(Self {
            connection,
            target: Arc::new(target.clone()),
        })
    }

    pub fn target(&self) -> &RedisTarget {
        &self.target
    }

    /// The shared connection, for pipelines and anything else redis-rs runs on one.
    pub fn connection(&self) -> Connection {
        self.connection.clone()
    }

    /// Runs a script by its SHA (`EVALSHA`), loading it first if the server does not know it
    /// (after a restart, or on a cluster node that never saw it).
    pub async fn run_script<T: FromRedisValue>(
        &self,
        invocation: &ScriptInvocation<'_>,
    ) -> RedisResult<T> {
        invocation.invoke_async(&mut self.connection()).await
    }

    /// Sends one command (routed by its key on a cluster).
    pub async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> RedisResult<T> {
        cmd.query_async(&mut self.connection()).await
    }

    /// A dedicated pub/sub connection (subscriptions cannot share the multiplexed one). On a
    /// cluster, any node will do: a `PUBLISH` reaches the subscribers of every node.
    pub async fn pubsub(&self) -> Result<PubSub, FleetError> {
        let mut last = None;
        for node in self.target.nodes() {
            let attempt = match Client::open(node.clone()) {
                Ok(client) => client.get_async_pubsub().await,
                Err(error) => Err(error),
            };
            match attempt {
                Ok(pubsub) => return Ok(pubsub),
                Err(error) => last = Some(error),
            }
        }
        Err(FleetError::PubSub {
            target: self.target.to_string(),
            source: last.expect("a target has at least one node"),
        })
    }
}

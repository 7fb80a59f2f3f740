//! Where the fleet's Redis is and how long a check may wait for it.

use std::{fmt, time::Duration};

use redis::{ConnectionInfo, IntoConnectionInfo};

/// The fleet settings' defaults.
pub mod defaults {
    use std::time::Duration;

    pub const KEY_PREFIX: &str = "limiter";
    /// Long enough for a round trip across a data centre, short enough that a broker waiting
    /// on a dead Redis does not notice.
    pub const CHECK_TIMEOUT: Duration = Duration::from_millis(50);
    pub const EXPECTED_REPLICAS: u32 = 2;
    /// A dead agent's sessions are held at most this long; renewed every 10 s, a lease
    /// survives two lost renewals.
    pub const SESSION_LEASE: Duration = Duration::from_secs(30);
}

/// The scheme that names a Redis Cluster: `redis+cluster://host:port,host:port,...`.
const CLUSTER_SCHEME: &str = "redis+cluster://";

/// A Redis to connect to: one server, or the seed nodes of a Redis Cluster (the client learns
/// the rest of the cluster from them).
#[derive(Clone)]
pub struct RedisTarget {
    /// As written: settings are compared by it (a reload that changes it needs a restart),
    /// and it is never shown, since it may hold a password.
    written: String,
    nodes: Vec<ConnectionInfo>,
    cluster: bool,
}

impl RedisTarget {
    /// `redis://[user:password@]host[:port][/db]` (or `unix:///path`) is one server;
    /// `redis+cluster://[user:password@]host:port[,host:port...]` is a Redis Cluster reached
    /// through any of the listed nodes.
    pub fn parse(text: &str) -> Result<Self, String> {
        let written = text.trim().to_owned();
        if written.is_empty() {
            return Err("is empty (leave it out to run without a fleet)".into());
        }
        let Some(rest) = written.strip_prefix(CLUSTER_SCHEME) else {
            let node = written
                .as_str()
                .into_connection_info()
                .map_err(|e| format!("not a Redis URL ({e})"))?;
            return Ok(Self {
                nodes: vec![node],
                cluster: false,
                written,
            });
        };
        let (credentials, hosts) = match rest.rsplit_once('@') {
            Some((credentials, hosts)) => (format!("{credentials}@"), hosts),
            None => (String::new(), rest),
        };
        let nodes = hosts
            .trim_end_matches('/')
            .split(',')
            .filter(|h| !h.trim().is_empty())
            .map(|host| {
                format!("redis://{credentials}{}", host.trim())
                    .into_connection_info()
                    .map_err(|e| format!("cluster node {:?} is not host:port ({e})", host.trim()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if nodes.is_empty() {
            return Err(format!("{CLUSTER_SCHEME} names no node"));
        }
        Ok(Self {
            nodes,
            cluster: true,
            written,
        })
    }

    pub fn is_cluster(&self) -> bool {
        self.cluster
    }

    /// The server, or the cluster's seed nodes.
    pub fn nodes(&self) -> &[ConnectionInfo] {
        &self.nodes
    }
}

impl PartialEq for RedisTarget {
    fn eq(&self, other: &Self) -> bool {
        self.written == other.written
    }
}

impl Eq for RedisTarget {}

/// Shown without credentials: it goes to logs and `/v1/status`.
impl fmt::Display for RedisTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.cluster {
            "redis+cluster://"
        } else {
            "redis://"
        })?;
        for (i, node) in self.nodes.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{}", node.addr())?;
        }
        Ok(())
    }
}

impl fmt::Debug for RedisTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// The `[cluster]` settings, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetConfig {
    pub redis: RedisTarget,
    /// Every key the fleet writes starts with it, so fleets (or other users) can share a Redis.
    pub key_prefix: String,
    /// The longest one check waits for Redis before it is decided locally.
    pub check_timeout: Duration,
    /// Agents in the fleet: a check decided locally allows `limit / expected_replicas`, so the
    /// fleet as a whole stays near its limit while Redis is away.
    pub expected_replicas: u32,
    /// How long a shared session's lease lasts unrenewed; renewed every third of it.
    pub session_lease: Duration,
}

impl FleetConfig {
    pub fn new(redis: RedisTarget) -> Self {
        Self {
            redis,
            key_prefix: defaults::KEY_PREFIX.to_owned(),
            check_timeout: defaults::CHECK_TIMEOUT,
            expected_replicas: defaults::EXPECTED_REPLICAS,
            session_lease: defaults::SESSION_LEASE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_server_or_a_cluster_by_the_scheme() {
        let one = RedisTarget::parse("redis://:secret@127.0.0.1:6380/2").unwrap();
        assert!(!one.is_cluster());
        assert_eq!(one.to_string(), "redis://127.0.0.1:6380");
        let cluster =
            RedisTarget::parse("redis+cluster://u:pw@10.0.0.1:7000, 10.0.0.2:7001").unwrap();
        assert!(cluster.is_cluster());
        let nodes = cluster.nodes();
        assert_eq!(nodes.len(), 2);
        assert_eq!(nodes[1].redis_settings().password(), Some("pw"));
        assert_eq!(
            cluster.to_string(),
            "redis+cluster://10.0.0.1:7000,10.0.0.2:7001"
        );
        assert!(!format!("{cluster:?}").contains("pw"));
    }

    #[test]
    fn bad_urls_say_why() {
        for text in [
            "",
            "http://x",
            "redis+cluster://",
            "redis+cluster://h:notaport",
        ] {
            assert!(RedisTarget::parse(text).is_err(), "{text:?}");
        }
    }
}

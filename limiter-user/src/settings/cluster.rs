//! The fleet's settings: the `[cluster]` table and its flags. [`ClusterLayer`] is both.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{ConfigError, flags::text_duration};
use crate::fleet::{FleetConfig, RedisTarget, defaults};

/// The fleet's flags, and the file's `[cluster]` table under them.
#[derive(clap::Args, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ClusterLayer {
    /// Redis shared by the fleet's agents: `redis://[user:pass@]host:port[/db]` for one
    /// server, `redis+cluster://host:port,host:port,...` for a Redis Cluster. Without it each
    /// agent's limits hold on its own host only.
    #[arg(long, env = "LIMITER_REDIS", hide_env_values = true)]
    pub redis: Option<String>,
    /// Prefix of every key the agent writes in Redis. [default: limiter]
    #[arg(long, env = "LIMITER_KEY_PREFIX")]
    pub key_prefix: Option<String>,
    /// The longest a shared check waits for Redis; past it, the check is decided locally at
    /// limit / expected-replicas. [default: 50ms]
    #[arg(long, env = "LIMITER_CHECK_TIMEOUT", value_parser = humantime::parse_duration)]
    #[serde(default, with = "text_duration")]
    pub check_timeout: Option<Duration>,
    /// Agents in the fleet, which share each limit while Redis is away. [default: 2]
    #[arg(long, env = "LIMITER_EXPECTED_REPLICAS")]
    pub expected_replicas: Option<u32>,
    /// How long a shared session's lease in Redis lasts unrenewed: the agent renews its
    /// brokers' leases every third of it, so those of an agent that died lapse within it.
    /// [default: 30s]
    #[arg(long, env = "LIMITER_SESSION_LEASE", value_parser = humantime::parse_duration)]
    #[serde(default, with = "text_duration")]
    pub session_lease: Option<Duration>,
}

/// The longest `check-timeout` accepted: a broker waits on each check.
const MAX_CHECK_TIMEOUT: Duration = Duration::from_secs(10);
/// The shortest `session-lease`: renewed every third of it, a lease shorter than a second
/// would keep the agent renewing more than it answers.
const MIN_SESSION_LEASE: Duration = Duration::from_secs(1);
/// The longest `session-lease`: a dead agent's sessions are held that long.
const MAX_SESSION_LEASE: Duration = Duration::from_secs(3_600);

impl ClusterLayer {
    /// `None` without a Redis; the other keys then must not be set either, since they would
    /// silently do nothing.
    pub fn resolve(&self) -> Result<Option<FleetConfig>, ConfigError> {
        let Some(redis) = &self.redis else {
            for (setting, set) in [
                ("cluster.key-prefix", self.key_prefix.is_some()),
                ("cluster.check-timeout", self.check_timeout.is_some()),
                (
                    "cluster.expected-replicas",
                    self.expected_replicas.is_some(),
                ),
                ("cluster.session-lease", self.session_lease.is_some()),
            ] {
                if set {
                    return Err(ConfigError::new(
                        setting,
                        "has no effect without cluster.redis",
                    ));
                }
            }
            return Ok(None);
        };
        let redis = RedisTarget::parse(redis).map_err(|e| ConfigError::new("cluster.redis", e))?;
        let key_prefix = self
            .key_prefix
            .clone()
            .unwrap_or_else(|| defaults::KEY_PREFIX.to_owned());
        // Braces would change the keys' hash tags, and with them the cluster slot a check
        // goes to.
        if key_prefix.is_empty()
            || key_prefix.len() > 64
            || !key_prefix
                .bytes()
                .all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}')
        {
            return Err(ConfigError::new(
                "cluster.key-prefix",
                "1 to 64 printable characters, without spaces, `{` or `}`",
            ));
        }
        let check_timeout = self.check_timeout.unwrap_or(defaults::CHECK_TIMEOUT);
        if check_timeout.is_zero() || check_timeout > MAX_CHECK_TIMEOUT {
            return Err(ConfigError::new(
                "cluster.check-timeout",
                format!(
                    "must be longer than zero and at most {}",
                    humantime::format_duration(MAX_CHECK_TIMEOUT)
                ),
            ));
        }
        let expected_replicas = self
            .expected_replicas
            .unwrap_or(defaults::EXPECTED_REPLICAS);
        if expected_replicas == 0 {
            return Err(ConfigError::new(
                "cluster.expected-replicas",
                "must be at least 1",
            ));
        }
        let session_lease = self.session_lease.unwrap_or(defaults::SESSION_LEASE);
        if !(MIN_SESSION_LEASE..=MAX_SESSION_LEASE).contains(&session_lease)
            || session_lease.subsec_millis() * 1_000_000 != session_lease.subsec_nanos()
        {
            return Err(ConfigError::new(
                "cluster.session-lease",
                format!(
                    "must be {} to {}, in whole milliseconds",
                    humantime::format_duration(MIN_SESSION_LEASE),
                    humantime::format_duration(MAX_SESSION_LEASE)
                ),
            ));
        }
        Ok(Some(FleetConfig {
            redis,
            key_prefix,
            check_timeout,
            expected_replicas,
            session_lease,
        }))
    }
}

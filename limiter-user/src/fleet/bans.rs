//! Bans shared by the fleet. Each ban or unban is one script on Redis's clock: the bans in
//! force are a sorted set of addresses scored by their expiry (trimmed as it is touched,
//! expiring with its longest ban), and every change is appended to a stream, the ban log,
//! which every agent follows. A stream rather than pub/sub: an agent that lost its connection
//! reads on from the last entry it applied, so it misses no unban; one that starts reads the
//! bans in force and the log's position in one step. Both keys share one hash tag, so on a
//! cluster they live in one slot and the script may touch both.
//!
//! Escalation counts authentication failures per address across the fleet in a counter
//! under the address's own hash tag.

use std::{collections::HashMap, net::IpAddr, sync::LazyLock, time::Duration};

use redis::{RedisResult, Script};

use super::Redis;

use crate::duration_units::duration_ms;

static BAN: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/ban.lua")));
static IN_FORCE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/bans_in_force.lua")));
static FAILURE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/failure.lua")));
/// Redis's clock as the node holding the ban keys reads it (on a cluster, `TIME` without a
/// key would go to any node).
static CLOCK: LazyLock<Script> = LazyLock::new(|| Script::new("return redis.call('TIME')"));

/// Entries the ban log keeps (approximately: Redis trims it in whole nodes). An agent away for
/// more changes than this reads the bans in force again instead.
const LOG_LENGTH: u32 = 10_000;

/// The longest one read of the log waits for an entry. Below the client's response timeout
/// (500 ms), so a quiet log never looks like a dead server.
const READ_BLOCK: Duration = Duration::from_millis(250);

/// A position in the ban log: a stream id, `ms-seq`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct LogId {
    ms: u64,
    seq: u64,
}

impl LogId {
    fn parse(text: &str) -> Option<Self> {
        let (ms, seq) = text.split_once('-')?;
        Some(Self {
            ms: ms.parse().ok()?,
            seq: seq.parse().ok()?,
        })
    }
}

impl std::fmt::Display for LogId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.ms, self.seq)
    }
}

/// One `XREAD` reply: per stream, its entries, each an id and its fields.
type LogReply = Option<Vec<(String, Vec<(String, HashMap<String, String>)>)>>;

/// A change another agent (or this one) made, as the log tells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BanChange {
    /// Banned for this long from when Redis answered the read.
    Ban(IpAddr, Duration),
    Unban(IpAddr),
}

/// The bans in force at one instant, and where the log stood then.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BansInForce {
    pub bans: Vec<(IpAddr, Duration)>,
    /// The oldest entry the log still holds; `None` for an empty log.
    pub first: Option<LogId>,
    /// Reading on from here misses nothing after this snapshot.
    pub last: LogId,
}

/// The fleet's bans under one key prefix; `origin` tells this agent's log entries apart.
#[derive(Clone)]
pub struct FleetBans {
    redis: Redis,
    in_force: String,
    log: String,
    failures: String,
    origin: String,
}

impl FleetBans {
    pub fn new(redis: Redis, key_prefix: &str, origin: String) -> Self {
        Self {
            redis,
            in_force: format!("{{{key_prefix}:bans}}:in-force"),
            log: format!("{{{key_prefix}:bans}}:log"),
            failures: format!("{key_prefix}:failures:"),
            origin,
        }
    }

    /// The same bans through another connection: the log is read with a blocking command,
    /// which would hold up every other command sharing its connection.
    pub fn with_connection(&self, redis: Redis) -> Self {
        Self {
            redis,
            ..self.clone()
        }
    }

    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The Redis the bans are kept in, as the operator wrote it.
    pub fn target(&self) -> String {
        self.redis.target().to_string()
    }

    async fn change(&self, op: &str, addr: IpAddr, ttl: Duration) -> RedisResult<bool> {
        let mut invocation = BAN.prepare_invoke();
        invocation
            .key(&self.in_force)
            .key(&self.log)
            .arg(op)
            .arg(addr.to_canonical().to_string())
            .arg(duration_ms(ttl))
            .arg(&self.origin)
            .arg(LOG_LENGTH);
        let changed: i64 = self.redis.run_script(&invocation).await?;
        Ok(changed == 1)
    }

    /// Bans `addr` on every agent for `ttl` (from now on Redis's clock).
    pub async fn ban(&self, addr: IpAddr, ttl: Duration) -> RedisResult<()> {
        self.change("ban", addr, ttl).await.map(drop)
    }

    /// Lifts `addr`'s ban on every agent, and its failure count; whether one was in force.
    pub async fn unban(&self, addr: IpAddr) -> RedisResult<bool> {
        let lifted = self.change("unban", addr, Duration::ZERO).await?;
        let _: i64 = self
            .redis
            .query(redis::cmd("DEL").arg(self.failure_key(addr)))
            .await?;
        Ok(lifted)
    }

    fn failure_key(&self, addr: IpAddr) -> String {
        format!("{}{{{}}}", self.failures, addr.to_canonical())
    }

    /// Counts one failure of `addr` across the fleet within `window`; returns the count. The
    /// failure that makes it `after + 1` keeps the counter for `ban`.
    pub async fn count_failure(
        &self,
        addr: IpAddr,
        window: Duration,
        after: u32,
        ban: Duration,
    ) -> RedisResult<u64> {
        let mut invocation = FAILURE.prepare_invoke();
        invocation
            .key(self.failure_key(addr))
            .arg(duration_ms(window))
            .arg(after)
            .arg(duration_ms(ban));
        self.redis.run_script(&invocation).await
    }

    /// The bans in force and the log's position, in one step.
    pub async fn in_force(&self) -> RedisResult<BansInForce> {
        let mut invocation = IN_FORCE.prepare_invoke();
        invocation.key(&self.in_force).key(&self.log);
        let (first, last, now, scored): (String, String, u64, Vec<(String, u64)>) =
            self.redis.run_script(&invocation).await?;
        let bans = scored
            .into_iter()
            .filter_map(|(addr, expiry)| {
                let addr = addr.parse().ok()?;
                Some((addr, Duration::from_millis(expiry.checked_sub(now)?)))
            })
            .collect();
        Ok(BansInForce {
            bans,
            first: LogId::parse(&first),
            last: LogId::parse(&last).unwrap_or_default(),
        })
    }

    /// The log's changes after `after`, waiting up to a moment for one; returns the position
    /// to read on from. This agent's own entries are skipped: it applied them itself.
    pub async fn read_log(&self, after: LogId) -> RedisResult<(Vec<BanChange>, LogId)> {
        let reply: LogReply = self
            .redis
            .query(
                redis::cmd("XREAD")
                    .arg("COUNT")
                    .arg(256)
                    .arg("BLOCK")
                    .arg(duration_ms(READ_BLOCK))
                    .arg("STREAMS")
                    .arg(&self.log)
                    .arg(after.to_string()),
            )
            .await?;
        let entries = reply
            .into_iter()
            .flatten()
            .flat_map(|(_, entries)| entries)
            .collect::<Vec<_>>();
        let mut last = after;
        if entries.is_empty() {
            return Ok((Vec::new(), last));
        }
        // Expiries are on Redis's clock: the remaining time is taken against it.
        let now_ms = self.server_ms().await?;
        let mut changes = Vec::new();
        for (id, fields) in entries {
            if let Some(id) = LogId::parse(&id) {
                last = last.max(id);
            }
            if fields.get("origin").map(String::as_str) == Some(self.origin.as_str()) {
                continue;
            }
            let Some(addr) = fields.get("addr").and_then(|a| a.parse::<IpAddr>().ok()) else {
                continue;
            };
            match fields.get("op").map(String::as_str) {
                Some("ban") => {
                    let expiry = fields.get("expiry").and_then(|e| e.parse::<u64>().ok());
                    if let Some(left) = expiry.and_then(|e| e.checked_sub(now_ms))
                        && left > 0
                    {
                        changes.push(BanChange::Ban(addr, Duration::from_millis(left)));
                    }
                }
                Some("unban") => changes.push(BanChange::Unban(addr)),
                _ => {}
            }
        }
        Ok((changes, last))
    }

    async fn server_ms(&self) -> RedisResult<u64> {
        let mut invocation = CLOCK.prepare_invoke();
        invocation.key(&self.log);
        let (secs, micros): (u64, u64) = self.redis.run_script(&invocation).await?;
        Ok(secs * 1000 + micros / 1000)
    }
}

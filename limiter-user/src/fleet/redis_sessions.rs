//! Sessions shared by the fleet: each key's sessions are leases in one sorted set in Redis
//! (`lua/session.lua`), the member a session's name in the fleet and the score its lease's
//! end on Redis's clock. An acquire is one script call, atomic on the server, so concurrent
//! acquires from every agent never hold more than the limit.
//!
//! The leases heal themselves: this agent renews those of its brokers' sessions every third
//! of the lease (`lua/session_renew.lua`, one call per key), a broker whose protocol
//! connection ends has its sessions released here at once, and an agent that dies stops
//! renewing, so its sessions lapse within one lease. An acquire abandoned before Redis
//! answered (its connection ended, or the check timeout passed) is released as well: the
//! release follows the script on the same connection, so it removes whatever the script
//! added.

use std::{
    collections::{HashMap, HashSet},
    hash::BuildHasher,
    sync::{LazyLock, Mutex},
    time::Duration,
};

use futures::{StreamExt, stream};
use redis::{RedisResult, Script};

use super::Redis;

static SESSION: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/session.lua")));
static RENEW: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/session_renew.lua")));

/// How many keys' renewals are in flight at once.
const RENEWALS_AT_ONCE: usize = 64;

/// The leases this agent holds for its brokers, by the Redis key of their action and key.
pub struct FleetSessions {
    /// Random per agent process, so two agents' connections never name the same member.
    agent: String,
    lease: Duration,
    held: Mutex<HashMap<Vec<u8>, KeyLeases>>,
}

/// One key's leases held here, with the limit they were taken under (a renewal puts a
/// lapsed lease back only under it).
struct KeyLeases {
    limit: u32,
    members: HashSet<Vec<u8>>,
}

/// An acquire's answer: whether the session fit, and the key's live leases after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseAnswer {
    pub fits: bool,
    pub held: u32,
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The script's `{fits, held}` as an answer.
fn lease_answer((fits, held): (i64, i64)) -> LeaseAnswer {
    LeaseAnswer {
        fits: fits == 1,
        held: u32::try_from(held).unwrap_or(u32::MAX),
    }
}

/// How often the leases are renewed: a third of the lease, so one lost renewal costs none.
pub fn renew_every(lease: Duration) -> Duration {
    lease / 3
}

/// Removes a lease whose acquire was abandoned, unless disarmed by its answer.
struct Unanswered {
    redis: Redis,
    key: Vec<u8>,
    member: Vec<u8>,
    armed: bool,
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if self.armed {
            remove(
                &self.redis,
                std::mem::take(&mut self.key),
                std::mem::take(&mut self.member),
            );
        }
    }
}

/// Removes one lease.
async fn zrem(redis: Redis, key: Vec<u8>, member: Vec<u8>) -> RedisResult<()> {
    let mut zrem = redis::cmd("ZREM");
    zrem.arg(key).arg(member);
    redis.query::<i64>(&zrem).await.map(drop)
}

/// Sends `ZREM` without waiting for it; Redis that does not answer lets the lease lapse.
fn remove(redis: &Redis, key: Vec<u8>, member: Vec<u8>) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(zrem(redis.clone(), key, member));
}

impl FleetSessions {
    pub fn new(lease: Duration) -> Self {
        let agent = std::hash::RandomState::new()
            .hash_one((std::process::id(), std::time::SystemTime::now()));
        Self {
            agent: format!("{agent:016x}"),
            lease,
            held: Mutex::default(),
        }
    }

    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The session's name in the fleet: this agent's, then the limiter's (connection and
    /// the broker's name).
    fn member(&self, session: &[u8]) -> Vec<u8> {
        let mut member = Vec::with_capacity(self.agent.len() + 1 + session.len());
        member.extend_from_slice(self.agent.as_bytes());
        member.push(b':');
        member.extend_from_slice(session);
        member
    }

    /// Takes `session`'s lease of `key` if fewer than `limit` are live (or with `force`
    /// regardless); a lease taken is renewed from then on, until [`Self::release`].
    pub async fn acquire(
        &self,
        redis: &Redis,
        key: Vec<u8>,
        session: &[u8],
        (limit, force): (u32, bool),
    ) -> RedisResult<LeaseAnswer> {
        let member = self.member(session);
        let mut unanswered = Unanswered {
            redis: redis.clone(),
            key,
            member,
            armed: true,
        };
        let mut invocation = SESSION.prepare_invoke();
        invocation
            .key(&unanswered.key[..])
            .arg("acquire")
            .arg(limit)
            .arg(millis(self.lease))
            .arg(u8::from(force))
            .arg(&unanswered.member[..]);
        let answer = lease_answer(redis.run_script(&invocation).await?);
        unanswered.armed = false;
        if answer.fits || force {
            let mut held = self.held.lock().expect("leases lock");
            let leases = held
                .entry(std::mem::take(&mut unanswered.key))
                .or_insert_with(|| KeyLeases {
                    limit,
                    members: HashSet::new(),
                });
            leases.limit = limit;
            leases
                .members
                .insert(std::mem::take(&mut unanswered.member));
        }
        Ok(answer)
    }

    /// Stops renewing `session`'s lease of `key` at once; the future gives it back in Redis.
    pub fn release(
        &self,
        redis: &Redis,
        key: Vec<u8>,
        session: &[u8],
    ) -> impl Future<Output = RedisResult<()>> + Send + 'static {
        let member = self.member(session);
        {
            let mut held = self.held.lock().expect("leases lock");
            if let Some(leases) = held.get_mut(&key) {
                leases.members.remove(&member);
                if leases.members.is_empty() {
                    held.remove(&key);
                }
            }
        }
        zrem(redis.clone(), key, member)
    }

    /// Whether one more session of `key` would fit `limit`, and the leases live.
    pub async fn count(&self, redis: &Redis, key: &[u8], limit: u32) -> RedisResult<LeaseAnswer> {
        let mut invocation = SESSION.prepare_invoke();
        invocation
            .key(key)
            .arg("count")
            .arg(limit)
            .arg(millis(self.lease))
            .arg(0)
            .arg("");
        Ok(lease_answer(redis.run_script(&invocation).await?))
    }

    /// Renews every lease held here, one script call per key; the first failure as text.
    pub async fn renew(&self, redis: &Redis) -> Result<(), String> {
        let snapshot: Vec<(Vec<u8>, u32, Vec<Vec<u8>>)> = self
            .held
            .lock()
            .expect("leases lock")
            .iter()
            .map(|(key, leases)| {
                (
                    key.clone(),
                    leases.limit,
                    leases.members.iter().cloned().collect(),
                )
            })
            .collect();
        let lease = millis(self.lease);
        let results: Vec<RedisResult<u64>> = stream::iter(snapshot)
            .map(|(key, limit, members)| async move {
                let mut invocation = RENEW.prepare_invoke();
                invocation.key(key).arg(lease).arg(limit);
                for member in members {
                    invocation.arg(member);
                }
                redis.run_script::<u64>(&invocation).await
            })
            .buffer_unordered(RENEWALS_AT_ONCE)
            .collect()
            .await;
        let mut failure = None;
        for result in results {
            match result {
                Ok(0) => {}
                Ok(lost) => {
                    tracing::warn!(
                        lost,
                        "sessions' leases lapsed before their renewal and their key is full: the fleet no longer counts them"
                    );
                }
                Err(error) => failure = failure.or(Some(error.to_string())),
            }
        }
        failure.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewed_three_times_per_lease_and_members_named_by_agent() {
        assert_eq!(
            renew_every(Duration::from_secs(30)),
            Duration::from_secs(10)
        );
        let (a, b) = (
            FleetSessions::new(Duration::from_secs(1)),
            FleetSessions::new(Duration::from_secs(1)),
        );
        assert_ne!(
            a.member(b"c1"),
            b.member(b"c1"),
            "two agents never share a member"
        );
        assert!(a.member(b"c1").ends_with(b":c1"));
        assert_eq!(
            lease_answer((1, 3)),
            LeaseAnswer {
                fits: true,
                held: 3
            }
        );
        assert!(!lease_answer((0, -1)).fits);
    }
}

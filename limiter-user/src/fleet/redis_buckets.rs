//! The fleet's shared buckets: one GCRA bucket per action and key in Redis, checked and spent
//! by one script call (`gcra.lua`, run by its SHA) on Redis's clock, so every agent of the
//! fleet shares one exact limit. When Redis fails or is slower than `check-timeout`, the check
//! is answered "not here" and the limiter decides it locally; from then on checks skip Redis
//! at once, costing no timeout each, until a background probe finds it answering again.
//! Sessions (`sessions.rs`) go the same way: leases in Redis while it answers, decided
//! locally at the fallback share while it does not; a task renews the leases held here.

use std::{
    sync::{
        Arc, Weak,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use redis::Script;

use super::{
    FleetConfig, FleetError, QuotaAnswer, Redis, SharedQuota,
    redis_sessions::{FleetSessions, LeaseAnswer, renew_every},
};
use crate::{
    api::FleetStatus,
    buckets::{
        SharedBuckets, SharedCheck, SharedFuture, SharedLimit,
        cell::Algorithm,
        cell::Evaluation,
        gcra::Rate,
        shared_store::{SessionLease, SessionsHeld},
    },
    events::{self, Event, FleetPart},
};

/// The check-and-consume script; see the file for its arguments and answer.
pub const GCRA_SCRIPT: &str = include_str!("gcra.lua");

/// How often a probe asks a Redis that failed whether it answers again.
const PROBE_EVERY: Duration = Duration::from_millis(250);
/// How long a probe waits for the answer (the check timeout may be shorter than a reconnect).
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a starting agent waits for its Redis before it starts deciding locally.
const START_WAIT: Duration = Duration::from_secs(3);

/// The shared buckets in Redis, with the fallback's state.
pub struct SharedGcra {
    redis: Redis,
    script: Arc<Script>,
    prefix: String,
    timeout: Duration,
    replicas: u32,
    health: Arc<Health>,
    sessions: Arc<FleetSessions>,
}

/// Whether checks go to Redis, and the transitions, each logged once.
#[derive(Default)]
struct Health {
    up: AtomicBool,
    /// The event log said checks are decided locally, and has yet to say they are back: the
    /// first answer of a Redis that answered from the start is no return.
    local_announced: AtomicBool,
    fallback_checks: AtomicU64,
    to_local: AtomicU64,
    to_redis: AtomicU64,
}

impl Health {
    fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// A check that Redis did not decide.
    fn fell_back(&self) {
        self.fallback_checks.fetch_add(1, Ordering::Relaxed);
    }

    fn failed(&self, target: &str, why: &str) {
        if self.up.swap(false, Ordering::AcqRel) {
            self.to_local.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                redis = target,
                error = why,
                "Redis failed: shared checks are decided locally at limit / expected-replicas until it answers again"
            );
            self.announce_local(target, why);
        }
    }

    /// The event of checks decided locally: at a failure, or at a start Redis did not answer.
    fn announce_local(&self, target: &str, why: &str) {
        self.local_announced.store(true, Ordering::Release);
        events::emit(&Event::FleetFallback {
            part: FleetPart::Checks,
            redis: target.to_owned(),
            local: true,
            error: Some(why.to_owned()),
        });
    }

    fn recovered(&self, target: &str) {
        if !self.up.swap(true, Ordering::AcqRel) {
            self.to_redis.fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                redis = target,
                "Redis answers: shared checks go to it again"
            );
            if self.local_announced.swap(false, Ordering::AcqRel) {
                events::emit(&Event::FleetFallback {
                    part: FleetPart::Checks,
                    redis: target.to_owned(),
                    local: false,
                    error: None,
                });
            }
        }
    }
}

impl SharedGcra {
    /// Connects, waits for Redis's first answer for at most [`START_WAIT`] (an agent whose
    /// Redis is away starts anyway, deciding locally), and keeps probing in the background
    /// while Redis is away. Call it within a tokio runtime.
    pub async fn start(config: &FleetConfig) -> Result<Arc<Self>, FleetError> {
        let redis = Redis::connect(&config.redis)?;
        let shared = Arc::new(Self {
            redis,
            script: Arc::new(Script::new(GCRA_SCRIPT)),
            prefix: config.key_prefix.clone(),
            timeout: config.check_timeout,
            replicas: config.expected_replicas,
            health: Arc::new(Health::default()),
            sessions: Arc::new(FleetSessions::new(config.session_lease)),
        });
        let deadline = tokio::time::Instant::now() + START_WAIT;
        let mut probed = shared.probe().await;
        while probed.is_err() && tokio::time::Instant::now() + PROBE_EVERY < deadline {
            tokio::time::sleep(PROBE_EVERY).await;
            probed = shared.probe().await;
        }
        if let Err(error) = probed {
            tracing::warn!(
                redis = %shared.redis.target(),
                %error,
                "Redis does not answer yet: shared checks are decided locally at limit / expected-replicas until it does"
            );
            shared
                .health
                .announce_local(&shared.redis.target().to_string(), &error);
        }
        tokio::spawn(probe_while_down(Arc::downgrade(&shared)));
        tokio::spawn(renew_sessions(Arc::downgrade(&shared)));
        Ok(shared)
    }

    pub fn redis(&self) -> &Redis {
        &self.redis
    }

    /// `{prefix}:{action}:{key}`: the key is the hash tag, so every action of one subject
    /// shares a cluster slot and a script may touch several of them at once.
    pub fn bucket_key(&self, action: &str, key: &[u8]) -> Vec<u8> {
        let mut name = Vec::with_capacity(self.prefix.len() + action.len() + key.len() + 4);
        name.extend_from_slice(self.prefix.as_bytes());
        name.push(b':');
        name.extend_from_slice(action.as_bytes());
        name.extend_from_slice(b":{");
        name.extend_from_slice(key);
        name.push(b'}');
        name
    }

    /// Asks Redis through `ask` within the check timeout. `None` (a check decided locally,
    /// counted as a fallback) while Redis is away, or when it fails or answers too late, which
    /// is recorded against its health.
    fn ask<T, E, F>(&self, ask: impl FnOnce(Redis) -> F) -> SharedFuture<Option<T>>
    where
        T: Send + 'static,
        E: ToString,
        F: std::future::Future<Output = Result<T, E>> + Send + 'static,
    {
        if !self.health.is_up() {
            self.health.fell_back();
            return Box::pin(std::future::ready(None));
        }
        let (redis, health, timeout) = (self.redis.clone(), Arc::clone(&self.health), self.timeout);
        let asked = ask(redis.clone());
        Box::pin(async move {
            let failure = match tokio::time::timeout(timeout, asked).await {
                Ok(Ok(answer)) => return Some(answer),
                Ok(Err(error)) => error.to_string(),
                Err(_) => format!("no answer within the check timeout ({timeout:?})"),
            };
            health.failed(&redis.target().to_string(), &failure);
            health.fell_back();
            None
        })
    }

    /// One PING and the script loaded on every node; marks Redis up when both answer.
    async fn probe(&self) -> Result<(), String> {
        let asked = async {
            let _: String = self.redis.query(&redis::cmd("PING")).await?;
            let _: String = self
                .redis
                .query(redis::cmd("SCRIPT").arg("LOAD").arg(GCRA_SCRIPT))
                .await?;
            Ok::<_, redis::RedisError>(())
        };
        match tokio::time::timeout(PROBE_TIMEOUT, asked).await {
            Ok(Ok(())) => {
                self.health.recovered(&self.redis.target().to_string());
                Ok(())
            }
            Ok(Err(error)) => Err(error.to_string()),
            Err(_) => Err(format!("no answer within {PROBE_TIMEOUT:?}")),
        }
    }
}

/// Probes a Redis that is down until it answers; ends with the buckets.
async fn probe_while_down(shared: Weak<SharedGcra>) {
    loop {
        tokio::time::sleep(PROBE_EVERY).await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if !shared.health.is_up() {
            let _ = shared.probe().await;
        }
    }
}

/// Renews the leases of this agent's sessions every third of the lease; ends with the
/// buckets (an agent that stops renewing lets its sessions lapse within one lease).
async fn renew_sessions(shared: Weak<SharedGcra>) {
    let Some(every) = shared.upgrade().map(|s| renew_every(s.sessions.lease())) else {
        return;
    };
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let renewed = tokio::time::timeout(every, shared.sessions.renew(&shared.redis));
        let failure = match renewed.await {
            Ok(Ok(())) => continue,
            Ok(Err(error)) => error,
            Err(_) => format!("no answer within {every:?}"),
        };
        tracing::warn!(
            redis = %shared.redis.target(),
            error = failure,
            "renewing the sessions' leases failed: they lapse unless a later renewal reaches Redis"
        );
    }
}

/// The sessions script's answer as the limiter reads it.
fn sessions_held(answer: LeaseAnswer) -> SessionsHeld {
    SessionsHeld {
        fits: answer.fits,
        held: answer.held,
    }
}

/// Microseconds, the script's unit, from the limiter's nanoseconds (rounded down, like the
/// local emission interval; settings refuse a shared rate finer than a microsecond).
fn micros(ns: u64) -> u64 {
    ns / 1_000
}

/// One run of the GCRA script; the failure as text.
async fn gcra(
    redis: &Redis,
    script: &Script,
    key: Vec<u8>,
    rate: &Rate,
    cost: u32,
    consume: bool,
) -> Result<Evaluation, String> {
    let mut invocation = script.prepare_invoke();
    invocation
        .key(key)
        .arg(micros(rate.emission_ns()))
        .arg(micros(rate.tolerance_ns()))
        .arg(cost)
        .arg(rate.capacity())
        .arg(u8::from(consume));
    let reply = redis
        .run_script::<Vec<i64>>(&invocation)
        .await
        .map_err(|e| e.to_string())?;
    evaluation(&reply).ok_or_else(|| format!("the script answered {reply:?}"))
}

/// The quota script's answer as the local quota's evaluation.
fn quota_evaluation(answer: QuotaAnswer) -> Evaluation {
    let ns = |ms: u64| ms.saturating_mul(1_000_000);
    Evaluation {
        allowed: answer.allowed,
        // The count stays in Redis.
        new_state: 0,
        remaining: answer.remaining,
        retry_after_ns: answer.retry_after_ms.map_or(u64::MAX, ns),
        reset_after_ns: ns(answer.reset_after_ms),
    }
}

/// The script's answer as the local bucket's evaluation.
fn evaluation(reply: &[i64]) -> Option<Evaluation> {
    let &[allowed, remaining, retry_after, reset_after] = reply else {
        return None;
    };
    let ns = |us: i64| u64::try_from(us).ok().map(|us| us.saturating_mul(1_000));
    Some(Evaluation {
        allowed: allowed == 1,
        // The TAT stays in Redis.
        new_state: 0,
        remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
        retry_after_ns: if retry_after < 0 {
            u64::MAX
        } else {
            ns(retry_after)?
        },
        reset_after_ns: ns(reset_after)?,
    })
}

impl SharedBuckets for SharedGcra {
    fn take(&self, check: SharedCheck) -> SharedFuture<Option<Evaluation>> {
        let key = self.bucket_key(&check.action, &check.key);
        let script = Arc::clone(&self.script);
        self.ask(move |redis| async move {
            match check.limit {
                SharedLimit::Rate(rate) => {
                    gcra(&redis, &script, key, &rate, check.cost, check.consume).await
                }
                SharedLimit::Quota(quota) => {
                    let quota = SharedQuota {
                        limit: quota.capacity(),
                        period: quota.period(),
                        margin: quota.expiry_margin(),
                    };
                    let answer = quota.check(&redis, &key, check.cost, check.consume);
                    answer
                        .await
                        .map_err(|e| e.to_string())
                        .map(quota_evaluation)
                }
            }
        })
    }

    fn forget(&self, action: Arc<str>, key: Vec<u8>) -> SharedFuture<Option<bool>> {
        let key = self.bucket_key(&action, &key);
        let (redis, timeout) = (self.redis.clone(), self.timeout);
        Box::pin(async move {
            let mut delete = redis::cmd("DEL");
            delete.arg(key);
            match tokio::time::timeout(timeout, redis.query::<i64>(&delete)).await {
                Ok(Ok(n)) => Some(n > 0),
                _ => None,
            }
        })
    }

    fn expected_replicas(&self) -> u32 {
        self.replicas
    }

    fn acquire_session(
        &self,
        lease: SessionLease,
        limit: u32,
        force: bool,
    ) -> SharedFuture<Option<SessionsHeld>> {
        let key = self.bucket_key(&lease.action, &lease.key);
        let sessions = Arc::clone(&self.sessions);
        self.ask(move |redis| async move {
            let answer = sessions.acquire(&redis, key, &lease.session, (limit, force));
            answer.await.map(sessions_held)
        })
    }

    fn release_session(&self, lease: SessionLease) -> SharedFuture<bool> {
        let key = self.bucket_key(&lease.action, &lease.key);
        let removed = self.sessions.release(&self.redis, key, &lease.session);
        let timeout = self.timeout;
        Box::pin(async move {
            match tokio::time::timeout(timeout, removed).await {
                Ok(Ok(())) => true,
                failed => {
                    tracing::debug!(
                        ?failed,
                        "releasing a session in Redis failed: its lease will lapse"
                    );
                    false
                }
            }
        })
    }

    fn sessions_held(
        &self,
        action: Arc<str>,
        key: Vec<u8>,
        limit: u32,
    ) -> SharedFuture<Option<SessionsHeld>> {
        let key = self.bucket_key(&action, &key);
        let sessions = Arc::clone(&self.sessions);
        self.ask(move |redis| async move {
            sessions.count(&redis, &key, limit).await.map(sessions_held)
        })
    }

    fn status(&self) -> FleetStatus {
        let h = &self.health;
        FleetStatus {
            redis: self.redis.target().to_string(),
            redis_up: h.is_up(),
            expected_replicas: self.replicas,
            fallback_checks: h.fallback_checks.load(Ordering::Relaxed),
            switches_to_local: h.to_local.load(Ordering::Relaxed),
            switches_to_redis: h.to_redis.load(Ordering::Relaxed),
        }
    }
}

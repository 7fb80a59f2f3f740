//! Fleet-wide bans in the agent: every ban and unban this agent makes (admin API, command
//! line, broker protocol, escalation) is enforced here at once and then stored in the fleet's
//! Redis, and every change another agent stores there is applied here, within the moment one
//! read of the ban log takes. An agent loads the bans in force before it reports ready.
//!
//! When Redis is away bans are still enforced on the agent that made them; what does not
//! reach Redis is logged and counted (`limiter_fleet_ban_changes_total{change="send_failed"}`)
//! and not retried, and the log is read on from where it stopped once Redis answers again.

use std::{
    net::IpAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::{
    buckets::{BanError, Banner, EscalationConfig, SharedBanStats},
    errors::error_chain,
    events::{self, BanCause, Event, FleetPart},
    fleet::{BanChange, BansInForce, FleetBans, LogId},
};

/// Changes waiting for Redis at most; past it, a change is enforced here only (and counted).
const QUEUE: usize = 4_096;

/// How long a lost connection waits before the next attempt.
const RETRY: Duration = Duration::from_millis(200);

/// The longest one write to Redis may take; bans never wait for it, only the queue behind it.
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);

struct Counters {
    sent: AtomicU64,
    received: AtomicU64,
    send_failures: AtomicU64,
    /// Whether the last exchange with Redis failed, so a switch is logged once.
    down: AtomicBool,
    /// The fleet's Redis, for the event log.
    redis: String,
}

impl Counters {
    fn new(redis: String) -> Self {
        Self {
            sent: AtomicU64::new(0),
            received: AtomicU64::new(0),
            send_failures: AtomicU64::new(0),
            down: AtomicBool::new(false),
            redis,
        }
    }

    fn redis_answered(&self, what: &str) {
        if self.down.swap(false, Ordering::AcqRel) {
            tracing::info!("{what}: the fleet's Redis answers again; bans are shared again");
            events::emit(&Event::FleetFallback {
                part: FleetPart::Bans,
                redis: self.redis.clone(),
                local: false,
                error: None,
            });
        }
    }

    fn redis_failed(&self, what: &str, error: &dyn std::fmt::Display) {
        if !self.down.swap(true, Ordering::AcqRel) {
            tracing::warn!(
                %error,
                "{what}: the fleet's Redis does not answer; bans are enforced on this agent only until it does"
            );
            events::emit(&Event::FleetFallback {
                part: FleetPart::Bans,
                redis: self.redis.clone(),
                local: true,
                error: Some(format!("{what}: {error}")),
            });
        }
    }
}

enum Op {
    Ban(IpAddr, Duration),
    Unban(IpAddr),
    Failure(IpAddr),
}

/// A [`Banner`] for a fleet: enforces through `local` (the kernel) at once and queues the
/// change for Redis, in order, so a quick ban and unban reach Redis as they were made.
pub struct SharedBanner {
    local: Arc<dyn Banner>,
    queue: mpsc::Sender<Op>,
    counters: Arc<Counters>,
    escalating: bool,
}

impl SharedBanner {
    fn enqueue(&self, op: Op) {
        if self.queue.try_send(op).is_err() {
            self.counters.send_failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("the fleet's ban queue is full; this change stays on this agent");
        }
    }
}

impl Banner for SharedBanner {
    fn ban(&self, addr: IpAddr, ttl: Duration) -> Result<(), BanError> {
        self.local.ban(addr, ttl)?;
        self.enqueue(Op::Ban(addr, ttl));
        Ok(())
    }

    fn unban(&self, addr: IpAddr) -> Result<bool, BanError> {
        let lifted = self.local.unban(addr)?;
        self.enqueue(Op::Unban(addr));
        Ok(lifted)
    }

    fn failure(&self, addr: IpAddr) {
        if self.escalating {
            self.enqueue(Op::Failure(addr));
        }
    }

    fn shared_stats(&self) -> SharedBanStats {
        SharedBanStats {
            sent: self.counters.sent.load(Ordering::Relaxed),
            received: self.counters.received.load(Ordering::Relaxed),
            send_failures: self.counters.send_failures.load(Ordering::Relaxed),
        }
    }
}

/// The fleet's bans wired into one agent.
pub struct FleetBanning {
    pub banner: Arc<SharedBanner>,
    writer: Writer,
    counters: Arc<Counters>,
    local: Arc<dyn Banner>,
}

struct Writer {
    ops: mpsc::Receiver<Op>,
    bans: FleetBans,
    escalation: Option<EscalationConfig>,
}

impl FleetBanning {
    /// `local` enforces (the kernel's ban map); `bans` writes through the agent's shared
    /// connection. With `escalation`, failures are counted across the fleet.
    pub fn new(
        local: Arc<dyn Banner>,
        bans: FleetBans,
        escalation: Option<EscalationConfig>,
    ) -> Self {
        let (queue, ops) = mpsc::channel(QUEUE);
        let counters = Arc::new(Counters::new(bans.target()));
        Self {
            banner: Arc::new(SharedBanner {
                local: Arc::clone(&local),
                queue,
                counters: Arc::clone(&counters),
                escalating: escalation.is_some(),
            }),
            writer: Writer {
                ops,
                bans,
                escalation,
            },
            counters,
            local,
        }
    }

    /// Applies the bans in force to this agent, waiting at most `within` for Redis; returns
    /// where to read the log on from, or `None` if Redis did not answer (the follower loads
    /// them as soon as it does).
    pub async fn load(&self, within: Duration) -> Option<LogId> {
        match tokio::time::timeout(within, self.writer.bans.in_force()).await {
            Ok(Ok(in_force)) => {
                let count = in_force.bans.len();
                let last = apply_in_force(&*self.local, &self.counters, in_force);
                tracing::info!(count, "loaded the fleet's bans in force");
                Some(last)
            }
            Ok(Err(error)) => {
                self.counters
                    .redis_failed("loading the fleet's bans", &error);
                None
            }
            Err(_) => {
                self.counters.redis_failed(
                    "loading the fleet's bans",
                    &format_args!("no answer within {within:?}"),
                );
                None
            }
        }
    }

    /// Runs the writer, and the follower on `reader` (a connection of its own: reading the
    /// log blocks it), from `start` (`None`: load the bans in force first), until `stop`.
    pub async fn run(self, reader: FleetBans, start: Option<LogId>, stop: CancellationToken) {
        let Self {
            writer,
            counters,
            local,
            ..
        } = self;
        let follow = follow(reader, local.clone(), counters.clone(), start);
        let write = write(writer, local, counters);
        tokio::select! {
            () = stop.cancelled() => {}
            () = follow => {}
            () = write => {}
        }
    }
}

fn apply_in_force(local: &dyn Banner, counters: &Counters, in_force: BansInForce) -> LogId {
    for (addr, ttl) in in_force.bans {
        match local.ban(addr, ttl) {
            Ok(()) => {
                counters.received.fetch_add(1, Ordering::Relaxed);
            }
            Err(error) => {
                let error = error_chain(&error);
                tracing::error!(%addr, %error, "applying a fleet ban");
            }
        }
    }
    in_force.last
}

/// Stores this agent's changes in Redis, in the order they were made.
async fn write(mut writer: Writer, local: Arc<dyn Banner>, counters: Arc<Counters>) {
    while let Some(op) = writer.ops.recv().await {
        let bans = &writer.bans;
        let result = match op {
            Op::Ban(addr, ttl) => timed(bans.ban(addr, ttl)).await.map(|()| true),
            Op::Unban(addr) => timed(bans.unban(addr)).await.map(|_| true),
            Op::Failure(addr) => {
                let Some((rule, after)) = writer.escalation.and_then(|r| Some((r, r.after?)))
                else {
                    continue;
                };
                match timed(bans.count_failure(addr, rule.window, after, rule.ban)).await {
                    Ok(count) if count == u64::from(after) + 1 => {
                        // The fleet's count crossed: banned on every agent, this one first.
                        tracing::warn!(%addr, failures = count, ttl = ?rule.ban, "the fleet's failures escalated to a ban");
                        match local.ban(addr, rule.ban) {
                            Ok(()) => events::emit(&Event::Ban {
                                addr,
                                cause: BanCause::FleetEscalation { failures: count },
                                ttl: rule.ban,
                            }),
                            Err(error) => {
                                let error = error_chain(&error);
                                tracing::error!(%addr, %error, "escalation could not ban");
                            }
                        }
                        timed(bans.ban(addr, rule.ban)).await.map(|()| true)
                    }
                    Ok(_) => Ok(false),
                    Err(error) => Err(error),
                }
            }
        };
        match result {
            Ok(sent) => {
                counters.redis_answered("sharing a ban");
                if sent {
                    counters.sent.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(error) => {
                counters.send_failures.fetch_add(1, Ordering::Relaxed);
                counters.redis_failed("sharing a ban", &error);
            }
        }
    }
}

async fn timed<T>(
    request: impl Future<Output = redis::RedisResult<T>>,
) -> Result<T, redis::RedisError> {
    tokio::time::timeout(WRITE_TIMEOUT, request)
        .await
        .unwrap_or_else(|_| {
            Err(redis::RedisError::from((
                redis::ErrorKind::Io,
                "no answer in time",
            )))
        })
}

/// Applies the changes other agents store, reading the log on from `start`. After a lost
/// connection it reads on from the last entry it applied, so no change is missed, unless
/// Redis no longer holds that entry (restarted, or trimmed past it): then it applies the
/// bans in force again.
async fn follow(
    bans: FleetBans,
    local: Arc<dyn Banner>,
    counters: Arc<Counters>,
    start: Option<LogId>,
) {
    let mut position = start;
    let mut recovering = false;
    loop {
        let Some(after) = position else {
            match bans.in_force().await {
                Ok(in_force) => {
                    position = Some(apply_in_force(&*local, &counters, in_force));
                    counters.redis_answered("following the fleet's bans");
                }
                Err(error) => {
                    counters.redis_failed("following the fleet's bans", &error);
                    tokio::time::sleep(RETRY).await;
                }
            }
            continue;
        };
        if recovering {
            // Back after a failure: read on if the log still holds where this agent stopped.
            match bans.in_force().await {
                Ok(in_force) => {
                    let kept =
                        in_force.first.is_none_or(|first| first <= after) && in_force.last >= after;
                    if !kept {
                        position = Some(apply_in_force(&*local, &counters, in_force));
                    }
                    recovering = false;
                    counters.redis_answered("following the fleet's bans");
                }
                Err(error) => {
                    counters.redis_failed("following the fleet's bans", &error);
                    tokio::time::sleep(RETRY).await;
                }
            }
            continue;
        }
        match bans.read_log(after).await {
            Ok((changes, next)) => {
                for change in changes {
                    let applied = match change {
                        BanChange::Ban(addr, ttl) => local.ban(addr, ttl).map(|()| Event::Ban {
                            addr,
                            cause: BanCause::Fleet,
                            ttl,
                        }),
                        BanChange::Unban(addr) => local.unban(addr).map(|lifted| Event::Unban {
                            addr,
                            cause: BanCause::Fleet,
                            lifted,
                        }),
                    };
                    match applied {
                        Ok(event) => {
                            tracing::info!(?change, "applied a fleet ban change");
                            events::emit(&event);
                            counters.received.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(error) => {
                            let error = error_chain(&error);
                            tracing::error!(?change, %error, "applying a fleet ban change");
                        }
                    }
                }
                position = Some(next);
            }
            Err(error) => {
                counters.redis_failed("following the fleet's bans", &error);
                recovering = true;
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}

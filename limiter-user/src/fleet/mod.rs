//! Fleet mode: buckets shared by every agent of a fleet through one Redis (a standalone
//! server or a Redis Cluster), so a limit holds across hosts rather than per host.
//!
//! [`Redis`] is the connection handle: cheap to clone, multiplexed (concurrent commands from
//! every task share one pipelined connection per server), reconnecting by itself. Whatever
//! else needs the fleet's Redis (shared buckets here; bans, quotas and sessions) runs its scripts
//! through it and opens pub/sub connections from the same [`FleetConfig`].

mod bans;
mod config;
mod connection;
mod redis_buckets;
mod redis_quota;
mod redis_sessions;

pub use bans::{BanChange, BansInForce, FleetBans, LogId};
pub use config::{FleetConfig, RedisTarget, defaults};
pub use connection::{Connection, FleetError, Redis};
pub use redis_buckets::{GCRA_SCRIPT, SharedGcra};
pub use redis_quota::{QuotaAnswer, SharedQuota};
pub use redis_sessions::{FleetSessions, LeaseAnswer};

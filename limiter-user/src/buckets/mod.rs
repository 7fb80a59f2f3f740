//! Application-layer token buckets: named actions, each a GCRA bucket per key, checked by the
//! broker over the local socket and, through [`Limiter`], by anything else in the agent.

pub mod actions;
pub mod ban;
pub mod clock;
pub mod escalation;
pub mod gcra;
pub mod keys;
pub mod shared;
pub mod stats;
pub mod store;

pub use actions::{ActionConfig, ActionSpec, ConfigError, KeyKind, Window, resolve_actions};
pub use ban::{BanError, Banner, NoBans};
pub use clock::{Clock, ManualClock, MonotonicClock};
pub use escalation::{EscalationConfig, EscalationStats};
pub use shared::{Pending, SharedBuckets, SharedCheck, SharedFuture};
pub use stats::ActionStats;
pub use store::{ActionId, BYTES_PER_KEY, CheckError, Limiter, LimiterConfig, Submit};

#[cfg(test)]
mod tests;

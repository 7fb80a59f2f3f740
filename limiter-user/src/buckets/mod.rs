//! Application-layer limits: named actions, each a GCRA bucket (`gcra`) or a calendar quota
//! (`calendar_quota`) per key, checked by the broker over the local socket and, through [`Limiter`], by
//! anything else in the agent.

pub mod action_stats;
pub mod actions;
pub mod ban;
pub mod bucket_keys;
pub mod calendar_quota;
pub mod cell;
pub mod clock;
pub mod escalation;
pub mod gcra;
pub mod sessions;
pub mod shared_store;
pub mod store;
pub mod strikes;

pub use action_stats::ActionStats;
pub use actions::{
    ActionConfig, ActionKind, ActionSpec, ConfigError, Enforcement, KeyKind, Window,
    resolve_actions,
};
pub use ban::{BanError, Banner, NoBans, SharedBanStats};
pub use clock::{Clock, ManualClock, MonotonicClock};
pub use escalation::{BanIncrement, EscalationConfig, EscalationStats};
pub use sessions::SessionOwner;
pub use shared_store::{Pending, SharedBuckets, SharedCheck, SharedFuture, SharedLimit};
pub use store::{ActionId, BYTES_PER_KEY, CheckError, Judged, Limiter, LimiterConfig, Submit};
pub use strikes::StrikeRule;

#[cfg(test)]
mod tests;

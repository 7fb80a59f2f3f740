//! Application-layer limits: named actions, each a GCRA bucket (`gcra`) or a calendar quota
//! (`quota`) per key, checked by the broker over the local socket and, through [`Limiter`], by
//! anything else in the agent.

pub mod actions;
pub mod ban;
pub mod cell;
pub mod clock;
pub mod escalation;
pub mod gcra;
pub mod keys;
pub mod quota;
pub mod sessions;
pub mod shared;
pub mod stats;
pub mod store;
pub mod strikes;

pub use actions::{
    ActionConfig, ActionKind, ActionSpec, ConfigError, Enforcement, KeyKind, Window,
    resolve_actions,
};
pub use ban::{BanError, Banner, NoBans, SharedBanStats};
pub use clock::{Clock, ManualClock, MonotonicClock};
pub use escalation::{BanIncrement, EscalationConfig, EscalationStats};
pub use sessions::SessionOwner;
pub use shared::{Pending, SharedBuckets, SharedCheck, SharedFuture, SharedLimit};
pub use stats::ActionStats;
pub use store::{ActionId, BYTES_PER_KEY, CheckError, Judged, Limiter, LimiterConfig, Submit};
pub use strikes::StrikeRule;

#[cfg(test)]
mod tests;

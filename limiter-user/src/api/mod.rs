//! The agent's HTTP API as data: the JSON documents and requests that the server writes and
//! the operator commands read. The bottom layer: it depends on nothing else in the agent, so
//! both ends share one definition of every field.

mod admin_bodies;
mod check_body;
mod view_documents;

pub use admin_bodies::{
    BanAnswer, BanRequest, BanTtlError, ListAnswer, ListKind, ListRequest, MAX_BAN_TTL,
    MIN_BAN_TTL, ban_ttl, parse_ban_ttl,
};
pub use check_body::{CheckAnswer, CheckRequest};
pub use view_documents::{
    ActionCounts, ActionView, BanEntry, BlockedKey, BlockedSource, BrokerRateLimits, Connections,
    EscalationView, FleetStatus, KernelLimits, KernelRateLimits, ProfileLimits, ProfileView,
    RateLimits, SourceConnections, Status, SynCookiesStatus,
};

//! The seam between the limiter and whatever enforces a ban. The agent implements it with the
//! kernel's ban map; the limiter only decides who and for how long.

use std::{net::IpAddr, time::Duration};

use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum BanError {
    #[error("bans are not available in this process: {0}")]
    Unavailable(&'static str),
    /// Boxed: the limiter does not know what enforces its bans, only that it failed and why.
    #[error("banning {addr} failed")]
    Failed {
        addr: IpAddr,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Enforces bans. Called from the check path, so implementations must not block for long.
pub trait Banner: Send + Sync {
    fn ban(&self, addr: IpAddr, ttl: Duration) -> Result<(), BanError>;
    /// Lifts a ban; `true` if one was in force.
    fn unban(&self, addr: IpAddr) -> Result<bool, BanError>;

    /// An authentication failure escalation counted: a banner shared by a fleet counts it
    /// across the fleet too, and bans when the fleet's count crosses the threshold.
    fn failure(&self, _addr: IpAddr) {}

    /// What the banner shared with other agents; nothing for one that shares nothing.
    fn shared_stats(&self) -> SharedBanStats {
        SharedBanStats::default()
    }
}

/// Bans shared with a fleet, counted since the start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SharedBanStats {
    /// Bans and unbans of this agent stored in the fleet's Redis.
    pub sent: u64,
    /// Bans and unbans other agents made, applied here.
    pub received: u64,
    /// Bans and unbans of this agent that did not reach Redis (enforced here only).
    pub send_failures: u64,
}

/// For a limiter running without the kernel programs (unprivileged tools, benchmarks): every
/// ban is refused with a reason, so a ban request fails visibly instead of being dropped.
#[derive(Debug, Default)]
pub struct NoBans;

impl Banner for NoBans {
    fn ban(&self, _: IpAddr, _: Duration) -> Result<(), BanError> {
        Err(BanError::Unavailable("no kernel ban map is attached"))
    }

    fn unban(&self, _: IpAddr) -> Result<bool, BanError> {
        Err(BanError::Unavailable("no kernel ban map is attached"))
    }
}

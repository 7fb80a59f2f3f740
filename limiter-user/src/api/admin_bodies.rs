//! The admin endpoints' bodies: bans and the allow / deny lists, and the one rule every
//! interface (HTTP, the broker protocol, the command line) applies to a ban's TTL.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The shortest ban: the kernel map keeps expiries in nanoseconds, but a ban shorter than a
/// second has expired before anyone could observe it, so it is refused rather than placed.
pub const MIN_BAN_TTL: Duration = Duration::from_secs(1);

/// The longest ban: a year; anything longer is almost certainly a unit mistake.
pub const MAX_BAN_TTL: Duration = Duration::from_secs(366 * 24 * 3600);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("a ban lasts from 1s to 366d, not {}", humantime::format_duration(*.0))]
pub struct BanTtlError(pub Duration);

/// Checks a ban's TTL by the one rule every interface shares.
pub fn ban_ttl(ttl: Duration) -> Result<Duration, BanTtlError> {
    if (MIN_BAN_TTL..=MAX_BAN_TTL).contains(&ttl) {
        Ok(ttl)
    } else {
        Err(BanTtlError(ttl))
    }
}

/// `ban_ttl` for text: what the command line and the HTTP body carry.
pub fn parse_ban_ttl(text: &str) -> Result<Duration, String> {
    let ttl =
        humantime::parse_duration(text).map_err(|e| format!("`{text}` is not a duration: {e}"))?;
    ban_ttl(ttl).map_err(|e| e.to_string())
}

#[derive(Debug, Serialize, Deserialize)]
pub struct BanRequest {
    pub addr: String,
    /// A duration such as `"10m"` or `"1h 30m"`.
    pub ttl: String,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct BanAnswer {
    pub addr: String,
    /// The source key the ban applies to (the address masked to its prefix).
    pub source: String,
    /// For a ban: how long it lasts; for an unban: absent.
    pub ttl_ms: Option<u64>,
    /// For an unban: whether a ban was in force.
    pub lifted: Option<bool>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct ListRequest {
    pub cidr: String,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct ListAnswer {
    pub list: String,
    /// The entry as stored (host bits cleared, RFC 5952 for IPv6).
    pub cidr: String,
    /// False when adding an entry already there or removing one that is not.
    pub changed: bool,
}

/// Which source list an admin change is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListKind {
    Allow,
    Deny,
}

impl ListKind {
    /// The list's name in paths, answers and messages.
    pub fn name(self) -> &'static str {
        match self {
            ListKind::Allow => "allow",
            ListKind::Deny => "deny",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_ttl_rule() {
        assert!(parse_ban_ttl("0s").is_err());
        assert!(parse_ban_ttl("1ns").is_err());
        assert!(parse_ban_ttl("999ms").is_err());
        assert!(parse_ban_ttl("367d").is_err());
        assert_eq!(parse_ban_ttl("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_ban_ttl("10m"), Ok(Duration::from_secs(600)));
    }
}

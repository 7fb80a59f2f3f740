//! The admin endpoints' bodies: bans and the allow / deny lists.

use serde::{Deserialize, Serialize};

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

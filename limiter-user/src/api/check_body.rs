//! `POST /v1/check`: one broker verdict over HTTP, for dashboards and scripts.

use serde::{Deserialize, Serialize};

/// The request body.
#[derive(Debug, Serialize, Deserialize)]
pub struct CheckRequest {
    pub action: String,
    pub key: String,
    pub cost: Option<u32>,
}

/// The body of a `/v1/check` answer, allowed or not.
#[derive(Debug, Serialize, Deserialize)]
pub struct CheckAnswer {
    pub action: String,
    /// The action's mode: `enforce`, or `monitor` (refusals answered as allowances).
    pub mode: String,
    /// In monitor mode, the refusal enforcement would have answered (`limited`, `closed`,
    /// `cost_exceeds_burst`, `cost_exceeds_limit`); absent when it would have allowed too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub would_refuse: Option<String>,
    pub allowed: bool,
    pub outcome: String,
    pub limit: u32,
    /// `None` when the action is unlimited.
    pub remaining: Option<u32>,
    /// `None` when waiting will never help (a cost over the burst, a closed action).
    pub retry_after_ms: Option<u64>,
    pub reset_after_ms: Option<u64>,
}

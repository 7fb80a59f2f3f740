//! The answer to a check, shaped so that each front end (the socket protocol, an HTTP 429)
//! can render it without knowing how buckets work.

use serde::Serialize;

/// Why a check passed or not. The numbers are the protocol's wire values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum Outcome {
    Allowed = 0,
    /// The action has no limit (limit 0 on an ordinary action); nothing is counted per key.
    Unlimited = 1,
    /// The bucket cannot pay the cost now; `retry_after_ms` says when it can.
    Limited = 2,
    /// The cost is larger than the bucket can ever hold: waiting will not help.
    CostExceedsBurst = 3,
    /// A security action configured with limit 0: every attempt is refused.
    Closed = 4,
}

impl Outcome {
    pub fn allowed(self) -> bool {
        matches!(self, Outcome::Allowed | Outcome::Unlimited)
    }

    pub fn from_wire(value: u8) -> Option<Self> {
        Some(match value {
            0 => Outcome::Allowed,
            1 => Outcome::Unlimited,
            2 => Outcome::Limited,
            3 => Outcome::CostExceedsBurst,
            4 => Outcome::Closed,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Allowed => "allowed",
            Outcome::Unlimited => "unlimited",
            Outcome::Limited => "limited",
            Outcome::CostExceedsBurst => "cost_exceeds_burst",
            Outcome::Closed => "closed",
        }
    }
}

/// `u64::MAX` milliseconds stands for "never" (a cost above the burst, a closed action).
pub const NEVER_MS: u64 = u64::MAX;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Verdict {
    pub outcome: Outcome,
    pub allowed: bool,
    /// The action's limit per window (`X-RateLimit-Limit`); 0 when unlimited or closed.
    pub limit: u32,
    /// Whole tokens left after this request (`X-RateLimit-Remaining`); `u32::MAX` when
    /// unlimited.
    pub remaining: u32,
    /// Until the bucket can pay this cost; 0 when allowed, [`NEVER_MS`] when it never can.
    pub retry_after_ms: u64,
    /// Until the bucket is full again (`X-RateLimit-Reset`).
    pub reset_after_ms: u64,
}

impl Verdict {
    pub fn new(outcome: Outcome, limit: u32, remaining: u32, retry_ms: u64, reset_ms: u64) -> Self {
        Self {
            outcome,
            allowed: outcome.allowed(),
            limit,
            remaining,
            retry_after_ms: retry_ms,
            reset_after_ms: reset_ms,
        }
    }

    /// `Retry-After` takes whole seconds; rounding up keeps the promise that a client waiting
    /// that long will pass.
    pub fn retry_after_secs(&self) -> u64 {
        self.retry_after_ms.div_ceil(1000)
    }

    /// `X-RateLimit-Reset`, in whole seconds rounded up.
    pub fn reset_after_secs(&self) -> u64 {
        self.reset_after_ms.div_ceil(1000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_round_up() {
        let v = Verdict::new(Outcome::Limited, 10, 0, 200, 6_001);
        assert_eq!((v.retry_after_secs(), v.reset_after_secs()), (1, 7));
        assert!(!v.allowed);
    }

    #[test]
    fn wire_values_round_trip() {
        for value in 0..=255u8 {
            if let Some(outcome) = Outcome::from_wire(value) {
                assert_eq!(outcome as u8, value);
            }
        }
        assert_eq!(Outcome::from_wire(5), None);
    }
}

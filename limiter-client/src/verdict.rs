//! The answers the agent gives, shaped so that each front end (the socket protocol, an HTTP
//! 429, a broker's own error page) can render them without knowing how buckets work.

wire_enum! {
    /// Why a check passed or not. The numbers are the protocol's wire values.
    pub enum Outcome {
        /// The bucket paid the cost.
        Allowed = 0 => "allowed",
        /// The action has no limit (limit 0 on an ordinary action); nothing is counted per key.
        Unlimited = 1 => "unlimited",
        /// The bucket cannot pay the cost now; `retry_after_ms` says when it can.
        Limited = 2 => "limited",
        /// The cost is larger than the bucket can ever hold: waiting will not help.
        CostExceedsBurst = 3 => "cost_exceeds_burst",
        /// A security action configured with limit 0: every attempt is refused.
        Closed = 4 => "closed",
        /// The cost is larger than a quota's whole allowance per period: waiting will not help.
        CostExceedsLimit = 5 => "cost_exceeds_limit",
        /// The connection has collected its strikes (refusals, oversize payloads) within the
        /// action's strike window: the broker closes it and drops what it sends until then.
        /// Protocol 1.3; a client of an earlier version treats it as a refusal.
        Disconnect = 6 => "disconnect",
        /// The payload is larger than the action's `max-payload-bytes`: drop it. Protocol 1.3.
        PayloadTooLarge = 7 => "payload_too_large",
    }
}

impl Outcome {
    /// Whether the request may go ahead. Two outcomes allow, the others refuse; callers that only
    /// need yes or no should not have to know which are which.
    pub fn allowed(self) -> bool {
        matches!(self, Outcome::Allowed | Outcome::Unlimited)
    }
}

/// `u64::MAX` milliseconds stands for "never" (a cost above the burst or a quota's limit, a
/// closed action).
pub const NEVER_MS: u64 = u64::MAX;

/// The answer to a check or a peek: the outcome and the numbers an HTTP front end turns into
/// `X-RateLimit-*` and `Retry-After` headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Why the check passed or not.
    pub outcome: Outcome,
    /// `outcome.allowed()`, kept as a field so the common question needs no method call.
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
    /// A verdict whose `allowed` agrees with its outcome; the only way the agent builds one.
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

/// The answer to a [`check_payload`](crate::Client::check_payload): the verdict to act on,
/// and, for an action in monitor mode, the refusal enforcement would have made (the verdict
/// itself then allows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checked {
    /// What the broker acts on.
    pub verdict: Verdict,
    /// `Some` only in monitor mode, when enforcing would have refused with this outcome.
    pub would_refuse: Option<Outcome>,
}

/// What one reported authentication failure led to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Escalation {
    /// Escalation is not configured.
    Off,
    /// Counted; more failures within the window will ban the address.
    Counted {
        /// Failures within the window so far, this one included.
        failures: u32,
    },
    /// This failure crossed the threshold and the ban was placed.
    Banned,
    /// The address is already banned by this tracker; nothing new happens.
    AlreadyBanned,
    /// The threshold was crossed but the ban could not be placed; the next failure retries.
    BanFailed,
    /// The tracker is full of other addresses; this one is not counted.
    Untracked,
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
        assert_eq!(Outcome::from_wire(5), Some(Outcome::CostExceedsLimit));
        assert_eq!(Outcome::from_wire(6), Some(Outcome::Disconnect));
        assert_eq!(Outcome::from_wire(7), Some(Outcome::PayloadTooLarge));
        assert_eq!(Outcome::from_wire(8), None);
        assert!(!Outcome::Disconnect.allowed() && !Outcome::PayloadTooLarge.allowed());
    }
}

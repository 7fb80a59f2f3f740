//! Quotas shared by the fleet: one Lua script, run by its SHA, checks and spends a key's
//! allowance in one atomic step on Redis's clock, so every agent spends from the same count
//! and the windows are cut by one clock. A refusal writes nothing; an allowed check keeps
//! the key until a margin after its window ends.

use std::{sync::LazyLock, time::Duration};

use redis::{RedisResult, Script};

use super::Redis;
use crate::duration_units::duration_ms;

static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/quota.lua")));

/// A quota as Redis runs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedQuota {
    pub limit: u32,
    /// A whole number of milliseconds (the settings check it), windows aligned to the epoch.
    pub period: Duration,
    /// How long a key outlives its window.
    pub margin: Duration,
}

/// What Redis answered, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuotaAnswer {
    pub allowed: bool,
    pub remaining: u32,
    /// `None`: the cost is above the limit and can never fit.
    pub retry_after_ms: Option<u64>,
    pub reset_after_ms: u64,
}

impl SharedQuota {
    /// Checks `cost` against the quota stored under `key` (a whole Redis key, hash-tagged by
    /// the caller), spending it if it fits and `spend` is set.
    pub async fn check(
        &self,
        redis: &Redis,
        key: &[u8],
        cost: u32,
        spend: bool,
    ) -> RedisResult<QuotaAnswer> {
        let mut invocation = SCRIPT.prepare_invoke();
        invocation
            .key(key)
            .arg(self.limit)
            .arg(duration_ms(self.period))
            .arg(duration_ms(self.margin))
            .arg(cost)
            .arg(u8::from(spend));
        let (allowed, remaining, retry, reset): (i64, i64, i64, i64) =
            redis.run_script(&invocation).await?;
        Ok(QuotaAnswer {
            allowed: allowed == 1,
            remaining: u32::try_from(remaining).unwrap_or(0),
            retry_after_ms: u64::try_from(retry).ok(),
            reset_after_ms: u64::try_from(reset).unwrap_or(0),
        })
    }
}

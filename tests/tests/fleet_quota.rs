//! Shared quotas on real Redis servers this test starts, a standalone server and a
//! three-master cluster: the one script every agent runs, all or nothing under concurrency
//! across separate connections (one per agent), on Redis's clock. Needs no root, never skips.

use std::time::Duration;

use futures::future::join_all;
use limiter::fleet::{QuotaAnswer, Redis, RedisTarget, SharedQuota};
use limiter_tests::redis::{RedisCluster, RedisServer};

/// A separate connection, as each agent of a fleet has its own.
fn agent(url: &str) -> Redis {
    Redis::connect(&RedisTarget::parse(url).unwrap()).unwrap()
}

fn quota(limit: u32, period: Duration) -> SharedQuota {
    SharedQuota {
        limit,
        period,
        margin: Duration::from_secs(1),
    }
}

const DAY: Duration = Duration::from_secs(86_400);

async fn spends_all_or_nothing_and_keeps_the_key_a_margin_past_its_window(url: &str) {
    let redis = agent(url);
    let quota = SharedQuota {
        margin: Duration::from_secs(3_600),
        ..quota(5, DAY)
    };
    let key = b"limiter:quota:sends:{tenant}";
    let first = quota.check(&redis, key, 3, true).await.unwrap();
    assert!(first.allowed);
    assert_eq!(first.remaining, 2);
    // Until midnight UTC on Redis's clock: at most a day, and the same for a refusal.
    assert!(
        (1..=86_400_000).contains(&first.reset_after_ms),
        "{first:?}"
    );
    let refused = quota.check(&redis, key, 3, true).await.unwrap();
    assert!(!refused.allowed);
    assert_eq!(refused.remaining, 2, "a refusal spends nothing");
    let retry = refused.retry_after_ms.unwrap();
    assert!(retry.abs_diff(first.reset_after_ms) < 1_000, "{refused:?}");
    let never = quota.check(&redis, key, 6, true).await.unwrap();
    assert_eq!((never.allowed, never.retry_after_ms), (false, None));
    let peek = quota.check(&redis, key, 2, false).await.unwrap();
    assert_eq!((peek.allowed, peek.remaining), (true, 0));
    let spent: u32 = redis
        .query(redis::cmd("HGET").arg(&key[..]).arg("n"))
        .await
        .unwrap();
    assert_eq!(spent, 3, "refusals and peeks wrote nothing");
    let ttl_ms: u64 = redis.query(redis::cmd("PTTL").arg(&key[..])).await.unwrap();
    let expected = retry + 3_600_000;
    assert!(
        ttl_ms.abs_diff(expected) < 2_000,
        "{ttl_ms} ms, not {expected}"
    );
}

#[tokio::test]
async fn a_quota_on_one_server_and_on_a_cluster() {
    let server = RedisServer::start().unwrap();
    spends_all_or_nothing_and_keeps_the_key_a_margin_past_its_window(&server.url()).await;
    let cluster = RedisCluster::start(3).unwrap();
    spends_all_or_nothing_and_keeps_the_key_a_margin_past_its_window(&cluster.url()).await;
}

/// 200 checks of cost 3 at a limit of 50, at once through four agents' connections: 16 fit
/// (48), and no refused check spent anything, so the count reads exactly 48.
async fn two_hundred_parallel_checks_of_three_fit_sixteen(url: &str) {
    let agents: Vec<Redis> = (0..4).map(|_| agent(url)).collect();
    let quota = quota(50, DAY);
    let key = b"limiter:quota:batch:{tenant-7}";
    let answers: Vec<QuotaAnswer> = join_all((0..200).map(|i| {
        let redis = agents[i % agents.len()].clone();
        async move { quota.check(&redis, key, 3, true).await.unwrap() }
    }))
    .await;
    let admitted = answers.iter().filter(|a| a.allowed).count();
    assert_eq!(admitted, 16);
    assert!(
        answers
            .iter()
            .filter(|a| !a.allowed)
            .all(|a| a.remaining == 2)
    );
    let spent: u32 = agents[0]
        .query(redis::cmd("HGET").arg(&key[..]).arg("n"))
        .await
        .unwrap();
    assert_eq!(spent, 48);
}

#[tokio::test]
async fn parallel_checks_through_four_agents_are_all_or_nothing() {
    let server = RedisServer::start().unwrap();
    two_hundred_parallel_checks_of_three_fit_sixteen(&server.url()).await;
    let cluster = RedisCluster::start(3).unwrap();
    two_hundred_parallel_checks_of_three_fit_sixteen(&cluster.url()).await;
}

#[tokio::test]
async fn the_window_rolls_over_on_redis_clock() {
    let server = RedisServer::start().unwrap();
    let redis = agent(&server.url());
    let quota = quota(2, Duration::from_secs(1));
    // Both spent in one window (a check straddling the edge would find one left, so such a
    // try starts again on a fresh key; two edges in a row cannot happen within 1 s).
    let mut tries = (0..3).map(|i| format!("limiter:quota:tick:{{k{i}}}"));
    let (key, refused) = loop {
        let key = tries.next().expect("one try within a window");
        assert!(
            quota
                .check(&redis, key.as_bytes(), 2, true)
                .await
                .unwrap()
                .allowed
        );
        let second = quota.check(&redis, key.as_bytes(), 1, true).await.unwrap();
        if !second.allowed {
            break (key, second);
        }
    };
    let wait = refused.retry_after_ms.unwrap();
    assert!((1..=1_000).contains(&wait), "{refused:?}");
    // The promise: who waits retry_after_ms finds the allowance back.
    tokio::time::sleep(Duration::from_millis(wait)).await;
    let back = quota.check(&redis, key.as_bytes(), 2, true).await.unwrap();
    assert!(back.allowed, "{back:?}");
}

//! Shared quotas on real Redis servers this test starts, a standalone server and a
//! three-master cluster: the one script every agent runs, on Redis's clock, and agents (real
//! broker limiters serving the real protocol) spending one quota all or nothing under
//! concurrency, with their local share while Redis is away. Needs no root, never skips.

use std::time::Duration;

use futures::future::join_all;
use limiter::fleet::{Redis, RedisTarget, SharedQuota};
use limiter_client::Outcome;
use limiter_tests::{
    fleet::FleetAgent,
    redis::{RedisCluster, RedisServer},
};

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

const SENDS_50: &str = "[actions.sends]\nkind = \"quota\"\nlimit = 50\nkey = \"user\"\n";

/// Long enough that no check on this shared, loaded machine falls back: a local decision
/// would count as an error here (the fallback test covers it).
const PATIENT: Duration = Duration::from_secs(2);

/// 200 checks of cost 3 at a daily quota of 50, at once through four agents (50 pipelined on
/// each one's socket): 16 fit (48), and no refused check spent anything, so Redis's count
/// reads exactly 48.
async fn two_hundred_checks_of_three_through_four_agents(url: &str, tenant: &str) -> u32 {
    let mut agents = Vec::new();
    for _ in 0..4 {
        agents.push(FleetAgent::start(url, SENDS_50, PATIENT, 4).await.unwrap());
    }
    let mut clients = Vec::new();
    for agent in &agents {
        clients.push(agent.client().await.unwrap());
    }
    let verdicts = join_all(clients.iter().flat_map(|client| {
        (0..50).map(move |_| async move { client.check("sends", tenant, 3).await.unwrap() })
    }))
    .await;
    let mut remaining: Vec<u32> = verdicts
        .iter()
        .filter(|v| v.allowed)
        .map(|v| v.remaining)
        .collect();
    remaining.sort_unstable();
    // One count, spent 3 at a time however the checks interleaved.
    assert_eq!(remaining, (0..16).map(|n| 2 + 3 * n).collect::<Vec<_>>());
    for refused in verdicts.iter().filter(|v| !v.allowed) {
        assert_eq!(
            (refused.outcome, refused.remaining, refused.limit),
            (Outcome::Limited, 2, 50)
        );
        // Until midnight UTC on Redis's clock.
        assert!(
            (1..=86_400_000).contains(&refused.retry_after_ms),
            "{refused:?}"
        );
    }
    for agent in &agents {
        assert_eq!(agent.limiter.shared_status().unwrap().fallback_checks, 0);
    }
    let admitted = verdicts.iter().filter(|v| v.allowed).count();
    assert_eq!(admitted, 16);
    agent(url)
        .query(
            redis::cmd("HGET")
                .arg(format!("limiter:sends:{{{tenant}}}"))
                .arg("n"),
        )
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_agents_on_one_redis_spend_a_quota_all_or_nothing() {
    let server = RedisServer::start().unwrap();
    let spent = two_hundred_checks_of_three_through_four_agents(&server.url(), "tenant-7").await;
    assert_eq!(spent, 48);
    let keys: Vec<String> = server.query(redis::cmd("KEYS").arg("*")).unwrap();
    assert_eq!(keys, ["limiter:sends:{tenant-7}"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_agents_on_a_three_master_cluster_spend_a_quota_all_or_nothing() {
    let cluster = RedisCluster::start(3).unwrap();
    for tenant in ["t1", "t2", "t3", "t4"] {
        let spent = two_hundred_checks_of_three_through_four_agents(&cluster.url(), tenant).await;
        assert_eq!(spent, 48, "{tenant}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_redis_leaves_each_agent_its_share_of_the_quota() {
    let mut server = RedisServer::start().unwrap();
    let agent = FleetAgent::start(
        &server.url(),
        "[actions.sends]\nkind = \"quota\"\nlimit = 10\nkey = \"user\"\n",
        Duration::from_millis(300),
        2,
    )
    .await
    .unwrap();
    let client = agent.client().await.unwrap();
    assert_eq!(client.check("sends", "t", 4).await.unwrap().remaining, 6);
    server.kill().unwrap();
    // Alone, this agent allows its share, 10 / 2 = 5, all or nothing as ever.
    let local = client.check("sends", "t", 4).await.unwrap();
    assert_eq!((local.allowed, local.limit, local.remaining), (true, 5, 1));
    let refused = client.check("sends", "t", 2).await.unwrap();
    assert_eq!((refused.outcome, refused.remaining), (Outcome::Limited, 1));
    let never = client.check("sends", "t", 6).await.unwrap();
    assert_eq!(never.outcome, Outcome::CostExceedsLimit);
    assert!(!agent.limiter.shared_status().unwrap().redis_up);
    server.restart().unwrap();
    agent.wait_redis_up(true).await;
    // Redis decides again: the whole quota of its (restarted, empty) count.
    let back = client.check("sends", "t", 10).await.unwrap();
    assert_eq!((back.allowed, back.limit, back.remaining), (true, 10, 0));
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

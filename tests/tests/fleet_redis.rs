//! The fleet's connection against real Redis servers this test starts: a standalone server
//! and a three-master cluster. Needs no root, but never skips: without `redis-server` it
//! fails, naming `cargo xtask setup`.

use std::time::Duration;

use limiter::fleet::{Redis, RedisTarget};
use limiter_tests::redis::{RedisCluster, RedisServer};

fn connect(url: &str) -> Redis {
    Redis::connect(&RedisTarget::parse(url).unwrap()).unwrap()
}

/// A script that touches one key and reports which server ran it: on a cluster the client
/// must route it to the key's slot, or Redis refuses it (MOVED / CROSSSLOT).
const INCR_SCRIPT: &str = "return redis.call('INCRBY', KEYS[1], ARGV[1])";

async fn scripts_and_commands_work(redis: &Redis) {
    let script = redis::Script::new(INCR_SCRIPT);
    for (i, key) in ["fleet:{a}", "fleet:{b}", "fleet:{c}", "fleet:{d}"]
        .into_iter()
        .enumerate()
    {
        let mut invocation = script.prepare_invoke();
        invocation.key(key).arg(i + 1);
        let first: i64 = redis.run_script(&invocation).await.unwrap();
        let second: i64 = redis.run_script(&invocation).await.unwrap();
        assert_eq!((first, second), (i as i64 + 1, 2 * (i as i64 + 1)), "{key}");
        let read: i64 = redis.query(redis::cmd("GET").arg(key)).await.unwrap();
        assert_eq!(read, second);
    }
}

#[tokio::test]
async fn one_server_runs_scripts_and_comes_back_after_a_restart() {
    let mut server = RedisServer::start().unwrap();
    let redis = connect(&server.url());
    scripts_and_commands_work(&redis).await;
    server.restart().unwrap();
    // The handle reconnects by itself; the restarted server forgot the script (NOSCRIPT) and
    // the keys (no persistence), and both are dealt with.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while redis.query::<String>(&redis::cmd("PING")).await.is_err() {
        assert!(tokio::time::Instant::now() < deadline, "no reconnection");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    scripts_and_commands_work(&redis).await;
}

#[tokio::test]
async fn a_cluster_routes_each_script_to_its_keys_slot() {
    let cluster = RedisCluster::start(3).unwrap();
    let redis = connect(&cluster.url());
    assert!(redis.target().is_cluster());
    scripts_and_commands_work(&redis).await;
    // The four keys spread over the masters: every node holds some of the keyspace.
    let held: Vec<i64> = cluster
        .nodes()
        .iter()
        .map(|n| n.query(&redis::cmd("DBSIZE")).unwrap())
        .collect();
    assert_eq!(held.iter().sum::<i64>(), 4, "{held:?}");
}

async fn publish_reaches_a_subscriber(redis: &Redis) {
    use futures::StreamExt;

    let mut pubsub = redis.pubsub().await.unwrap();
    pubsub.subscribe("fleet-test").await.unwrap();
    // On a cluster PUBLISH counts only the receiving node's subscribers; the message itself
    // reaches every node's.
    let _: i64 = redis
        .query(redis::cmd("PUBLISH").arg("fleet-test").arg("hello"))
        .await
        .unwrap();
    let message = tokio::time::timeout(Duration::from_secs(5), pubsub.on_message().next())
        .await
        .expect("the message within 5 s")
        .expect("the subscription open");
    assert_eq!(message.get_payload::<String>().unwrap(), "hello");
}

#[tokio::test]
async fn pub_sub_connections_come_from_the_same_config() {
    let server = RedisServer::start().unwrap();
    publish_reaches_a_subscriber(&connect(&server.url())).await;
    let cluster = RedisCluster::start(3).unwrap();
    publish_reaches_a_subscriber(&connect(&cluster.url())).await;
}

// ---- Shared buckets: agents of one fleet on one Redis -------------------------------------

use limiter_client::{NEVER_MS, Outcome, Verdict};
use limiter_tests::fleet::{FleetAgent, assert_exactly};

const LOGIN_50: &str = "[actions.login]\nlimit = 50\nwindow = \"60s\"\nkey = \"user\"\n";
/// The fallback test's check timeout: the default (50 ms) would also fall back on a check
/// that this shared, loaded machine merely delays, which the test would count as an error.
const TIMEOUT: Duration = Duration::from_millis(300);
/// The exactness tests' check timeout: long enough that no check on this shared, loaded
/// machine falls back (a fallback is a local decision, which those tests would count as an
/// error; the fallback test covers it).
const PATIENT: Duration = Duration::from_secs(2);

/// 200 checks at once, 50 through each of four agents, each agent's 50 pipelined on one
/// connection; returns every verdict.
async fn two_hundred_at_once(agents: &[FleetAgent], key: &str) -> Vec<Verdict> {
    let mut clients = Vec::new();
    for agent in agents {
        clients.push(agent.client().await.unwrap());
    }
    let checks = clients.iter().flat_map(|client| {
        (0..50).map(move |_| async move { client.check("login", key, 1).await.unwrap() })
    });
    futures::future::join_all(checks).await
}

/// Exactly `limit` admitted, and every refusal's numbers those of a bucket of `limit` per
/// minute just emptied.
fn assert_exactly_per_minute(verdicts: &[Verdict], limit: u32) {
    assert_exactly(verdicts, limit);
    for refused in verdicts.iter().filter(|v| !v.allowed) {
        assert_eq!(refused.outcome, Outcome::Limited);
        assert_eq!(refused.remaining, 0);
        // One token per 1.2 s; the bucket is full a minute after the first check.
        assert!((1..=1_200).contains(&refused.retry_after_ms), "{refused:?}");
        assert!(
            (58_000..=60_000).contains(&refused.reset_after_ms),
            "{refused:?}"
        );
    }
}

async fn four_agents(url: &str) -> Vec<FleetAgent> {
    let mut agents = Vec::new();
    for _ in 0..4 {
        agents.push(FleetAgent::start(url, LOGIN_50, PATIENT, 4).await.unwrap());
    }
    agents
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_agents_on_one_redis_admit_exactly_the_limit() {
    let server = RedisServer::start().unwrap();
    let agents = four_agents(&server.url()).await;
    let verdicts = two_hundred_at_once(&agents, "alice").await;
    assert_exactly_per_minute(&verdicts, 50);
    // Every check went to Redis: none was decided locally, where 4 agents would each have
    // admitted 12.
    for agent in &agents {
        let status = agent.limiter.shared_status().unwrap();
        assert!(status.redis_up);
        assert_eq!(status.fallback_checks, 0);
    }
    // One key in Redis, under the documented name, expiring when the bucket is full again.
    let ttl: i64 = server
        .query(redis::cmd("PTTL").arg("limiter:login:{alice}"))
        .unwrap();
    assert!((58_000..=60_000).contains(&ttl), "{ttl}");
    let keys: Vec<String> = server.query(redis::cmd("KEYS").arg("*")).unwrap();
    assert_eq!(keys, ["limiter:login:{alice}"]);
}

/// A key's override holds across the fleet as the action's own limit does: 200 checks at
/// once through four agents admit exactly the key's limit, raised for one key and lowered
/// for another, with the fleet's bucket of that key in Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_keys_override_holds_across_the_fleet() {
    let server = RedisServer::start().unwrap();
    let actions = format!("{LOGIN_50}[actions.login.overrides]\n\"vip\" = 120\n\"bot\" = 5\n");
    let mut agents = Vec::new();
    for _ in 0..4 {
        agents.push(
            FleetAgent::start(&server.url(), &actions, PATIENT, 4)
                .await
                .unwrap(),
        );
    }
    for (key, limit) in [("vip", 120), ("bot", 5), ("carol", 50)] {
        let verdicts = two_hundred_at_once(&agents, key).await;
        assert_exactly(&verdicts, limit);
        assert!(verdicts.iter().all(|v| v.limit == limit), "{key}");
    }
    for agent in &agents {
        assert_eq!(agent.limiter.shared_status().unwrap().fallback_checks, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_agents_on_a_three_master_cluster_admit_exactly_the_limit() {
    let cluster = RedisCluster::start(3).unwrap();
    let agents = four_agents(&cluster.url()).await;
    // Keys on every master: each one's bucket is exact on its own node.
    let users = ["alice", "bob", "carol", "dave", "erin", "frank"];
    for user in users {
        assert_exactly_per_minute(&two_hundred_at_once(&agents, user).await, 50);
    }
    let held: Vec<i64> = cluster
        .nodes()
        .iter()
        .map(|n| n.query(&redis::cmd("DBSIZE")).unwrap())
        .collect();
    assert_eq!(held.iter().sum::<i64>(), users.len() as i64);
    assert!(held.iter().filter(|n| **n > 0).count() >= 2, "{held:?}");
}

/// A shared bytes budget spends each check's cost in Redis as the local bucket does, and a
/// shared `user+topic` action names one Redis bucket per user and subtree: 200 checks of
/// 10,000 bytes at once through four agents admit exactly the 100 that fit in 1,000,000
/// (one byte back every 3.6 ms: no message's worth during the test, a few bytes at most), and 200 publishes to
/// two topics of one subtree exactly its 30, leaving another subtree's whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn costs_and_topic_keys_hold_across_the_fleet() {
    let server = RedisServer::start().unwrap();
    let actions = "[actions.pub_bytes]\nlimit = 1000000\nwindow = \"1h\"\nkey = \"user\"\n\
                   [actions.pub_topic]\nlimit = 30\nwindow = \"1h\"\nkey = \"user+topic\"\n\
                   topic-levels = 2\n";
    let mut agents = Vec::new();
    for _ in 0..4 {
        agents.push(
            FleetAgent::start(&server.url(), actions, PATIENT, 4)
                .await
                .unwrap(),
        );
    }
    let mut clients = Vec::new();
    for agent in &agents {
        clients.push(agent.client().await.unwrap());
    }
    let at_once = |action: &'static str, keys: Vec<Vec<u8>>, cost: u32| {
        let checks = keys.into_iter().enumerate().map(|(i, key)| {
            let client = &clients[i % clients.len()];
            async move { client.check(action, key, cost).await.unwrap() }
        });
        futures::future::join_all(checks)
    };
    let bytes = at_once("pub_bytes", vec![b"alice".to_vec(); 200], 10_000).await;
    // One bucket spent 10,000 at a time: every admitted check saw a different remainder, in
    // whole messages (a byte comes back every 3.6 ms, so a slow run sees a few more bytes
    // left, never a message's worth).
    let mut left: Vec<u32> = bytes
        .iter()
        .filter(|v| v.allowed)
        .map(|v| v.remaining / 10_000 * 10_000)
        .collect();
    left.sort_unstable();
    assert_eq!(left, (0..100).map(|i| i * 10_000).collect::<Vec<_>>());
    assert!(
        bytes
            .iter()
            .filter(|v| !v.allowed)
            .all(|v| v.outcome == Outcome::Limited)
    );
    let topic = |t: &str| limiter_client::user_topic_key("bob", t).unwrap();
    let keys = (0..200)
        .map(|i| topic(if i % 2 == 0 { "room/a/x" } else { "room/a/y" }))
        .collect();
    assert_exactly(&at_once("pub_topic", keys, 1).await, 30);
    let other = clients[0]
        .check("pub_topic", topic("room/b/x"), 1)
        .await
        .unwrap();
    assert_eq!((other.allowed, other.remaining), (true, 29));
    for agent in &agents {
        assert_eq!(agent.limiter.shared_status().unwrap().fallback_checks, 0);
    }
    // The subtree's name: `bob`, the NUL, `room/a`, in hex (a NUL is not printable).
    let mut keys: Vec<String> = server.query(redis::cmd("KEYS").arg("*")).unwrap();
    keys.sort();
    assert_eq!(
        keys,
        [
            "limiter:pub_bytes:{alice}",
            "limiter:pub_topic:{hex:626f6200726f6f6d2f61}",
            "limiter:pub_topic:{hex:626f6200726f6f6d2f62}",
        ]
    );
}

#[tokio::test]
async fn shared_verdicts_carry_the_local_buckets_numbers() {
    let server = RedisServer::start().unwrap();
    let agent = FleetAgent::start(
        &server.url(),
        "[actions.export]\nlimit = 10\nwindow = \"10s\"\nkey = \"user\"\n",
        PATIENT,
        2,
    )
    .await
    .unwrap();
    let client = agent.client().await.unwrap();
    // A fresh bucket of 10, one token a second; a peek spends nothing.
    let peek = client.peek("export", "alice", 7).await.unwrap();
    assert!(peek.allowed);
    assert_eq!(peek.remaining, 3);
    let taken = client.check("export", "alice", 7).await.unwrap();
    assert!(taken.allowed);
    assert_eq!(taken.remaining, 3);
    assert!((6_990..=7_000).contains(&taken.reset_after_ms), "{taken:?}");
    // 4 more do not fit in 3 and spend nothing: the wait is one token's.
    let refused = client.check("export", "alice", 4).await.unwrap();
    assert_eq!(refused.outcome, Outcome::Limited);
    assert_eq!(refused.remaining, 3);
    assert!(
        (990..=1_000).contains(&refused.retry_after_ms),
        "{refused:?}"
    );
    assert!(
        (6_990..=7_000).contains(&refused.reset_after_ms),
        "{refused:?}"
    );
    let fits = client.check("export", "alice", 3).await.unwrap();
    assert!(fits.allowed);
    assert_eq!(fits.remaining, 0);
    // More than the bucket can ever hold.
    let never = client.check("export", "alice", 11).await.unwrap();
    assert_eq!(never.outcome, Outcome::CostExceedsBurst);
    assert_eq!(never.retry_after_ms, NEVER_MS);
    assert_eq!(never.limit, 10);
    // A reset (the socket's group may send one) forgets the shared bucket, for every agent.
    assert!(client.reset("export", "alice").await.unwrap());
    let exists: i64 = server
        .query(redis::cmd("EXISTS").arg("limiter:export:{alice}"))
        .unwrap();
    assert_eq!(exists, 0);
    assert_eq!(
        client.check("export", "alice", 10).await.unwrap().remaining,
        0
    );
    assert_eq!(agent.limiter.shared_status().unwrap().fallback_checks, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_redis_is_replaced_by_local_shares_and_comes_back() {
    let mut server = RedisServer::start().unwrap();
    let agent = FleetAgent::start(
        &server.url(),
        "[actions.login]\nlimit = 10\nwindow = \"60s\"\nkey = \"user\"\n",
        TIMEOUT,
        2,
    )
    .await
    .unwrap();
    let client = agent.client().await.unwrap();
    assert!(client.check("login", "before", 1).await.unwrap().allowed);
    let start = agent.limiter.shared_status().unwrap();
    assert!(start.redis_up);
    assert_eq!((start.fallback_checks, start.switches_to_local), (0, 0));

    server.kill().unwrap();
    // The first check after the kill finds Redis gone within its timeout; every later one
    // skips Redis. Alone, this agent allows its share: 10 / 2 replicas = 5 of a fresh key.
    let began = std::time::Instant::now();
    let mut allowed = 0;
    for _ in 0..10 {
        let verdict = client.check("login", "during", 1).await.unwrap();
        allowed += u32::from(verdict.allowed);
        assert_eq!(verdict.limit, 5, "{verdict:?}");
    }
    assert_eq!(allowed, 5);
    assert!(
        began.elapsed() < TIMEOUT * 10,
        "ten checks took {:?}: a dead Redis cost more than one timeout",
        began.elapsed()
    );
    let down = agent.limiter.shared_status().unwrap();
    assert!(!down.redis_up);
    assert_eq!(down.fallback_checks, 10);
    assert_eq!(down.switches_to_local, 1);

    server.restart().unwrap();
    agent.wait_redis_up(true).await;
    let back = agent.limiter.shared_status().unwrap();
    assert_eq!(back.switches_to_redis, start.switches_to_redis + 1);
    // Redis decides again: the whole limit, from its own (empty, restarted) bucket.
    let mut allowed = 0;
    for _ in 0..12 {
        let verdict = client.check("login", "after", 1).await.unwrap();
        allowed += u32::from(verdict.allowed);
    }
    assert_eq!(allowed, 10);
    let after = agent.limiter.shared_status().unwrap();
    assert_eq!(
        after.fallback_checks, 10,
        "nothing fell back once Redis was back"
    );
    let keys: Vec<String> = server.query(redis::cmd("KEYS").arg("*")).unwrap();
    assert_eq!(keys, ["limiter:login:{after}"]);

    // A Redis that stops answering without closing anything: the check waits its timeout,
    // no longer, and is decided locally.
    server.pause().unwrap();
    let began = std::time::Instant::now();
    let verdict = client.check("login", "stalled", 1).await.unwrap();
    let waited = began.elapsed();
    assert!(verdict.allowed);
    assert_eq!(verdict.limit, 5);
    assert!(
        waited >= TIMEOUT,
        "answered in {waited:?}, before the timeout"
    );
    assert!(
        waited < TIMEOUT + Duration::from_millis(400),
        "blocked {waited:?}, past the {TIMEOUT:?} timeout"
    );
    let stalled = agent.limiter.shared_status().unwrap();
    assert!(!stalled.redis_up);
    assert_eq!(stalled.fallback_checks, 11);
    assert_eq!(stalled.switches_to_local, 2);
    server.resume().unwrap();
    agent.wait_redis_up(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_waits_for_a_slow_redis_up_to_its_own_timeout() {
    let server = RedisServer::start().unwrap();
    let agent = FleetAgent::start(
        &server.url(),
        "[actions.login]\nlimit = 10\nwindow = \"60s\"\nkey = \"user\"\n",
        Duration::from_secs(3),
        2,
    )
    .await
    .unwrap();
    let client = agent.client().await.unwrap();
    // Redis answers after 800 ms: later than the client library's own default (500 ms), well
    // within this agent's check timeout, so Redis decides.
    server.pause().unwrap();
    let resume = std::thread::scope(|scope| {
        let resumer = scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(800));
            server.resume()
        });
        let verdict = tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(client.check("login", "slow", 1))
        })
        .unwrap();
        (resumer.join().unwrap(), verdict)
    });
    resume.0.unwrap();
    let verdict = resume.1;
    assert!(verdict.allowed);
    assert_eq!(
        verdict.limit, 10,
        "decided by Redis, not locally: {verdict:?}"
    );
    let status = agent.limiter.shared_status().unwrap();
    assert!(status.redis_up);
    assert_eq!(status.fallback_checks, 0);
}

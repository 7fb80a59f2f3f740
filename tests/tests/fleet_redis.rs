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

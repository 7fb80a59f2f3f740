//! Sessions shared by a fleet, on a real Redis server this test starts: agents (real broker
//! limiters serving the real protocol, each with its own connection to Redis) holding one
//! count of a key's sessions for the whole fleet, exactly under concurrency, released at once
//! with the broker's connection, lapsing with a dead agent's leases, and decided at each
//! agent's share while Redis is away. Needs no root, never skips.

use std::time::Duration;

use futures::future::join_all;
use limiter::fleet::{FleetConfig, RedisTarget};
use limiter_client::{Client, Outcome, Verdict};
use limiter_tests::{
    fleet::{FleetAgent, two_workers},
    redis::RedisServer,
};

const LOGINS_2: &str = "[actions.logins]\nkind = \"concurrency\"\nlimit = 2\nkey = \"user\"\n";

/// Long enough that no acquire on this shared, loaded machine falls back: a local decision
/// would count as an error here (the fallback test covers it).
const PATIENT: Duration = Duration::from_secs(2);

/// A lease short enough to wait out in a test.
const LEASE: Duration = Duration::from_secs(2);

fn fleet(url: &str) -> FleetConfig {
    FleetConfig {
        check_timeout: PATIENT,
        session_lease: LEASE,
        ..FleetConfig::new(RedisTarget::parse(url).unwrap())
    }
}

async fn acquire(client: &Client, key: &str, session: &str) -> Verdict {
    client.acquire("logins", key, session).await.unwrap()
}

/// Polls until `client` can take `session` of `key`, within `bound`; how long it took.
async fn acquired_within(client: &Client, key: &str, session: &str, bound: Duration) -> Duration {
    let start = tokio::time::Instant::now();
    loop {
        if acquire(client, key, session).await.allowed {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < bound,
            "{session} of {key} not free within {bound:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn leases(server: &RedisServer, key: &str) -> u32 {
    server
        .query(redis::cmd("ZCARD").arg(format!("limiter:logins:{{{key}}}")))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agents_hold_one_count_and_a_release_or_a_closed_connection_makes_room() {
    let server = RedisServer::start().unwrap();
    let a = FleetAgent::start_fleet(&fleet(&server.url()), LOGINS_2)
        .await
        .unwrap();
    let b = FleetAgent::start_fleet(&fleet(&server.url()), LOGINS_2)
        .await
        .unwrap();
    let (broker_a, broker_b) = (a.client().await.unwrap(), b.client().await.unwrap());
    let first = acquire(&broker_a, "alice", "c1").await;
    assert_eq!(
        (first.outcome, first.limit, first.remaining),
        (Outcome::Allowed, 2, 1)
    );
    assert!(acquire(&broker_a, "alice", "c2").await.allowed);
    let third = acquire(&broker_b, "alice", "c3").await;
    assert_eq!(
        (third.outcome, third.remaining),
        (Outcome::Limited, 0),
        "the fleet's limit, not each agent's"
    );
    assert!(
        acquire(&broker_a, "alice", "c2").await.allowed,
        "held already: not counted twice"
    );
    assert!(acquire(&broker_b, "bob", "c1").await.allowed, "another key");
    assert_eq!(leases(&server, "alice"), 2);
    // A check says whether one more would fit, and takes none.
    let check = broker_b.check("logins", "alice", 1).await.unwrap();
    assert_eq!((check.outcome, check.limit), (Outcome::Limited, 2));

    assert!(broker_a.release("logins", "alice", "c1").await.unwrap());
    assert!(
        acquire(&broker_b, "alice", "c3").await.allowed,
        "a release makes room"
    );
    assert!(!acquire(&broker_a, "alice", "c4").await.allowed);
    let held = |agent: &FleetAgent| {
        agent
            .limiter
            .stats()
            .into_iter()
            .find(|s| s.action == "logins")
            .unwrap()
            .counts
            .sessions_held
    };
    assert_eq!((held(&a), held(&b)), (1, 2), "each agent's brokers' part");

    // The broker's protocol connection ends: its session is freed at once, no lease waited.
    drop(broker_a);
    let waited = acquired_within(&broker_b, "alice", "c4", LEASE / 2).await;
    assert!(waited < LEASE / 2, "{waited:?}");
    assert_eq!(held(&a), 0);
    for agent in [&a, &b] {
        assert_eq!(agent.limiter.shared_status().unwrap().fallback_checks, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_acquires_through_two_agents_take_exactly_the_limit() {
    let server = RedisServer::start().unwrap();
    let sessions = "[actions.logins]\nkind = \"concurrency\"\nlimit = 25\nkey = \"user\"\n";
    let agents = [
        FleetAgent::start_fleet(&fleet(&server.url()), sessions)
            .await
            .unwrap(),
        FleetAgent::start_fleet(&fleet(&server.url()), sessions)
            .await
            .unwrap(),
    ];
    let mut brokers = Vec::new();
    for agent in &agents {
        for _ in 0..4 {
            brokers.push(agent.client().await.unwrap());
        }
    }
    // 8 brokers, 200 sessions of one user at once, pipelined.
    let asked = brokers.iter().enumerate().flat_map(|(b, client)| {
        (0..25).map(move |n| async move {
            client
                .acquire("logins", "alice", format!("b{b}-s{n}"))
                .await
                .unwrap()
        })
    });
    let verdicts = join_all(asked).await;
    let allowed: Vec<&Verdict> = verdicts.iter().filter(|v| v.allowed).collect();
    assert_eq!(allowed.len(), 25, "exactly the limit, fleet-wide");
    assert_eq!(leases(&server, "alice"), 25);
    let mut remaining: Vec<u32> = allowed.iter().map(|v| v.remaining).collect();
    remaining.sort_unstable();
    assert_eq!(
        remaining,
        (0..25).collect::<Vec<_>>(),
        "one count, taken one by one"
    );
    for agent in &agents {
        assert_eq!(agent.limiter.shared_status().unwrap().fallback_checks, 0);
    }
}

/// Agent A's runtime torn down as a process's death tears it down: no task of it runs again,
/// so it neither releases nor renews. Its brokers' sessions are free once their leases lapse,
/// and not before.
#[test]
fn a_dead_agents_sessions_are_free_within_the_lease() {
    let server = RedisServer::start().unwrap();
    let main = two_workers();
    let doomed = two_workers();
    let a = doomed
        .block_on(FleetAgent::start_fleet(&fleet(&server.url()), LOGINS_2))
        .unwrap();
    main.block_on(async {
        let b = FleetAgent::start_fleet(&fleet(&server.url()), LOGINS_2)
            .await
            .unwrap();
        let broker_a = a.client().await.unwrap();
        let broker_b = b.client().await.unwrap();
        assert!(acquire(&broker_a, "alice", "c1").await.allowed);
        assert!(acquire(&broker_a, "alice", "c2").await.allowed);
        // Renewed meanwhile: a lease and more later, A's sessions still hold.
        tokio::time::sleep(LEASE + LEASE / 2).await;
        assert!(!acquire(&broker_b, "alice", "c3").await.allowed);
        doomed.shutdown_background();
        let died = tokio::time::Instant::now();
        assert_eq!(
            leases(&server, "alice"),
            2,
            "nothing released by a dead agent"
        );
        acquired_within(&broker_b, "alice", "c3", LEASE * 3).await;
        let freed = died.elapsed();
        // Renewed at most a third of a lease before the death: lapsed after the rest of it.
        assert!(
            (LEASE / 2..=LEASE + Duration::from_millis(500)).contains(&freed),
            "{freed:?}"
        );
        assert!(
            acquire(&broker_b, "alice", "c4").await.allowed,
            "both were freed"
        );
        drop(broker_a);
    });
    drop(a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_redis_is_away_each_agent_holds_its_share() {
    let mut server = RedisServer::start().unwrap();
    let config = FleetConfig {
        check_timeout: Duration::from_millis(200),
        ..fleet(&server.url())
    };
    let a = FleetAgent::start_fleet(&config, LOGINS_2).await.unwrap();
    let broker = a.client().await.unwrap();
    assert!(acquire(&broker, "alice", "c1").await.allowed);
    server.kill().unwrap();
    // limit 2 / 2 expected replicas: one per agent, counting the one leased before.
    let alone = acquire(&broker, "alice", "c2").await;
    assert_eq!((alone.outcome, alone.limit), (Outcome::Limited, 1));
    a.wait_redis_up(false).await;
    assert!(acquire(&broker, "bob", "c1").await.allowed);
    let second = acquire(&broker, "bob", "c2").await;
    assert_eq!((second.outcome, second.limit), (Outcome::Limited, 1));
    assert!(broker.release("logins", "bob", "c1").await.unwrap());
    assert!(acquire(&broker, "bob", "c2").await.allowed, "released here");
    assert!(a.limiter.shared_status().unwrap().fallback_checks >= 3);
}

//! `cargo xtask bench app`, its Redis mode: the fleet's shared check through an agent, beside
//! the anchor, the same GCRA script called directly by its SHA (`EVALSHA`) from one pipelined
//! client, against the same `redis-server` (started by the bench, no persistence), at the
//! same pipelining depth, 1 and 64.
//!
//! The agent's path is a broker client on the agent's Unix socket, the agent's check, and the
//! script on the agent's multiplexed connection to Redis; the anchor's path is the script
//! alone. Rounds interleave the two so machine noise hits both alike; the median of the rounds
//! is printed, with the cost ratio (anchor throughput over the agent's: the target is 1.2 at
//! most).

use std::{
    hint::black_box,
    time::{Duration, Instant},
};

use futures::{StreamExt, stream::FuturesUnordered};
use limiter::fleet::GCRA_SCRIPT;
use limiter_client::Client;
use limiter_tests::{
    fleet::{FleetAgent, two_workers},
    redis::RedisServer,
    report::Report,
};

/// A limit no run exhausts (1000 keys, at most a thousand checks each), so every check takes
/// the admitting path and writes, as a busy broker's would.
const ACTION: &str = "[actions.bench]\nlimit = 1000000\nwindow = \"1h\"\nkey = \"user\"\n";
const KEYS: usize = 1_000;
const ROUNDS: usize = 3;

/// The script with the arguments the agent sends for `bench` (1,000,000 per hour: one token
/// per 3600 µs, a burst of a million).
async fn anchor_rate(
    redis: &redis::aio::MultiplexedConnection,
    checks: usize,
    depth: usize,
) -> f64 {
    let script = redis::Script::new(GCRA_SCRIPT);
    let keys: Vec<String> = (0..KEYS)
        .map(|i| format!("anchor:bench:{{k{i}}}"))
        .collect();
    let start = Instant::now();
    let mut in_flight = FuturesUnordered::new();
    let (mut sent, mut done) = (0, 0);
    while done < checks {
        while sent < checks && in_flight.len() < depth {
            let mut connection = redis.clone();
            let mut invocation = script.prepare_invoke();
            invocation
                .key(&keys[sent % KEYS])
                .arg(3_600u64)
                .arg(3_600_000_000u64)
                .arg(1)
                .arg(1_000_000)
                .arg(1);
            in_flight.push(async move {
                let reply: Vec<i64> = invocation.invoke_async(&mut connection).await.unwrap();
                assert_eq!(reply[0], 1, "the anchor's bucket ran dry");
                reply
            });
            sent += 1;
        }
        black_box(in_flight.next().await.unwrap());
        done += 1;
    }
    checks as f64 / start.elapsed().as_secs_f64()
}

async fn agent_rate(client: &Client, checks: usize, depth: usize) -> f64 {
    let keys: Vec<String> = (0..KEYS).map(|i| format!("k{i}")).collect();
    let start = Instant::now();
    let mut in_flight = FuturesUnordered::new();
    let (mut sent, mut done) = (0, 0);
    while done < checks {
        while sent < checks && in_flight.len() < depth {
            let key = &keys[sent % KEYS];
            in_flight.push(async move {
                let verdict = client.check("bench", key, 1).await.unwrap();
                assert!(verdict.allowed, "the agent's bucket ran dry: {verdict:?}");
                verdict
            });
            sent += 1;
        }
        black_box(in_flight.next().await.unwrap());
        done += 1;
    }
    checks as f64 / start.elapsed().as_secs_f64()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() -> anyhow::Result<()> {
    // `cargo bench` passes `--bench`; there is nothing to filter.
    let mut rows = Vec::new();
    let version = two_workers().block_on(async {
        let server = RedisServer::start().expect("starting redis-server");
        let version: String = server
            .query(redis::cmd("INFO").arg("server"))
            .expect("INFO server");
        let version = version
            .lines()
            .find_map(|l| l.strip_prefix("redis_version:"))
            .unwrap_or("?")
            .to_owned();
        // The longest check timeout: on a loaded machine a check may wait, never fall back.
        let agent = FleetAgent::start(&server.url(), ACTION, Duration::from_secs(10), 2)
            .await
            .expect("starting the agent");
        let client = agent.client().await.unwrap();
        let anchor = redis::Client::open(server.url())
            .unwrap()
            .get_multiplexed_async_connection_with_config(
                &redis::AsyncConnectionConfig::new().set_response_timeout(None),
            )
            .await
            .unwrap();
        for (depth, checks) in [(1, 5_000), (64, 100_000)] {
            let (mut ours, mut theirs) = (Vec::new(), Vec::new());
            for _ in 0..ROUNDS {
                theirs.push(anchor_rate(&anchor, checks, depth).await);
                ours.push(agent_rate(&client, checks, depth).await);
            }
            let (ours, theirs) = (median(ours), median(theirs));
            rows.push(vec![
                format!("shared check, pipelining depth {depth}"),
                format!("{:.1}", ours / 1e3),
                format!("{:.1}", theirs / 1e3),
                format!("{:.2}", theirs / ours),
            ]);
        }
        let status = agent.limiter.shared_status().unwrap();
        assert_eq!(
            status.fallback_checks, 0,
            "some checks were decided locally: the figures are not Redis's"
        );
        version
    });
    let mut report = Report::new(
        "fleet",
        "app",
        "Fleet mode: shared checks per second",
        &format!(
            "Checks of an action shared through one `redis-server` {version} on loopback, from \
             a fleet agent's protocol socket, beside the anchor: the same script called with \
             `EVALSHA` straight from a Redis client, at the same pipelining depth; {ROUNDS} \
             rounds interleaved, medians. The cost ratio is the anchor's rate over the \
             agent's: how much the agent's path adds to Redis's own."
        ),
    );
    report.table(&["check", "agent k/s", "EVALSHA k/s", "cost ratio"], &rows);
    for row in &rows {
        report.summary(format!("{}: cost ratio {} over `EVALSHA`", row[0], row[3]));
    }
    report.finish()
}

//! `cargo xtask bench app`: application-layer checks per second (the agent's crate's limiter,
//! measured from here so that its report joins the others').
//!
//! Every figure is printed beside an anchor measured in the same run, as a ratio, because
//! absolute numbers on a shared two-core machine mean little: in process, the anchor is the
//! `governor` crate's keyed limiter doing the same work; over the Unix socket, it is a bare
//! length-delimited echo over the same kind of socket at the same pipelining depth.

use std::{
    collections::BTreeMap,
    hint::black_box,
    num::NonZeroU32,
    sync::Arc,
    time::{Duration, Instant},
};

use futures::{SinkExt, StreamExt, stream::FuturesUnordered};
use governor::{Quota, RateLimiter};
use limiter::{
    buckets::{
        ActionConfig, KeyKind, Limiter, LimiterConfig, MonotonicClock, NoBans, Window,
        resolve_actions,
    },
    protocol::Server,
    settings::ServeConfig,
};
use limiter_client::Client;
use limiter_tests::report::Report;
use tokio::net::{UnixListener, UnixStream};
use tokio_util::codec::{Framed, LengthDelimitedCodec};

const HOT_CHECKS: usize = 4_000_000;
const DISTINCT_KEYS: usize = 1_000_000;

fn limiter() -> Arc<Limiter> {
    // A limit no benchmark run can exhaust, so every check takes the admitting path (a CAS),
    // as governor's does.
    let mut table = BTreeMap::new();
    table.insert(
        "bench".to_owned(),
        ActionConfig {
            limit: Some(u32::MAX),
            window: Some(Window(Duration::from_secs(3600))),
            key: Some(KeyKind::User),
            max_keys: Some(2 * DISTINCT_KEYS),
            ..ActionConfig::default()
        },
    );
    Arc::new(Limiter::new(
        LimiterConfig {
            actions: resolve_actions(&table, &[], false).unwrap(),
            escalation: None,
            mode: limiter::buckets::Enforcement::Enforce,
        },
        Arc::new(MonotonicClock::new()),
        Arc::new(NoBans),
    ))
}

type Governor = governor::DefaultKeyedRateLimiter<Vec<u8>>;

fn governor() -> Governor {
    RateLimiter::keyed(Quota::per_hour(NonZeroU32::MAX))
}

/// Runs `work(thread, share)` on `threads` threads, `total` checks split between them, and
/// returns checks per second.
fn rate(threads: usize, total: usize, work: impl Fn(usize, std::ops::Range<usize>) + Sync) -> f64 {
    let share = total / threads;
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let work = &work;
            s.spawn(move || work(t, t * share..(t + 1) * share));
        }
    });
    (share * threads) as f64 / start.elapsed().as_secs_f64()
}

/// One row of the report: a check, its rate and its anchor's, and their ratio.
fn row(rows: &mut Vec<Vec<String>>, what: &str, ours: f64, anchor_name: &str, anchor: f64) {
    rows.push(vec![
        what.to_owned(),
        format!("{:.2}", ours / 1e6),
        anchor_name.to_owned(),
        format!("{:.2}", anchor / 1e6),
        format!("{:.2}", ours / anchor),
    ]);
}

fn in_process(rows: &mut Vec<Vec<String>>) {
    let keys: Vec<Vec<u8>> = (0..DISTINCT_KEYS)
        .map(|i| format!("user-{i}").into_bytes())
        .collect();
    for threads in [1, 2] {
        let ours = limiter();
        // Resolved once, as a broker that checks one action many times would.
        let bench = ours.action_id("bench").unwrap();
        let theirs = governor();
        let hot = b"hot".to_vec();
        let ours_rate = rate(threads, HOT_CHECKS, |_, range| {
            for _ in range {
                black_box(ours.check_id(&bench, &hot, 1).unwrap());
            }
        });
        let theirs_rate = rate(threads, HOT_CHECKS, |_, range| {
            for _ in range {
                let _ = black_box(theirs.check_key(&hot));
            }
        });
        row(
            rows,
            &format!("in process, one hot key, {threads} thread(s)"),
            ours_rate,
            "governor",
            theirs_rate,
        );

        let ours = limiter();
        let bench = ours.action_id("bench").unwrap();
        let theirs = governor();
        let first = rate(threads, DISTINCT_KEYS, |_, range| {
            for i in range {
                black_box(ours.check_id(&bench, &keys[i], 1).unwrap());
            }
        });
        let theirs_first = rate(threads, DISTINCT_KEYS, |_, range| {
            for i in range {
                let _ = black_box(theirs.check_key(&keys[i]));
            }
        });
        row(
            rows,
            &format!("in process, 1M new keys, {threads} thread(s)"),
            first,
            "governor",
            theirs_first,
        );
        let again = rate(threads, DISTINCT_KEYS, |_, range| {
            for i in range {
                black_box(ours.check_id(&bench, &keys[i], 1).unwrap());
            }
        });
        let theirs_again = rate(threads, DISTINCT_KEYS, |_, range| {
            for i in range {
                let _ = black_box(theirs.check_key(&keys[i]));
            }
        });
        row(
            rows,
            &format!("in process, 1M tracked keys, {threads} thread(s)"),
            again,
            "governor",
            theirs_again,
        );
    }
}

/// The same number of round trips as `checks` through a bare length-delimited echo, `depth`
/// frames in flight, with frames the size of a check and a verdict.
async fn echo_rate(socket: &std::path::Path, checks: usize, depth: usize) -> f64 {
    let listener = UnixListener::bind(socket).unwrap();
    let server = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let mut framed = Framed::new(stream, LengthDelimitedCodec::new());
        while let Some(Ok(frame)) = framed.next().await {
            let mut reply = frame;
            reply.resize(30, 0);
            framed.feed(reply.freeze()).await.unwrap();
            while let Some(Some(Ok(frame))) = futures::FutureExt::now_or_never(framed.next()) {
                let mut reply = frame;
                reply.resize(30, 0);
                framed.feed(reply.freeze()).await.unwrap();
            }
            SinkExt::<bytes::Bytes>::flush(&mut framed).await.unwrap();
        }
    });
    let stream = UnixStream::connect(socket).await.unwrap();
    let mut framed = Framed::new(stream, LengthDelimitedCodec::new());
    let request = bytes::Bytes::from(vec![0u8; 25]);
    let start = Instant::now();
    let mut sent = 0;
    let mut received = 0;
    while received < checks {
        while sent < checks && sent - received < depth {
            framed.feed(request.clone()).await.unwrap();
            sent += 1;
        }
        SinkExt::<bytes::Bytes>::flush(&mut framed).await.unwrap();
        black_box(framed.next().await.unwrap().unwrap());
        received += 1;
    }
    let elapsed = start.elapsed();
    drop(framed);
    server.await.unwrap();
    std::fs::remove_file(socket).unwrap();
    checks as f64 / elapsed.as_secs_f64()
}

async fn client_rate(client: &Client, checks: usize, depth: usize) -> f64 {
    let start = Instant::now();
    let mut in_flight = FuturesUnordered::new();
    let mut sent = 0;
    let mut done = 0;
    while done < checks {
        while sent < checks && in_flight.len() < depth {
            let key = format!("k{}", sent % 1000);
            in_flight.push(async move { client.check("bench", key, 1).await.unwrap() });
            sent += 1;
        }
        black_box(in_flight.next().await.unwrap());
        done += 1;
    }
    checks as f64 / start.elapsed().as_secs_f64()
}

fn over_the_socket(rows: &mut Vec<Vec<String>>) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("bench.sock");
        let server = Server::bind(&ServeConfig::unix(&socket), limiter())
            .await
            .unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(server.run(async {
            let _ = stopped.await;
        }));
        let client = Client::connect_unix(&socket).await.unwrap();
        for (depth, checks) in [(1, 50_000), (64, 500_000)] {
            let ours = client_rate(&client, checks, depth).await;
            let anchor = echo_rate(&dir.path().join("echo.sock"), checks, depth).await;
            row(
                rows,
                &format!("Unix socket, pipelining depth {depth}"),
                ours,
                "bare echo",
                anchor,
            );
        }
        stop.send(()).unwrap();
        task.await.unwrap();
    });
}

fn main() -> anyhow::Result<()> {
    // `cargo bench` passes `--bench`; there is nothing to filter.
    let mut rows = Vec::new();
    in_process(&mut rows);
    over_the_socket(&mut rows);
    let mut report = Report::new(
        "app",
        "app",
        "Application-layer checks per second",
        &format!(
            "In process, `Limiter::check_id` against the `governor` crate's keyed limiter \
             doing the same work ({HOT_CHECKS} checks of one key; {DISTINCT_KEYS} keys first \
             new, then tracked), on one and two threads. Over the Unix socket, \
             `limiter-client` against the agent's server, beside a bare length-delimited echo \
             over the same kind of socket at the same pipelining depth. A ratio above 1 is \
             faster than the anchor."
        ),
    );
    report.table(
        &["check", "limiter M/s", "anchor", "anchor M/s", "ratio"],
        &rows,
    );
    for row in &rows {
        report.summary(format!("{} {} × {}", row[0], row[4], row[2]));
    }
    report.finish()
}

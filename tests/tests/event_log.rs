//! The event log against the real binary: a ban over HTTP, a broker connection closed by its
//! strikes and a mode changed by SIGHUP are each written once to `event-log` as a JSON line
//! with its fields, kept out of the ordinary log, and shown by `limiter events`, which then
//! follows the log to the next event (an unban).

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Child, Command, Output, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use limiter_tests::{
    agent::{AgentProcess, PinDir, binary},
    netns::Pair,
};
use nix::sys::signal::Signal;
use reqwest::Method;
use serde_json::{Value, json};

const TOKEN: &str = "s3cret";
const BANNED: &str = "192.0.2.9";
/// The broker action whose connections are closed at their second refusal.
const ACTIONS: &str = "[actions.conn]\nlimit = 1\nwindow = \"1h\"\nkey = \"connection\"\n\
                       strikes-to-disconnect = 2\nstrike-window = \"1h\"\n";

/// The event log's lines once it holds at least `count`, failing after `within`.
fn wait_lines(path: &Path, count: usize, within: Duration) -> Vec<Value> {
    let deadline = Instant::now() + within;
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
            .collect();
        if lines.len() >= count {
            return lines;
        }
        assert!(
            Instant::now() < deadline,
            "{count} events within {within:?}; the log holds:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A process that does not end by itself, killed when the test ends, passed or not.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn limiter(args: &[&str]) -> Output {
    Command::new(binary())
        .args(args)
        .env_remove("LIMITER_CONFIG")
        .output()
        .expect("running limiter")
}

#[test]
fn each_event_is_one_line_with_its_fields_and_limiter_events_shows_it() {
    let pair = Pair::new().expect("namespaces");
    let pins = PinDir::new();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("limiter.toml");
    std::fs::write(&config, ACTIONS).unwrap();
    let log = dir.path().join("events.log");
    let socket = dir.path().join("limiter.sock");
    let (config_arg, log_arg, socket_arg) = (
        config.to_str().unwrap(),
        log.to_str().unwrap(),
        socket.to_str().unwrap(),
    );
    let agent = AgentProcess::builder(&pair.server, &pair.server_if, &pins)
        .socket(&socket)
        .args(["--admin-token", TOKEN, "--config", config_arg])
        .args(["--event-log", log_arg])
        .ready()
        .expect("starting the agent");

    let (status, body) = agent
        .http(
            Method::POST,
            "/v1/bans",
            Some(TOKEN),
            Some(json!({"addr": BANNED, "ttl": "10m"})),
        )
        .expect("the agent answers");
    assert_eq!(status, 200, "{body}");

    // Allowed, refused (one strike), refused (the second: closed), then refused as closed.
    let check = || limiter(&["check", "conn", "client-7", "--socket", socket_arg]);
    let codes: Vec<Option<i32>> = (0..5).map(|_| check().status.code()).collect();
    assert_eq!(codes, [Some(0), Some(1), Some(1), Some(1), Some(1)]);

    // Written after the checks above: once it is there, any line they made is too.
    std::fs::write(&config, format!("mode = \"monitor\"\n{ACTIONS}")).unwrap();
    agent.signal(Signal::SIGHUP);
    agent
        .wait_for("configuration reloaded", Duration::from_secs(10))
        .unwrap();
    let lines = wait_lines(&log, 3, Duration::from_secs(10));
    let kinds: Vec<&str> = lines.iter().map(|l| l["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["ban", "disconnect", "mode"], "{lines:#?}");
    let (ban, disconnect, mode) = (&lines[0], &lines[1], &lines[2]);
    assert_eq!(ban["source"], BANNED);
    assert_eq!(ban["cause"], "http");
    assert_eq!(ban["duration_ms"], 600_000);
    assert_eq!(disconnect["source"], "client-7");
    assert_eq!(disconnect["action"], "conn");
    assert_eq!(disconnect["cause"], "strikes");
    assert_eq!(disconnect["reason"], "2 strikes within 1h");
    assert_eq!(mode["to"], "monitor");
    assert_eq!(mode["cause"], "reload");
    assert!(mode.get("action").is_none(), "{mode}");
    for line in &lines {
        assert!(line["timestamp"].is_string(), "{line}");
        assert!(line["message"].is_string(), "{line}");
    }
    let ordinary = agent.log();
    assert!(
        !ordinary.contains("banned 192.0.2.9") && !ordinary.contains("2 strikes"),
        "an event reached the ordinary log:\n{ordinary}"
    );

    let shown = limiter(&["events", "--no-follow", "--event-log", log_arg]);
    assert!(shown.status.success(), "{shown:?}");
    let shown = String::from_utf8(shown.stdout).unwrap();
    let shown: Vec<&str> = shown.lines().collect();
    assert_eq!(shown.len(), 3, "{shown:#?}");
    for (printed, line) in shown.iter().zip(&lines) {
        assert!(
            printed.starts_with(line["timestamp"].as_str().unwrap())
                && printed.ends_with(line["message"].as_str().unwrap()),
            "{printed}"
        );
    }
    assert!(
        shown[0].contains("banned 192.0.2.9 for 10m"),
        "{}",
        shown[0]
    );

    // Followed: what is there, then each event as the agent writes it.
    let mut follower = Killed(
        Command::new(binary())
            .args(["events", "--event-log", log_arg])
            .env_remove("LIMITER_CONFIG")
            .stdout(Stdio::piped())
            .spawn()
            .expect("running limiter events"),
    );
    let (tx, printed) = mpsc::channel();
    let stdout = follower.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let next = || {
        printed
            .recv_timeout(Duration::from_secs(10))
            .expect("a line")
    };
    for line in &shown {
        assert_eq!(&next(), line);
    }
    let (status, body) = agent
        .http(
            Method::DELETE,
            &format!("/v1/bans/{BANNED}"),
            Some(TOKEN),
            None,
        )
        .expect("the agent answers");
    assert_eq!(status, 200, "{body}");
    let unban = next();
    assert!(unban.contains("unbanned 192.0.2.9"), "{unban}");
    drop(follower);

    // Through the agent's own config file and state file rule, as JSON.
    let raw = limiter(&[
        "events",
        "--no-follow",
        "--json",
        "--config",
        config_arg,
        "--state-file",
        dir.path().join("state.json").to_str().unwrap(),
    ]);
    assert!(raw.status.success(), "{raw:?}");
    assert_eq!(
        String::from_utf8(raw.stdout).unwrap(),
        std::fs::read_to_string(&log).unwrap()
    );
}

//! The agent's word to systemd (`Type=notify`), received on a Unix datagram socket the test
//! binds as `NOTIFY_SOCKET`: READY=1 only once the broker socket accepts connections and the
//! HTTP listener answers, RELOADING=1 (with MONOTONIC_USEC) then READY=1 around a SIGHUP
//! reload, STOPPING=1 on SIGTERM, and the watchdog pinged at half of `WATCHDOG_USEC`.

use std::{
    os::unix::net::{UnixDatagram, UnixStream},
    time::{Duration, Instant},
};

use limiter_tests::{
    agent::{AgentProcess, PinDir, startup_deadline},
    netns::Pair,
};
use nix::sys::signal::Signal;

/// The watchdog timeout the test sets: pings are due every 100 ms.
const WATCHDOG: Duration = Duration::from_millis(200);

/// The service manager's side: every datagram the agent sends, watchdog pings counted apart.
struct Manager {
    socket: UnixDatagram,
    pings: usize,
}

impl Manager {
    /// The next message other than a watchdog ping, failing after `within`.
    fn next(&mut self, within: Duration) -> String {
        let deadline = Instant::now() + within;
        let mut buf = [0u8; 4096];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no message within {within:?}");
            self.socket.set_read_timeout(Some(left)).unwrap();
            let n = self
                .socket
                .recv(&mut buf)
                .unwrap_or_else(|e| panic!("no message within {within:?}: {e}"));
            let text = String::from_utf8_lossy(&buf[..n]).into_owned();
            if text == "WATCHDOG=1\n" {
                self.pings += 1;
            } else {
                return text;
            }
        }
    }
}

#[test]
fn the_agent_tells_systemd_ready_only_once_it_serves_and_reloading_and_stopping() {
    let pair = Pair::new().expect("namespaces");
    let pins = PinDir::new();
    let dir = tempfile::tempdir().unwrap();
    let broker_socket = dir.path().join("limiter.sock");
    let notify_path = dir.path().join("notify.sock");
    let mut manager = Manager {
        socket: UnixDatagram::bind(&notify_path).unwrap(),
        pings: 0,
    };
    let watchdog_usec = WATCHDOG.as_micros().to_string();
    let mut agent = AgentProcess::builder(&pair.server, &pair.server_if, &pins)
        .socket(&broker_socket)
        .args(["--ports", "1883"])
        .env("NOTIFY_SOCKET", &notify_path)
        .env("WATCHDOG_USEC", &watchdog_usec)
        .start()
        .unwrap();

    // The first word is READY=1, and by then both listeners serve.
    let first = manager.next(startup_deadline());
    assert_eq!(first, "READY=1\n", "{}", agent.log());
    assert!(
        UnixStream::connect(&broker_socket).is_ok(),
        "the broker socket accepts connections when READY=1 arrives"
    );
    let health = agent.http(reqwest::Method::GET, "/healthz", None, None);
    assert!(
        health.as_ref().is_some_and(|(status, _)| *status == 200),
        "the HTTP listener answers when READY=1 arrives: {health:?}"
    );

    // SIGHUP: RELOADING=1 with the monotonic time, then READY=1 once reloaded.
    agent.signal(Signal::SIGHUP);
    let reloading = manager.next(Duration::from_secs(10));
    let mut lines = reloading.lines();
    assert_eq!(lines.next(), Some("RELOADING=1"), "{reloading:?}");
    let usec = lines
        .next()
        .and_then(|l| l.strip_prefix("MONOTONIC_USEC="))
        .and_then(|n| n.parse::<u64>().ok());
    assert!(usec.is_some_and(|n| n > 0), "{reloading:?}");
    assert_eq!(manager.next(Duration::from_secs(10)), "READY=1\n");
    agent
        .wait_for("configuration reloaded", Duration::from_secs(5))
        .unwrap();

    // The watchdog: pinged every 100 ms; a second is ample for a few, whatever the load.
    let pings_before = manager.pings;
    let deadline = Instant::now() + Duration::from_secs(5);
    manager
        .socket
        .set_read_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    let mut buf = [0u8; 64];
    while manager.pings < pings_before + 3 && Instant::now() < deadline {
        let n = manager.socket.recv(&mut buf).expect("a watchdog ping");
        assert_eq!(&buf[..n], b"WATCHDOG=1\n");
        manager.pings += 1;
    }
    assert!(manager.pings >= pings_before + 3, "{} pings", manager.pings);

    // SIGTERM: STOPPING=1, then the agent exits.
    agent.signal(Signal::SIGTERM);
    assert_eq!(manager.next(Duration::from_secs(10)), "STOPPING=1\n");
    let status = agent.wait_exit(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "{status:?}\n{}", agent.log());
}

//! The real mosquitto broker with the limiter plugin, behind the real agent on a veth in
//! namespaces the test made: failed passwords escalate to a kernel ban, `publish` limits one
//! user and not another, and a stopped agent gives the configured fail mode.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    process::Output,
    time::Duration,
};

use limiter_tests::{
    agent::{AgentProcess, PinDir, startup_deadline},
    mosquitto::{self, Broker, Logins},
    netns::{CLIENT_V4, Pair, SERVER_V4, connect},
};
use nix::sys::signal::Signal;

/// A second address of the client namespace, so the ban of the guessing address leaves the
/// well-behaved one alone.
const GUESSER: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 3);
/// Password guesses the attacker makes.
const ATTEMPTS: usize = 20;
/// `auth` tokens per address: the first guesses reach the password check.
const AUTH_LIMIT: usize = 5;
/// Failures (password refusals plus `auth` refusals) tolerated before the ban.
const ESCALATE_AFTER: usize = 10;
/// Messages `publish` lets one user send in the test's window.
const PUBLISH_LIMIT: usize = 3;

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn the_plugin_limits_logins_and_publishes_and_escalates_to_a_kernel_ban() {
    let pair = Pair::new().expect("namespaces");
    let _peer = limiter_tests::kernel::peer(&pair).unwrap();
    let pins = PinDir::new();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("limiter.sock");
    pair.client
        .exec(&[
            "ip",
            "addr",
            "add",
            &format!("{GUESSER}/24"),
            "dev",
            &pair.client_if,
        ])
        .unwrap();

    let auth_limit = AUTH_LIMIT.to_string();
    let escalate = ESCALATE_AFTER.to_string();
    let publish_limit = PUBLISH_LIMIT.to_string();
    let port = mosquitto::PORT.to_string();
    let mut agent = AgentProcess::start(
        &pair.server,
        &[
            "--iface",
            &pair.server_if,
            "--pin-dir",
            pins.arg(),
            "--socket",
            socket.to_str().unwrap(),
            "--ports",
            &port,
            "--reject-ban",
            "rst",
            "--auth-limit",
            &auth_limit,
            "--auth-window",
            "60s",
            "--escalate-after",
            &escalate,
            "--publish-limit",
            &publish_limit,
            "--publish-window",
            "60s",
        ],
    )
    .unwrap();
    agent
        .wait_for("limiter is ready", startup_deadline())
        .unwrap();

    let server = IpAddr::V4(SERVER_V4);
    let broker = Broker::start(
        &pair.server,
        server,
        dir.path(),
        &[
            ("alice", "a-secret"),
            ("bob", "b-secret"),
            ("watcher", "w-secret"),
        ],
        &[
            ("socket", socket.to_str().unwrap()),
            ("actions", "auth,publish,subscribe"),
            ("fail", "closed"),
            ("timeout", "500"),
        ],
    )
    .unwrap();
    let good = IpAddr::V4(CLIENT_V4);
    let run = |program: &str, from: IpAddr, args: &[&str], limit_secs: u64| {
        mosquitto::client(
            &pair.client,
            program,
            from,
            server,
            args,
            Duration::from_secs(limit_secs),
        )
        .unwrap()
    };

    // `publish`: alice sends past her limit on one connection, bob stays within his; a
    // subscriber counts what got through (and would stop early on one message too many).
    let expected = PUBLISH_LIMIT + 2;
    let watcher = std::thread::scope(|scope| {
        let sub = scope.spawn(|| {
            let count = (expected + 1).to_string();
            let args = [
                "-u", "watcher", "-P", "w-secret", "-t", "t/#", "-v", "-C", &count, "-W", "6",
            ];
            run("mosquitto_sub", good, &args, 10)
        });
        broker
            .wait_for("Received SUBSCRIBE", 1, Duration::from_secs(5))
            .unwrap();
        let alice = run(
            "mosquitto_pub",
            good,
            &[
                "-u", "alice", "-P", "a-secret", "-t", "t/alice", "-m", "hi", "--repeat", "6",
            ],
            5,
        );
        assert!(alice.status.success(), "{}", text(&alice));
        let bob = run(
            "mosquitto_pub",
            good,
            &[
                "-u", "bob", "-P", "b-secret", "-t", "t/bob", "-m", "hi", "--repeat", "2",
            ],
            5,
        );
        assert!(bob.status.success(), "{}", text(&bob));
        sub.join().unwrap()
    });
    let received = String::from_utf8_lossy(&watcher.stdout).into_owned();
    let from_alice = received
        .lines()
        .filter(|l| l.starts_with("t/alice"))
        .count();
    let from_bob = received.lines().filter(|l| l.starts_with("t/bob")).count();
    assert_eq!(
        (from_alice, from_bob),
        (PUBLISH_LIMIT, 2),
        "alice is cut at the limit, bob is not; received:\n{received}\nbroker log:\n{}",
        broker.log()
    );
    assert_eq!(
        broker.count("limiter: publish refused for user alice"),
        6 - PUBLISH_LIMIT
    );
    assert_eq!(broker.count("limiter: publish refused for user bob"), 0);

    // Password guessing from GUESSER: the password check refuses the first AUTH_LIMIT, `auth`
    // the next ones, and past ESCALATE_AFTER failures the kernel bans the address.
    let guesser = IpAddr::V4(GUESSER);
    let mut outcomes = Vec::new();
    for _ in 0..ATTEMPTS {
        let out = run(
            "mosquitto_pub",
            guesser,
            &["-u", "alice", "-P", "wrong", "-t", "t/x", "-m", "x"],
            5,
        );
        assert!(!out.status.success(), "a wrong password got in");
        outcomes.push(text(&out));
    }
    let not_authorised = |o: &String| o.contains("not authorised");
    let password_refusals = format!("limiter: reporting a failed login from {GUESSER}");
    let auth_refusals = format!("limiter: auth refused for {GUESSER}");
    assert!(
        outcomes[..AUTH_LIMIT].iter().all(not_authorised),
        "{outcomes:#?}"
    );
    assert_eq!(
        broker.count(&password_refusals),
        AUTH_LIMIT,
        "{}",
        broker.log()
    );
    let by_auth = broker.count(&auth_refusals);
    assert!(
        (1..=ESCALATE_AFTER + 1 - AUTH_LIMIT).contains(&by_auth),
        "{by_auth} refused by auth; {}",
        broker.log()
    );
    let banned = &outcomes[AUTH_LIMIT + by_auth..];
    assert!(
        !banned.is_empty() && banned.iter().all(|o| !not_authorised(o)),
        "the guesses after the ban never reach the broker: {outcomes:#?}"
    );
    agent
        .wait_for("escalated to a ban", Duration::from_secs(5))
        .unwrap();
    let dst = SocketAddr::new(server, mosquitto::PORT);
    let syn = connect(&pair.client, guesser, dst).unwrap();
    assert_eq!(
        syn.map(|_| ()).unwrap_err().kind(),
        std::io::ErrorKind::ConnectionRefused,
        "the banned address's SYN is refused in XDP"
    );
    assert!(
        connect(&pair.client, good, dst).unwrap().is_ok(),
        "another address still connects"
    );

    // The agent stops: with `fail closed`, even a right password is refused, within the
    // plugin's timeout, and the broker says why.
    agent.signal(Signal::SIGTERM);
    agent.wait_exit(Duration::from_secs(10)).unwrap();
    let out = run(
        "mosquitto_pub",
        good,
        &["-u", "bob", "-P", "b-secret", "-t", "t/bob", "-m", "late"],
        5,
    );
    assert!(not_authorised(&text(&out)), "{}", text(&out));
    broker
        .wait_for("failing Closed", 1, Duration::from_secs(2))
        .unwrap();
}

/// `auth` tokens per address in the anonymous-broker test.
const ANON_AUTH_LIMIT: usize = 4;

/// On a broker with no login check of its own (`allow_anonymous true`, no password file), a
/// login with a username: by default the plugin defers and mosquitto 2.0 refuses it; with
/// `plugin_opt_login_check none` an allowed login is accepted as without the plugin, and
/// `auth` still refuses past its limit.
#[test]
fn on_a_broker_without_its_own_login_check_login_check_none_accepts_what_auth_allows() {
    let pair = Pair::new().expect("namespaces");
    let pins = PinDir::new();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("limiter.sock");
    let auth_limit = ANON_AUTH_LIMIT.to_string();
    let port = mosquitto::PORT.to_string();
    let agent = AgentProcess::start(
        &pair.server,
        &[
            "--iface",
            &pair.server_if,
            "--pin-dir",
            pins.arg(),
            "--socket",
            socket.to_str().unwrap(),
            "--ports",
            &port,
            "--auth-limit",
            &auth_limit,
            "--auth-window",
            // Long enough that no token comes back while two brokers start on a loaded machine
            // (a 60 s window gave one back every 15 s).
            "1h",
        ],
    )
    .unwrap();
    agent
        .wait_for("limiter is ready", startup_deadline())
        .unwrap();
    let server = IpAddr::V4(SERVER_V4);
    let from = IpAddr::V4(CLIENT_V4);
    let login = || {
        let out = mosquitto::client(
            &pair.client,
            "mosquitto_pub",
            from,
            server,
            &["-u", "u1", "-t", "t/u1", "-m", "hi"],
            Duration::from_secs(5),
        )
        .unwrap();
        (out.status.success(), text(&out))
    };
    let opts = |login_check: Option<&'static str>| {
        let mut opts = vec![
            ("socket", socket.to_str().unwrap()),
            ("actions", "auth"),
            ("timeout", "500"),
        ];
        opts.extend(login_check.map(|v| ("login_check", v)));
        opts
    };

    // The default defers: mosquitto 2.0 then refuses a username every callback deferred.
    let broker = Broker::start_with(
        &pair.server,
        server,
        dir.path(),
        Logins::Anonymous,
        &opts(None),
    )
    .unwrap();
    let (ok, out) = login();
    assert!(!ok && out.contains("not authorised"), "{out}");
    assert_eq!(broker.count("limiter: auth refused"), 0, "{}", broker.log());
    drop(broker);

    // `none`: the allowed logins are accepted, the ones past `auth` refused by the plugin.
    let broker = Broker::start_with(
        &pair.server,
        server,
        dir.path(),
        Logins::Anonymous,
        &opts(Some("none")),
    )
    .unwrap();
    let outcomes: Vec<(bool, String)> = (0..ANON_AUTH_LIMIT + 1).map(|_| login()).collect();
    let accepted = ANON_AUTH_LIMIT - 1;
    assert!(
        outcomes[..accepted].iter().all(|(ok, _)| *ok),
        "{outcomes:#?}\n{}",
        broker.log()
    );
    assert!(
        outcomes[accepted..]
            .iter()
            .all(|(ok, out)| !ok && out.contains("not authorised")),
        "{outcomes:#?}"
    );
    assert_eq!(
        broker.count(&format!("limiter: auth refused for {CLIENT_V4}")),
        2,
        "{}",
        broker.log()
    );
}

//! The real mosquitto broker with the limiter plugin, behind the real agent on a veth in
//! namespaces the test made: failed passwords escalate to a kernel ban, `publish` limits one
//! user and not another, a user's bytes and a topic subtree's messages each hold to their
//! budget, and a stopped agent gives the configured fail mode.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    process::Output,
    time::Duration,
};

use limiter_tests::{
    agent::{AgentProcess, PinDir},
    mosquitto::{self, Broker, Conf, Logins},
    netns::{CLIENT_V4, Netns, Pair, SERVER_V4, connect},
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
    let mut agent = agent_at(
        &pair,
        &pins,
        &socket,
        &port,
        &[
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
    );

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
/// login with a username: with `plugin_opt_login_check broker` the plugin defers and
/// mosquitto 2.0 refuses it; by default (`auto`, read from the broker's configuration) an
/// allowed login is accepted as without the plugin, and `auth` still refuses past its limit.
#[test]
fn on_a_broker_without_its_own_login_check_the_default_accepts_what_auth_allows() {
    let pair = Pair::new().expect("namespaces");
    let pins = PinDir::new();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("limiter.sock");
    let auth_limit = ANON_AUTH_LIMIT.to_string();
    let port = mosquitto::PORT.to_string();
    let _agent = agent_at(
        &pair,
        &pins,
        &socket,
        &port,
        &[
            "--auth-limit",
            &auth_limit,
            "--auth-window",
            // Long enough that no token comes back while two brokers start on a loaded machine
            // (a 60 s window gave one back every 15 s).
            "1h",
        ],
    );
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

    // `broker` defers: mosquitto 2.0 then refuses a username every callback deferred.
    let broker = Broker::start_with(
        &pair.server,
        server,
        dir.path(),
        Logins::Anonymous,
        &opts(Some("broker")),
    )
    .unwrap();
    let (ok, out) = login();
    assert!(!ok && out.contains("not authorised"), "{out}");
    assert_eq!(broker.count("limiter: auth refused"), 0, "{}", broker.log());
    drop(broker);

    // The default: the allowed logins are accepted, the ones past `auth` refused by the plugin.
    let broker = Broker::start_with(
        &pair.server,
        server,
        dir.path(),
        Logins::Anonymous,
        &opts(None),
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

/// The port of the broker without the plugin, beside the one with it at [`mosquitto::PORT`].
const PLAIN_PORT: u16 = mosquitto::PORT + 1;

/// A ready agent in `pair`'s server namespace protecting `ports` (attached to the server's
/// end, its maps pinned in `pins`), serving the broker protocol at `socket`, with `flags`.
/// A pair of namespaces with a NAPI peer and an agent on the server's end, protecting
/// mosquitto's port, configured by a `limiter.toml` of `config` and by `flags`; the brokers
/// of the test start in `dir` and reach the agent at `socket`.
struct PluginHost {
    // Dropped in this order: the agent before the namespaces it runs in.
    _agent: AgentProcess,
    _peer: limiter::datapath::Datapath,
    _pins: PinDir,
    dir: tempfile::TempDir,
    socket: std::path::PathBuf,
    pair: Pair,
}

impl PluginHost {
    fn start(config: &str, flags: &[&str]) -> Self {
        let pair = Pair::new().expect("namespaces");
        let peer = limiter_tests::kernel::peer(&pair).unwrap();
        let pins = PinDir::new();
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("limiter.sock");
        let file = dir.path().join("limiter.toml");
        std::fs::write(&file, config).unwrap();
        let args = [&["--config", file.to_str().unwrap()], flags].concat();
        let agent = agent_at(&pair, &pins, &socket, &mosquitto::PORT.to_string(), &args);
        Self {
            _agent: agent,
            _peer: peer,
            _pins: pins,
            dir,
            socket,
            pair,
        }
    }
}

fn agent_at(
    pair: &Pair,
    pins: &PinDir,
    socket: &std::path::Path,
    ports: &str,
    flags: &[&str],
) -> AgentProcess {
    AgentProcess::builder(&pair.server, &pair.server_if, pins)
        .socket(socket)
        .args(["--ports", ports])
        .args(flags)
        .ready()
        .unwrap()
}

/// An agent in `pair`'s server namespace whose `auth`, `publish` and `subscribe` allow far
/// more than a test spends, listening at `socket`.
fn generous_agent(pair: &Pair, pins: &PinDir, socket: &std::path::Path) -> AgentProcess {
    let ports = format!("{},{PLAIN_PORT}", mosquitto::PORT);
    agent_at(
        pair,
        pins,
        socket,
        &ports,
        &[
            "--auth-limit",
            "1000",
            "--auth-window",
            "1h",
            "--publish-limit",
            "1000",
            "--publish-window",
            "1h",
            "--subscribe-limit",
            "1000",
            "--subscribe-window",
            "1h",
        ],
    )
}

/// The same broker twice in `ns`, in subdirectories of `dir` named after `case`: without the
/// plugin at [`PLAIN_PORT`], with it (asking the agent at `socket`, failing closed, so an
/// unanswered check shows as a refusal) at [`mosquitto::PORT`].
fn twins(
    ns: &Netns,
    dir: &std::path::Path,
    case: &str,
    socket: &std::path::Path,
    conf: Conf,
) -> (Broker, Broker) {
    let plugin_opts = [
        ("socket", socket.to_str().unwrap()),
        ("actions", "auth,publish,subscribe"),
        ("fail", "closed"),
        ("timeout", "500"),
    ];
    let server = IpAddr::V4(SERVER_V4);
    let start = |name: &str, conf: Conf| {
        let sub = dir.join(format!("{case}-{name}"));
        std::fs::create_dir(&sub).unwrap();
        Broker::start_conf(ns, server, &sub, &conf).unwrap()
    };
    let plain = start(
        "plain",
        Conf {
            port: PLAIN_PORT,
            plugin: None,
            ..conf
        },
    );
    let with = start(
        "plugin",
        Conf {
            port: mosquitto::PORT,
            plugin: Some(&plugin_opts),
            ..conf
        },
    );
    (plain, with)
}

/// For every combination of `allow_anonymous`, a password file or none, and a client with
/// no username, a username without a password, the right password and a wrong one, the
/// CONNACK with the plugin (whose `auth` allows) is the CONNACK without it. Before the plugin
/// read the broker's configuration, a username on a broker with `allow_anonymous true` and no
/// password file was refused with it and accepted without.
#[test]
fn with_the_plugin_allowing_every_login_gets_the_connack_it_gets_without() {
    let pair = Pair::new().expect("namespaces");
    let pins = PinDir::new();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("limiter.sock");
    let _agent = generous_agent(&pair, &pins, &socket);
    let users = [("u1", "p1")];
    let clients: [(&str, &[&str]); 4] = [
        ("no username", &[]),
        ("username, no password", &["-u", "u1"]),
        ("right password", &["-u", "u1", "-P", "p1"]),
        ("wrong password", &["-u", "u1", "-P", "wrong"]),
    ];
    let server = IpAddr::V4(SERVER_V4);
    let from = IpAddr::V4(CLIENT_V4);
    let connack = |port: u16, args: &[&str]| {
        let mut all = vec!["-t", "t/x", "-m", "hi"];
        all.extend_from_slice(args);
        let out = mosquitto::client_at(
            &pair.client,
            "mosquitto_pub",
            from,
            (server, port),
            &all,
            Duration::from_secs(5),
        )
        .unwrap();
        (out.status.success(), text(&out))
    };
    let mut accepted = 0;
    let mut differences = Vec::new();
    for allow_anonymous in [true, false] {
        for password_file in [false, true] {
            let case = format!("anon-{allow_anonymous}-pwfile-{password_file}");
            let conf = Conf {
                port: 0,
                allow_anonymous,
                users: password_file.then_some(&users[..]),
                acl: None,
                plugin: None,
            };
            let (plain, with) = twins(&pair.server, dir.path(), &case, &socket, conf);
            for (client, args) in clients {
                let without = connack(PLAIN_PORT, args);
                let got = connack(mosquitto::PORT, args);
                accepted += usize::from(without.0);
                if got != without {
                    differences.push(format!(
                        "{case}, {client}: without the plugin {without:?}, with it {got:?}"
                    ));
                }
            }
            assert_eq!(
                with.count("limiter: no verdict"),
                0,
                "the agent answered every check:\n{}",
                with.log()
            );
            drop((plain, with));
        }
    }
    assert!(differences.is_empty(), "{differences:#?}");
    // Both answers occur, so equal answers are not one answer everywhere: accepted are no
    // username, no password and the right one with anonymous logins, the right password
    // with a file, and without a file any username.
    assert_eq!(accepted, 7, "the broker's own answers changed");
}

/// With and without an `acl_file`, the plugin (whose `publish` and `subscribe` allow) keeps
/// the broker's own ACL decision: what the file denies stays denied, and with no file
/// everything stays allowed. Retained messages show both: a subscriber gets only the ones
/// it may read, and a publish the ACL denies is never stored.
#[test]
fn with_the_plugin_allowing_the_brokers_own_acl_decides() {
    let pair = Pair::new().expect("namespaces");
    let pins = PinDir::new();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("limiter.sock");
    let _agent = generous_agent(&pair, &pins, &socket);
    let users = [("u1", "p1"), ("w", "w1")];
    let rules = "user w\ntopic readwrite #\nuser u1\ntopic readwrite ok/#\n";
    let server = IpAddr::V4(SERVER_V4);
    let from = IpAddr::V4(CLIENT_V4);
    let run = |program: &str, port: u16, args: &[&str]| {
        let out = mosquitto::client_at(
            &pair.client,
            program,
            from,
            (server, port),
            args,
            Duration::from_secs(5),
        )
        .unwrap();
        let mut lines: Vec<String> = text(&out).lines().map(str::to_owned).collect();
        // Retained messages of two topics arrive in either order.
        lines.sort();
        lines
    };
    // What u1 reads and what u1 could store, on the broker at `port`.
    let outcome = |port: u16| {
        let pubs = [
            ("w", "w1", "ok/r"),
            ("w", "w1", "denied/r"),
            ("u1", "p1", "ok/p"),
            ("u1", "p1", "denied/p"),
        ];
        for (user, password, topic) in pubs {
            let args = [
                "-u", user, "-P", password, "-t", topic, "-m", topic, "-r", "-q", "1",
            ];
            run("mosquitto_pub", port, &args);
        }
        let read = run(
            "mosquitto_sub",
            port,
            &[
                "-u", "u1", "-P", "p1", "-t", "ok/r", "-t", "denied/r", "-v", "-C", "2", "-W", "1",
            ],
        );
        let stored = run(
            "mosquitto_sub",
            port,
            &[
                "-u", "w", "-P", "w1", "-t", "ok/p", "-t", "denied/p", "-v", "-C", "2", "-W", "1",
            ],
        );
        (read, stored)
    };
    for acl in [None, Some(rules)] {
        let case = format!("acl-{}", acl.is_some());
        let conf = Conf {
            port: 0,
            allow_anonymous: false,
            users: Some(&users),
            acl,
            plugin: None,
        };
        let (plain, with) = twins(&pair.server, dir.path(), &case, &socket, conf);
        let without = outcome(PLAIN_PORT);
        let got = outcome(mosquitto::PORT);
        let all =
            |lines: &[String], topic: &str| lines.iter().any(|l| l == &format!("{topic} {topic}"));
        let want_denied = acl.is_some();
        for (lines, name) in [(&without, "without the plugin"), (&got, "with it")] {
            assert!(
                all(&lines.0, "ok/r") && all(&lines.1, "ok/p"),
                "{case} {name}: {lines:?}"
            );
            assert_eq!(
                !all(&lines.0, "denied/r") && !all(&lines.1, "denied/p"),
                want_denied,
                "{case} {name}: {lines:?}\n{}",
                with.log()
            );
        }
        assert_eq!(got, without, "{case}");
        assert_eq!(with.count("limiter: no verdict"), 0, "{}", with.log());
        drop(plain);
    }
}

/// Messages the strikes action lets one connection send in the test.
const CONN_LIMIT: usize = 5;
/// Refusals that close a connection.
const STRIKES: usize = 3;

/// `plugin_opt_strikes`: a client flooding publishes is refused past its connection's limit,
/// each refusal a strike, and at the third strike it is kicked and what it sends meanwhile is
/// dropped; another client of the same user is judged by its own connection and keeps
/// publishing; a payload over `max-payload-bytes` weighing all the strikes closes its client
/// at once; and once the kicked client's connection is gone (MOSQ_EVT_DISCONNECT), its id
/// starts afresh.
#[test]
fn a_flooding_client_is_disconnected_after_its_strikes_and_another_of_its_user_is_not() {
    let host = PluginHost::start(
        &format!(
            "[actions.publish_conn]\nlimit = {CONN_LIMIT}\nwindow = \"1h\"\n\
             key = \"connection\"\nstrikes-to-disconnect = {STRIKES}\nstrike-window = \"1h\"\n\
             max-payload-bytes = 64\noversize-strikes = {STRIKES}\n"
        ),
        &[
            "--auth-limit",
            "1000",
            "--publish-limit",
            "1000",
            "--publish-window",
            "1h",
        ],
    );
    let (pair, dir, socket) = (&host.pair, &host.dir, &host.socket);
    let server = IpAddr::V4(SERVER_V4);
    let broker = Broker::start(
        &pair.server,
        server,
        dir.path(),
        &[("alice", "a-secret"), ("watcher", "w-secret")],
        &[
            ("socket", socket.to_str().unwrap()),
            ("actions", "auth,publish"),
            ("strikes", "publish_conn"),
            ("fail", "closed"),
            ("timeout", "500"),
        ],
    )
    .unwrap();
    let good = IpAddr::V4(CLIENT_V4);
    let run = |args: &[&str], limit_secs: u64| {
        let program = if args.contains(&"-C") {
            "mosquitto_sub"
        } else {
            "mosquitto_pub"
        };
        mosquitto::client(
            &pair.client,
            program,
            good,
            server,
            args,
            Duration::from_secs(limit_secs),
        )
        .unwrap()
    };
    let pub_args = |id: &'static str, topic: &'static str, repeat: &'static str| {
        [
            "-u",
            "alice",
            "-P",
            "a-secret",
            "-i",
            id,
            "-t",
            topic,
            "-m",
            "hi",
            "--repeat",
            repeat,
            "--repeat-delay",
            "0.05",
        ]
    };
    // The flood's allowance, the calm client's two, and the flooder's id once more afterwards.
    let expected = CONN_LIMIT + 2 + 1;
    let (watcher, flood) = std::thread::scope(|scope| {
        let sub = scope.spawn(|| {
            let count = (expected + 1).to_string();
            run(
                &[
                    "-u", "watcher", "-P", "w-secret", "-t", "t/#", "-v", "-C", &count, "-W", "12",
                ],
                15,
            )
        });
        broker
            .wait_for("Received SUBSCRIBE", 1, Duration::from_secs(5))
            .unwrap();
        let flood = run(&pub_args("flooder", "t/flood", "40"), 8);
        broker
            .wait_for(
                "limiter: publish_conn: disconnecting client flooder",
                1,
                Duration::from_secs(5),
            )
            .unwrap();
        // One payload over max-payload-bytes weighs all the strikes: that client goes at once.
        let big = "x".repeat(65);
        run(
            &[
                "-u", "alice", "-P", "a-secret", "-i", "big", "-t", "t/big", "-m", &big,
            ],
            5,
        );
        broker
            .wait_for(
                "limiter: publish_conn: disconnecting client big",
                1,
                Duration::from_secs(5),
            )
            .unwrap();
        let calm = run(&pub_args("calm", "t/calm", "2"), 5);
        assert!(calm.status.success(), "{}", text(&calm));
        let again = run(&pub_args("flooder", "t/again", "1"), 5);
        assert!(again.status.success(), "{}", text(&again));
        (sub.join().unwrap(), flood)
    });
    let received = String::from_utf8_lossy(&watcher.stdout).into_owned();
    let from = |topic: &str| received.lines().filter(|l| l.starts_with(topic)).count();
    assert_eq!(
        (
            from("t/flood"),
            from("t/big"),
            from("t/calm"),
            from("t/again")
        ),
        (CONN_LIMIT, 0, 2, 1),
        "the flood is cut at its connection's limit, the calm client is not, and the flooder's \
         id starts afresh once gone; received:\n{received}\nbroker log:\n{}",
        broker.log()
    );
    assert!(
        !flood.status.success(),
        "the flooder's connection was closed under it: {}",
        text(&flood)
    );
    assert_eq!(
        broker.count("limiter: publish_conn: disconnecting client"),
        2,
        "the flooder and the oversize client, once each: {}",
        broker.log()
    );
}

/// `plugin_opt_sessions`: with `logins` at 2 sessions per user, a third session of alice is
/// refused at CONNECT, allowed again once one of hers disconnects; bob is not affected; and a
/// broker killed outright frees every session it held (its connection to the agent drops), so
/// a new broker's clients get all of alice's sessions at once.
#[test]
fn a_third_session_of_a_user_is_refused_until_one_disconnects_and_a_killed_broker_frees_them() {
    let host = PluginHost::start(
        "[actions.logins]\nkind = \"concurrency\"\nlimit = 2\nkey = \"user\"\n",
        &["--auth-limit", "1000"],
    );
    let (pair, dir, socket) = (&host.pair, &host.dir, &host.socket);
    let server = IpAddr::V4(SERVER_V4);
    let good = IpAddr::V4(CLIENT_V4);
    let users = [("alice", "a-secret"), ("bob", "b-secret")];
    let opts = [
        ("socket", socket.to_str().unwrap()),
        ("actions", "auth"),
        ("sessions", "logins"),
        ("fail", "closed"),
        ("timeout", "500"),
    ];
    let start_broker = |name: &str| {
        let sub = dir.path().join(name);
        std::fs::create_dir(&sub).unwrap();
        Broker::start(&pair.server, server, &sub, &users, &opts).unwrap()
    };
    let hold = |broker: &Broker, user: &str, password: &str, id: &str| {
        let child = mosquitto::spawn_client(
            &pair.client,
            "mosquitto_sub",
            good,
            server,
            &["-u", user, "-P", password, "-i", id, "-t", "t/x"],
        )
        .unwrap();
        broker
            .wait_for(&format!(" as {id} "), 1, Duration::from_secs(5))
            .unwrap();
        child
    };
    let login = |user: &str, password: &str| {
        let out = mosquitto::client(
            &pair.client,
            "mosquitto_pub",
            good,
            server,
            &["-u", user, "-P", password, "-t", "t/x", "-m", "x"],
            Duration::from_secs(5),
        )
        .unwrap();
        (out.status.success(), text(&out))
    };

    let broker = start_broker("first");
    let mut first = hold(&broker, "alice", "a-secret", "alice-1");
    let mut second = hold(&broker, "alice", "a-secret", "alice-2");
    let (ok, out) = login("alice", "a-secret");
    assert!(
        !ok && out.contains("not authorised"),
        "a third session: {out}"
    );
    assert_eq!(
        broker.count("limiter: logins: user alice has all its sessions"),
        1,
        "{}",
        broker.log()
    );
    let (ok, out) = login("bob", "b-secret");
    assert!(ok, "bob has sessions of his own: {out}");

    first.kill().unwrap();
    first.wait().unwrap();
    broker
        .wait_for(
            "Client alice-1 closed its connection",
            1,
            Duration::from_secs(5),
        )
        .unwrap();
    // The release goes to the agent as the broker notices; a login soon after gets the room.
    let mut again = (false, String::new());
    for _ in 0..20 {
        again = login("alice", "a-secret");
        if again.0 {
            break;
        }
    }
    assert!(again.0, "one of alice's sessions was freed: {}", again.1);

    // The broker dies with alice-2's session held; the agent frees it with the connection.
    drop(broker);
    second.kill().unwrap();
    second.wait().unwrap();
    let broker = start_broker("second");
    let mut a = hold(&broker, "alice", "a-secret", "alice-3");
    let mut b = hold(&broker, "alice", "a-secret", "alice-4");
    let (ok, out) = login("alice", "a-secret");
    assert!(
        !ok && out.contains("not authorised"),
        "and exactly those: {out}"
    );
    for child in [&mut a, &mut b] {
        child.kill().unwrap();
        child.wait().unwrap();
    }
}

/// A user's bytes per window in `pub_bytes`: ten payloads of this size fit in its MiB.
const BIG_PAYLOAD: usize = 100 * 1024;
/// Messages `pub_topic` lets one user send under one two-level subtree in the window.
const TOPIC_LIMIT: usize = 100;

/// `plugin_opt_publish_bytes` and `plugin_opt_publish_topic`: alice's payloads spend her
/// bytes (1 MiB per hour: ten of 100 KiB fit, an eleventh does not, but 20,000 bytes of the
/// 24,576 left still do, and a second 20,000 no longer); bob's messages under `room/a/...`
/// spend that subtree's 100 (topics `room/a/x` and `room/a/y` share it) and leave `room/b`
/// and carol's own `room/a` whole. Windows of an hour: no refill during the test can move
/// a count. The subscriber stops at the exact total, the last a sentinel published after
/// everything else: a message too many ends it before the sentinel, one too few never
/// reaches the count.
#[test]
fn a_users_bytes_and_a_topics_messages_are_each_held_to_their_budget() {
    let host = PluginHost::start(
        &format!(
            "[actions.pub_bytes]\nlimit = 1048576\nwindow = \"1h\"\nkey = \"user\"\n\
             [actions.pub_topic]\nlimit = {TOPIC_LIMIT}\nwindow = \"1h\"\n\
             key = \"user+topic\"\ntopic-levels = 2\n"
        ),
        &["--auth-limit", "1000", "--auth-window", "1h"],
    );
    let (pair, dir, socket) = (&host.pair, &host.dir, &host.socket);
    let server = IpAddr::V4(SERVER_V4);
    let broker = Broker::start(
        &pair.server,
        server,
        dir.path(),
        &[
            ("alice", "a-secret"),
            ("bob", "b-secret"),
            ("carol", "c-secret"),
            ("watcher", "w-secret"),
        ],
        &[
            ("socket", socket.to_str().unwrap()),
            ("actions", "auth"),
            ("publish_bytes", "pub_bytes"),
            ("publish_topic", "pub_topic"),
            ("fail", "closed"),
            ("timeout", "1000"),
        ],
    )
    .unwrap();
    let big = dir.path().join("big");
    std::fs::write(&big, vec![b'x'; BIG_PAYLOAD]).unwrap();
    let medium = dir.path().join("medium");
    std::fs::write(&medium, vec![b'y'; 20_000]).unwrap();
    let from = IpAddr::V4(CLIENT_V4);
    let run = |program: &str, args: &[&str], limit_secs: u64| {
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
    // QoS 1: each publisher returns once the broker has judged (and acknowledged) every one
    // of its messages, so the sentinel is judged after all of them.
    let publish = |user: &str, password: &str, topic: &str, message: (&str, &str), n: usize| {
        let repeat = n.to_string();
        let out = run(
            "mosquitto_pub",
            &[
                "-u", user, "-P", password, "-q", "1", "-t", topic, message.0, message.1,
                "--repeat", &repeat,
            ],
            30,
        );
        assert!(out.status.success(), "{user} on {topic}: {}", text(&out));
    };
    let big_file = ("-f", big.to_str().unwrap());
    let medium_file = ("-f", medium.to_str().unwrap());
    let small = ("-m", "m");
    let want = [
        ("big/x", 10),
        ("big/y", 1),
        ("room/a/x", 70),
        ("room/a/y", TOPIC_LIMIT - 70),
        ("room/b/x", 10),
        ("room/a/z", 5),
        ("done", 1),
    ];
    let total: usize = want.iter().map(|(_, n)| n).sum();
    let watcher = std::thread::scope(|scope| {
        let sub = scope.spawn(|| {
            let count = total.to_string();
            run(
                "mosquitto_sub",
                &[
                    "-u", "watcher", "-P", "w-secret", "-q", "1", "-t", "#", "-F", "%t", "-C",
                    &count, "-W", "60",
                ],
                65,
            )
        });
        broker
            .wait_for("Received SUBSCRIBE", 1, Duration::from_secs(5))
            .unwrap();
        publish("alice", "a-secret", "big/x", big_file, 15);
        publish("alice", "a-secret", "big/y", medium_file, 2);
        publish("bob", "b-secret", "room/a/x", small, 70);
        publish("bob", "b-secret", "room/a/y", small, 50);
        publish("bob", "b-secret", "room/b/x", small, 10);
        publish("carol", "c-secret", "room/a/z", small, 5);
        publish("watcher", "w-secret", "done", small, 1);
        sub.join().unwrap()
    });
    let received: Vec<String> = String::from_utf8_lossy(&watcher.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    let got: Vec<(&str, usize)> = want
        .iter()
        .map(|(topic, _)| (*topic, received.iter().filter(|l| l == topic).count()))
        .collect();
    assert_eq!(
        (got.as_slice(), received.last().map(String::as_str)),
        (want.as_slice(), Some("done")),
        "each budget held exactly; received {} messages; broker log:\n{}",
        received.len(),
        broker.log()
    );
    assert_eq!(
        broker.count("limiter: pub_bytes refused for user alice"),
        6,
        "{}",
        broker.log()
    );
    assert_eq!(
        broker.count("limiter: pub_topic refused for user bob"),
        20,
        "{}",
        broker.log()
    );
    assert_eq!(broker.count("limiter: no verdict"), 0, "{}", broker.log());
}

//! The real `limiter` binary on a veth in namespaces the test made: enforcement that outlives
//! the agent, adoption by a new agent, live reload, half-open clients, and configuration errors.

use std::{
    io::ErrorKind,
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream},
    time::Duration,
};

use limiter_common::{Direction, Reason, Verdict};
use limiter_tests::{
    agent::{AgentProcess, PinDir, http_in, startup_deadline},
    frames::{CLIENT_MAC, Flags, Tcp},
    kernel::wait_for,
    netns::{CLIENT_V4, Pair, SERVER_V4, Server, connect, mac_text},
    packet::PacketSocket,
};
use nix::sys::signal::Signal;

/// Namespaces, a server holding connections, a pin directory and a socket directory.
struct Setup {
    _peer: limiter::datapath::Datapath,
    pair: Pair,
    server: Server,
    pins: PinDir,
    sockets: tempfile::TempDir,
}

impl Setup {
    fn new() -> Self {
        let pair = Pair::new().expect("namespaces");
        let server = Server::start(&pair.server, IpAddr::V4(SERVER_V4)).unwrap();
        Self {
            _peer: limiter_tests::kernel::peer(&pair).unwrap(),
            pair,
            server,
            pins: PinDir::new(),
            sockets: tempfile::tempdir().unwrap(),
        }
    }

    /// `limiter run` on the server's veth with this setup's pins and socket, plus `args`.
    fn agent(&self, args: &[&str]) -> AgentProcess {
        self.agent_on(&self.pair.server_if, args)
    }

    /// The same on another interface of the server's namespace.
    fn agent_on(&self, iface: &str, args: &[&str]) -> AgentProcess {
        self.builder(iface)
            .args(args)
            .start()
            .expect("starting the agent")
    }

    /// [`agent`](Self::agent), told by `uname` that it runs on Linux 2.6.
    fn agent_on_linux_2_6(&self, args: &[&str]) -> AgentProcess {
        self.builder(&self.pair.server_if)
            .args(args)
            .on_linux_2_6()
            .start()
            .expect("starting the agent")
    }

    /// This setup's interface, pins and socket.
    fn builder(&self, iface: &str) -> limiter_tests::agent::AgentBuilder<'_> {
        AgentProcess::builder(&self.pair.server, iface, &self.pins).socket(self.socket())
    }

    fn socket(&self) -> std::path::PathBuf {
        self.sockets.path().join("limiter.sock")
    }

    fn connect(&self) -> std::io::Result<TcpStream> {
        connect(&self.pair.client, IpAddr::V4(CLIENT_V4), self.server.addr).unwrap()
    }

    /// Whether a new connection from the client is refused at once (the XDP RST).
    fn refused(&self) -> bool {
        match self.connect() {
            Ok(_) => false,
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::ConnectionRefused, "{e}");
                true
            }
        }
    }
}

#[test]
fn a_killed_agent_leaves_enforcement_on_and_a_new_one_adopts_the_counts() {
    let s = Setup::new();
    let mut agent = s.agent(&["--max-conn-per-ip", "2"]);
    agent
        .wait_for("limiter is ready", startup_deadline())
        .unwrap();
    let first = s.connect().expect("first connection");
    let _second = s.connect().expect("second connection");
    assert!(s.refused(), "the cap is 2");

    agent.signal(Signal::SIGKILL);
    agent.wait_exit(Duration::from_secs(5)).unwrap();
    assert!(s.refused(), "the kernel keeps enforcing without the agent");
    assert_eq!(s.pins.global(), 2);

    let next = s.agent(&["--max-conn-per-ip", "2"]);
    let line = next.wait_for("enforcing", startup_deadline()).unwrap();
    assert!(line.contains("Adopted"), "{line}");
    next.wait_for("limiter is ready", startup_deadline())
        .unwrap();
    assert_eq!(
        s.pins.global(),
        2,
        "counts carried over, none counted twice"
    );
    assert!(s.refused(), "still at the cap after the hand-over");
    drop(first);
    s.server.close_all();
    // The server closed both; the client's second one is closed by the server's FIN only, so
    // wait for the first to be fully gone and check the carried-over count went down.
    assert!(s.pins.wait_global(1, Duration::from_secs(5)) <= 1);
    assert!(
        s.connect().is_ok(),
        "a released slot is usable under the new agent"
    );
}

#[test]
fn sighup_lowers_a_cap_live_and_a_bad_file_changes_nothing() {
    let s = Setup::new();
    let file = s.sockets.path().join("limiter.toml");
    std::fs::write(&file, "max-conn-per-ip = 5\n").unwrap();
    let agent = s.agent(&["--config", file.to_str().unwrap()]);
    agent
        .wait_for("limiter is ready", startup_deadline())
        .unwrap();
    // Neither check-token nor check-open: said once, at the start.
    let closed = "POST /v1/check is closed until a check-token is set";
    assert_eq!(agent.log().matches(closed).count(), 1, "{}", agent.log());
    let conns: Vec<_> = (0..3)
        .map(|_| s.connect().expect("under the cap"))
        .collect();

    std::fs::write(&file, "max-conn-per-ip = 3\n").unwrap();
    agent.signal(Signal::SIGHUP);
    agent
        .wait_for("configuration reloaded", Duration::from_secs(10))
        .unwrap();
    assert!(s.refused(), "the lowered cap applies at once");

    std::fs::write(&file, "max-conn-per-ip = 10\nno-such-setting = 1\n").unwrap();
    agent.signal(Signal::SIGHUP);
    let line = agent
        .wait_for("reload refused", Duration::from_secs(10))
        .unwrap();
    assert!(line.contains("no-such-setting"), "{line}");
    assert!(s.refused(), "the old settings stay");
    assert_eq!(s.pins.maps().config().unwrap().limits.max_conn_per_ip, 3);
    drop(conns);
}

#[test]
fn sighup_applies_actions_escalation_and_tokens_live_and_names_what_waits_for_a_restart() {
    let s = Setup::new();
    let file = s.sockets.path().join("limiter.toml");
    std::fs::write(
        &file,
        "max-conn-total = 10\ncheck-open = true\n[actions.auth]\nlimit = 2\n",
    )
    .unwrap();
    let agent = s.agent(&["--config", file.to_str().unwrap(), "--max-conn-total", "50"]);
    agent
        .wait_for("limiter is ready", startup_deadline())
        .unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let client = runtime
        .block_on(limiter_client::Client::connect_unix(s.socket()))
        .unwrap();
    let allowed = |key: &str, n: usize| {
        runtime.block_on(async {
            let mut allowed = 0;
            for _ in 0..n {
                let verdict = client.check("auth", key.as_bytes(), 1).await.unwrap();
                allowed += usize::from(verdict.allowed);
            }
            allowed
        })
    };
    assert_eq!(allowed("192.0.2.1", 5), 2, "the file's limit of 2");
    let (status, _) = http(
        &s,
        reqwest::Method::POST,
        "/v1/check",
        None,
        Some(serde_json::json!({"action": "export", "key": "a"})),
    );
    assert_eq!(status, 404, "no such action yet");

    std::fs::write(
        &file,
        "max-conn-total = 20\nflow-table-size = 4096\ncheck-token = \"dash-secret\"\n\
         [broker]\nescalate-after = 2\nescalate-ban = \"5m\"\n\
         [actions.auth]\nlimit = 6\n\
         [actions.export]\nlimit = 1\nwindow = \"1m\"\nkey = \"user\"\n",
    )
    .unwrap();
    agent.signal(Signal::SIGHUP);
    agent
        .wait_for("configuration reloaded", Duration::from_secs(10))
        .unwrap();

    // Over the broker socket: the new limit, on the connection opened before the reload.
    let verdict = runtime
        .block_on(client.peek("auth", "192.0.2.9", 1))
        .unwrap();
    assert_eq!(verdict.limit, 6);
    assert_eq!(allowed("192.0.2.9", 8), 6, "the reloaded limit of 6");
    // Over HTTP: the action the reload added, for callers with the token the reload set.
    let check = |key: &str, token| {
        http(
            &s,
            reqwest::Method::POST,
            "/v1/check",
            token,
            Some(serde_json::json!({"action": "export", "key": key})),
        )
        .0
    };
    assert_eq!(check("a", None), 401, "check-open gave way to the token");
    assert_eq!(check("a", Some("dash-secret")), 200);
    assert_eq!(check("a", Some("dash-secret")), 429, "one per minute");
    // Escalation, off at the start, bans the third reported failure.
    let escalations = runtime.block_on(async {
        let mut out = Vec::new();
        for _ in 0..3 {
            out.push(
                client
                    .report_auth_failure(IpAddr::V4(CLIENT_V4))
                    .await
                    .unwrap(),
            );
        }
        out
    });
    assert_eq!(
        escalations[2],
        limiter_client::Escalation::Banned,
        "{escalations:?}"
    );
    assert_eq!(s.pins.maps().bans().unwrap().len(), 1, "a kernel ban");

    // What needs a restart is named in the log and in /v1/status, with what flags pin.
    let log = agent.log();
    assert!(
        log.lines()
            .any(|l| l.contains("flow-table-size") && l.contains("takes effect on restart")),
        "{log}"
    );
    for needle in ["actions.auth", "broker.escalate"] {
        assert!(
            !log.lines()
                .any(|l| l.contains(needle) && l.contains("takes effect on restart")),
            "{needle} applies live: {log}"
        );
    }
    assert!(
        log.lines()
            .any(|l| l.contains("cannot change") && l.contains("max-conn-total")),
        "{log}"
    );
    let (_, status) = http(&s, reqwest::Method::GET, "/v1/status", None, None);
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(
        status["restart_required"],
        serde_json::json!(["flow-table-size"]),
        "{status}"
    );
    let pinned = status["pinned"].as_array().unwrap();
    assert!(
        pinned.contains(&serde_json::json!("max-conn-total")),
        "{status}"
    );
    assert_eq!(
        s.pins.maps().config().unwrap().limits.max_conn_total,
        50,
        "the flag still wins"
    );
}

#[test]
fn monitor_mode_lets_every_connection_in_counts_what_enforce_would_refuse_and_switches_live() {
    let s = Setup::new();
    let file = s.sockets.path().join("limiter.toml");
    std::fs::write(&file, "mode = \"monitor\"\nmax-conn-per-ip = 2\n").unwrap();
    let agent = s.agent(&["--config", file.to_str().unwrap()]);
    agent
        .wait_for("limiter is ready", startup_deadline())
        .unwrap();
    let conns: Vec<_> = (0..5)
        .map(|i| {
            s.connect()
                .unwrap_or_else(|e| panic!("connection {i}: {e}"))
        })
        .collect();
    assert_eq!(
        s.pins.wait_global(5, Duration::from_secs(5)),
        5,
        "all tracked"
    );
    let (_, text) = http(&s, reqwest::Method::GET, "/metrics", None, None);
    assert_eq!(
        sample(
            &text,
            r#"limiter_would_refuse_total{profile="default",reason="conn_per_ip"}"#
        ),
        3.0,
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            r#"limiter_refused_connections_total{profile="default",reason="conn_per_ip"}"#
        ),
        0.0
    );
    let (_, text) = http(&s, reqwest::Method::GET, "/v1/status", None, None);
    let status: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(status["limits"]["mode"], "monitor", "{status}");

    std::fs::write(&file, "mode = \"enforce\"\nmax-conn-per-ip = 2\n").unwrap();
    agent.signal(Signal::SIGHUP);
    agent
        .wait_for("configuration reloaded", Duration::from_secs(10))
        .unwrap();
    assert!(s.refused(), "enforced at once: the source holds 5 of 2");
    let (_, text) = http(&s, reqwest::Method::GET, "/metrics", None, None);
    assert_eq!(
        sample(
            &text,
            r#"limiter_refused_connections_total{profile="default",reason="conn_per_ip"}"#
        ),
        1.0
    );
    drop(conns);
}

/// Two port profiles on a real agent: the top level's listener and a dashboard's, each capped
/// on its own counts (a source at one's cap still connects to the other), the dashboard's cap
/// raised live by SIGHUP, and both shown apart in the metrics, `/v1/status`, `/connections`
/// and `limiter status`.
#[test]
fn port_profiles_cap_their_own_ports_change_live_and_show_apart() {
    let s = Setup::new();
    let dashboard = Server::start(&s.pair.server, IpAddr::V4(SERVER_V4)).unwrap();
    let (top_port, dash_port) = (s.server.addr.port(), dashboard.addr.port());
    let file = s.sockets.path().join("limiter.toml");
    let config = |dash_cap: u32| {
        format!(
            "ports = [{top_port}]\nmax-conn-per-ip = 3\nsyn-rate = 0\n\n\
             [profiles.dashboard]\nports = [{dash_port}]\nmax-conn-per-ip = {dash_cap}\n"
        )
    };
    std::fs::write(&file, config(1)).unwrap();
    let agent = s.agent(&["--config", file.to_str().unwrap()]);
    agent
        .wait_for("limiter is ready", startup_deadline())
        .unwrap();
    let to_dashboard = || connect(&s.pair.client, IpAddr::V4(CLIENT_V4), dashboard.addr).unwrap();
    let top: Vec<_> = (0..3)
        .map(|_| s.connect().expect("under the top level's cap"))
        .collect();
    assert!(s.refused(), "the top level's cap is 3");
    let first = to_dashboard().expect("its own count: the top level's 3 do not spend it");
    let refused = to_dashboard().expect_err("the dashboard's cap is 1");
    assert_eq!(refused.kind(), ErrorKind::ConnectionRefused);
    assert_eq!(s.pins.wait_global(4, Duration::from_secs(5)), 4);

    let (_, text) = http(&s, reqwest::Method::GET, "/metrics", None, None);
    assert_eq!(
        sample(&text, r#"limiter_connections{profile="default"}"#),
        3.0
    );
    assert_eq!(
        sample(&text, r#"limiter_connections{profile="dashboard"}"#),
        1.0
    );
    let refusals = |profile: &str| {
        sample(
            &text,
            &format!(
                r#"limiter_refused_connections_total{{profile="{profile}",reason="conn_per_ip"}}"#
            ),
        )
    };
    assert_eq!((refusals("default"), refusals("dashboard")), (1.0, 1.0));
    let (_, text) = http(&s, reqwest::Method::GET, "/v1/status", None, None);
    let status: serde_json::Value = serde_json::from_str(&text).unwrap();
    let profiles = status["profiles"].as_array().expect("profiles");
    assert_eq!(profiles.len(), 2, "{status}");
    assert_eq!(profiles[0]["name"], "default");
    assert_eq!(profiles[0]["ports"], serde_json::json!([top_port]));
    assert_eq!(profiles[1]["name"], "dashboard");
    assert_eq!(profiles[1]["ports"], serde_json::json!([dash_port]));
    assert_eq!(profiles[1]["max_conn_per_ip"], 1);
    assert_eq!(profiles[1]["connections"], 1);
    assert_eq!(profiles[1]["refused"]["conn_per_ip"], 1);
    let (_, text) = http(&s, reqwest::Method::GET, "/connections", None, None);
    let connections: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(connections["profiles"]["dashboard"], 1, "{connections}");
    let by_profile: Vec<_> = connections["sources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["profile"].as_str().unwrap().to_owned(),
                s["connections"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        by_profile,
        [("default".to_owned(), 3), ("dashboard".to_owned(), 1)],
        "one source, counted in each profile apart"
    );
    let out = s
        .pair
        .server
        .command(limiter_tests::agent::binary().to_str().unwrap())
        .unwrap()
        .arg("status")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains(&format!(
            "profile     dashboard (ports {dash_port}): 1 open; per source 1"
        )),
        "{text}"
    );

    std::fs::write(&file, config(2)).unwrap();
    agent.signal(Signal::SIGHUP);
    agent
        .wait_for("configuration reloaded", Duration::from_secs(10))
        .unwrap();
    let second = to_dashboard().expect("the dashboard's cap raised live");
    assert!(to_dashboard().is_err(), "and held at 2");
    assert!(s.refused(), "the top level's unchanged");
    drop((top, first, second));
}

/// Kernel escalation, tried both ways an attacker would: SYNs forged in a victim's name (at
/// its cap) for longer than `escalate-refused-for` never make it an offender, since their
/// handshakes never complete; a real client that keeps opening connections over its cap is
/// refused at each proven handshake, and banned once that has gone on long enough.
#[test]
fn kernel_escalation_bans_a_source_refused_at_its_handshakes_never_a_forged_one() {
    let s = Setup::new();
    let agent = s.agent(&[
        "--max-conn-per-ip",
        "1",
        "--syn-rate",
        "0",
        "--escalate-refused-for",
        "2s",
        "--sweep-interval",
        "200ms",
    ]);
    agent
        .wait_for("limiter is ready", startup_deadline())
        .unwrap();
    let held = s.connect().expect("under the cap");
    let maps = s.pins.maps();
    // The forger: 3 s of SYNs in the victim's name. The host answers each, as over-cap SYNs
    // now reach it, and the victim's stack resets the SYN-ACKs it never asked for.
    let until = std::time::Instant::now() + Duration::from_secs(3);
    let mut forged = 0;
    while std::time::Instant::now() < until {
        send_raw_syn(&s.pair, CLIENT_V4, s.server.addr);
        forged += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(forged > 50);
    assert_eq!(
        maps.offenders().unwrap(),
        [],
        "no forged SYN proves anything"
    );
    assert_eq!(maps.bans().unwrap().len(), 0);
    // The offender: the client itself, over its cap again and again. Each handshake
    // completes, is refused at its ACK (the host never keeps it) and counts; once that has
    // gone on for 2 s, the next sweep bans it and its SYNs are dropped: connect times out.
    let mut refused = 0;
    let banned = (0..200).any(|_| match s.connect() {
        Ok(_) => {
            refused += 1;
            std::thread::sleep(Duration::from_millis(50));
            false
        }
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
            true
        }
    });
    assert!(
        banned,
        "still not banned after {refused} refused handshakes"
    );
    assert!(refused >= 10, "banned after only {refused} refusals");
    agent
        .wait_for("escalated to a ban", Duration::from_secs(5))
        .unwrap();
    assert_eq!(maps.bans().unwrap().len(), 1);
    assert!(
        maps.packets(Direction::Ingress, Verdict::Rst, Reason::ConnPerIp)
            .unwrap()
            >= refused,
        "each refused at its ACK"
    );
    drop(held);
}

#[test]
fn a_half_open_client_holds_no_slot() {
    let s = Setup::new();
    let agent = s.agent(&["--max-conn-per-ip", "1", "--max-conn-total", "1"]);
    agent
        .wait_for("limiter is ready", startup_deadline())
        .unwrap();
    // A SYN from an address nobody answers for: the SYN-ACK finds no one and the handshake
    // never completes, as with a spoofed source or a client that vanished.
    let ghost = Ipv4Addr::new(10, 77, 0, 50);
    send_raw_syn(
        &s.pair,
        ghost,
        SocketAddr::new(IpAddr::V4(SERVER_V4), s.server.addr.port()),
    );
    let maps = s.pins.maps();
    let half_open = || {
        maps.packets(Direction::Ingress, Verdict::Pass, Reason::HalfOpen)
            .unwrap()
    };
    assert_eq!(wait_for(1, half_open), 1, "the SYN passed half-open");
    assert_eq!(maps.global_connections().unwrap(), 0, "holding no slot");
    // So a real client gets the host's only slot.
    let conn = s.connect().expect("the real client");
    assert_eq!(s.pins.wait_global(1, Duration::from_secs(5)), 1);
    assert_eq!(maps.all_source_connections().unwrap().len(), 1);
    drop(conn);
}

/// The attacker's way past a cap: stage handshakes while under it, hold their ACKs back until
/// the agent has swept the half-open records (after `syn-timeout`; a flood of the half-open
/// table evicts them as well), then complete them all. The ACKs then belong to nothing the
/// programs know, so they pass, and the host completes connections nobody counted. The client
/// here is raw frames from an address its namespace does not hold (so no stack there answers
/// the SYN-ACKs), through an AF_PACKET socket. The sweeper finds the connections in the host's
/// socket table, counts the first and closes the two past the cap.
#[test]
fn handshakes_completed_after_their_records_were_swept_cannot_pass_the_cap() {
    let s = Setup::new();
    let agent = s.agent(&[
        "--max-conn-per-ip",
        "1",
        "--syn-timeout",
        "300ms",
        "--sweep-interval",
        "100ms",
    ]);
    agent
        .wait_for("limiter is ready", startup_deadline())
        .unwrap();
    let attacker = Ipv4Addr::new(10, 77, 0, 60);
    s.pair
        .server
        .exec(&[
            "ip",
            "neigh",
            "replace",
            &attacker.to_string(),
            "lladdr",
            &mac_text(CLIENT_MAC),
            "dev",
            &s.pair.server_if,
        ])
        .unwrap();
    let port = s.server.addr.port();
    let syns: Vec<Tcp> = (0..3)
        .map(|i| {
            Tcp::syn(
                IpAddr::V4(attacker),
                41_000 + i,
                IpAddr::V4(SERVER_V4),
                port,
            )
        })
        .collect();
    let maps = s.pins.maps();
    s.pair
        .client
        .run(|| {
            let socket = PacketSocket::bind(&s.pair.client_if).unwrap();
            // Under the cap (no connection yet), each SYN passes half-open.
            let mut isns = std::collections::HashMap::new();
            for syn in &syns {
                assert!(socket.send(&syn.build()).unwrap());
            }
            while isns.len() < syns.len() {
                let (sport, isn) = socket
                    .receive(Duration::from_secs(5), |frame| syn_ack_to(frame, port))
                    .unwrap()
                    .expect("the host's SYN-ACK");
                isns.insert(sport, isn);
            }
            // Held back until the records are swept.
            assert_eq!(wait_for(0, || maps.half_open().unwrap().len()), 0);
            for syn in &syns {
                let mut ack = syn.with_flags(Flags {
                    ack: true,
                    ..Flags::default()
                });
                ack.seq = syn.seq.wrapping_add(1);
                ack.ack = isns[&syn.sport].wrapping_add(1);
                ack.tcp_options = false;
                assert!(socket.send(&ack.build()).unwrap());
            }
        })
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while s.server.accepted() < 3 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        s.server.accepted(),
        3,
        "the host completed the staged handshakes"
    );
    let source = IpAddr::V4(attacker);
    assert_eq!(
        wait_for(1, || maps.source_connections(source).unwrap()),
        1,
        "one counted, two closed"
    );
    let (_, text) = http(&s, reqwest::Method::GET, "/metrics", None, None);
    assert_eq!(
        sample(&text, r#"limiter_evictions_total{kind="over_cap"}"#),
        2.0
    );
    assert_eq!(sample(&text, "limiter_adopted_flows_total"), 3.0);
}

/// The source port and sequence number of a SYN-ACK from the server's `port`, if `frame` is one.
fn syn_ack_to(frame: &[u8], port: u16) -> Option<(u16, u32)> {
    let sliced = etherparse::SlicedPacket::from_ethernet(frame).ok()?;
    let Some(etherparse::TransportSlice::Tcp(tcp)) = sliced.transport else {
        return None;
    };
    (tcp.source_port() == port && tcp.syn() && tcp.ack())
        .then(|| (tcp.destination_port(), tcp.sequence_number()))
}

/// Sends one TCP SYN with a forged source address from the client namespace (raw socket).
fn send_raw_syn(pair: &Pair, src: Ipv4Addr, dst: SocketAddr) {
    use socket2::{Domain, Protocol, Socket, Type};
    let IpAddr::V4(dst_ip) = dst.ip() else {
        panic!("IPv4 only")
    };
    let builder = etherparse::PacketBuilder::ipv4(src.octets(), dst_ip.octets(), 64)
        .tcp(40_000, dst.port(), 7, 64_240)
        .syn();
    let mut packet = Vec::new();
    builder.write(&mut packet, &[]).unwrap();
    pair.client
        .run(|| {
            // IPPROTO_RAW: the packet carries its own IP header.
            let socket = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::from(255)))?;
            socket.send_to(&packet, &dst.into())
        })
        .unwrap()
        .expect("sending the raw SYN");
}

#[test]
fn bad_configuration_exits_2_and_attaches_nothing() {
    let s = Setup::new();
    let file = s.sockets.path().join("bad.toml");
    std::fs::write(&file, "max-conn-per-ip = 5\nmax-conn-per-ipp = 6\n").unwrap();
    for (args, named) in [
        (vec!["--ports", "70000"], "ports"),
        (vec!["--allow", "10.0.0.0/33"], "allow"),
        (vec!["--ipv6-prefix", "129"], "ipv6-prefix"),
        (vec!["--config", file.to_str().unwrap()], "max-conn-per-ipp"),
        (vec!["--flow-table-size", "4294967295"], "flow-table-size"),
        (vec!["--iface", "missing0"], "iface"),
    ] {
        let mut agent = s.agent(&args);
        let status = agent.wait_exit(startup_deadline()).unwrap();
        assert_eq!(status.code(), Some(2), "{args:?}: {}", agent.log());
        assert!(
            agent.log().contains(named),
            "{args:?} should name {named}: {}",
            agent.log()
        );
        assert!(!s.pins.0.exists(), "nothing pinned");
        assert!(!s.socket().exists(), "no socket left");
    }
    assert!(!link_shows(&s, "xdp"), "nothing attached");
}

#[test]
fn a_kernel_older_than_the_floor_is_refused_with_the_reason_and_nothing_attached() {
    let s = Setup::new();
    let mut agent = s.agent_on_linux_2_6(&["--max-conn-per-ip", "1"]);
    let status = agent.wait_exit(startup_deadline()).unwrap();
    let log = agent.log();
    assert!(!status.success(), "{log}");
    for words in [
        "Linux 2.6 is too old",
        "5.15 or newer",
        "compare-and-swap",
        "BPF ring buffer",
    ] {
        assert!(
            log.contains(words),
            "the refusal should say {words:?}: {log}"
        );
    }
    assert!(!log.contains("limiter is ready"), "{log}");
    assert!(!s.pins.0.exists(), "nothing pinned: {log}");
    assert!(!s.socket().exists(), "no socket left");
    assert!(!link_shows(&s, "xdp"), "nothing attached");
    let _first = s.connect().expect("a connection");
    assert!(s.connect().is_ok(), "the cap of 1 is not enforced");
}

/// Whether `ip link show` of the server's veth mentions `what` (an XDP program, a qdisc).
fn link_shows(s: &Setup, what: &str) -> bool {
    let out = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            s.pair.server.name(),
            "ip",
            "link",
            "show",
            &s.pair.server_if,
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).contains(what)
}

#[test]
fn detach_removes_programs_links_and_pins() {
    let s = Setup::new();
    let mut agent = s.agent(&["--max-conn-per-ip", "1"]);
    agent
        .wait_for("limiter is ready", startup_deadline())
        .unwrap();
    let _held = s.connect().unwrap();
    assert!(s.refused());
    agent.signal(Signal::SIGTERM);
    let status = agent.wait_exit(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "{status}: {}", agent.log());
    assert!(s.refused(), "a clean stop leaves enforcement on too");
    // An agent given another interface (the namespace's own loopback) says the veth is still
    // enforced through the earlier agent's links.
    let mut other = s.agent_on("lo", &["--xdp-mode", "skb", "--max-conn-per-ip", "1"]);
    let line = other
        .wait_for("still enforcing", startup_deadline())
        .unwrap();
    assert!(line.contains(&s.pair.server_if), "{line}");
    assert!(s.refused());
    other.signal(Signal::SIGTERM);
    let status = other.wait_exit(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "{status}: {}", other.log());
    let out = std::process::Command::new(limiter_tests::agent::binary())
        .args(["detach", "--pin-dir", s.pins.arg()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&s.pair.server_if) && stdout.contains("lo"),
        "{stdout}"
    );
    assert!(!s.pins.0.exists(), "pins removed");
    assert!(s.connect().is_ok(), "no longer limited");
}

#[test]
fn repeated_auth_refusals_become_a_kernel_ban() {
    let s = Setup::new();
    let agent = s.agent(&[
        "--auth-limit",
        "2",
        "--escalate-after",
        "3",
        "--escalate-ban",
        "10m",
        "--reject-ban",
        "rst",
    ]);
    agent
        .wait_for("limiter is ready", startup_deadline())
        .unwrap();
    assert!(s.connect().is_ok(), "not banned yet");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let refused = runtime.block_on(async {
        let client = limiter_client::Client::connect_unix(s.socket())
            .await
            .unwrap();
        let key = CLIENT_V4.to_string();
        let mut refused = 0;
        // Two attempts pass the limit; more than three refusals escalate.
        for _ in 0..6 {
            if !client
                .check("auth", key.as_bytes(), 1)
                .await
                .unwrap()
                .allowed
            {
                refused += 1;
            }
        }
        refused
    });
    assert_eq!(refused, 4);
    let bans = s.pins.maps().bans().unwrap();
    assert_eq!(bans.len(), 1, "one kernel ban");
    assert_eq!(
        limiter::datapath::kernel_keys::key_address(&bans[0].0),
        IpAddr::V4(CLIENT_V4)
    );
    assert!(
        s.refused(),
        "the banned client no longer reaches the broker"
    );
}

/// One HTTP request to the agent's listener (inside the server namespace); returns the status
/// and the body.
fn http(
    s: &Setup,
    method: reqwest::Method,
    path: &str,
    token: Option<&str>,
    body: Option<serde_json::Value>,
) -> (u16, String) {
    let url = format!("http://{}{path}", limiter_tests::agent::TEST_HTTP);
    http_in(&s.pair.server, method, &url, token, body).expect("the agent answers")
}

/// The value of one sample in a Prometheus text exposition.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no sample {series} in:\n{text}"))
}

#[test]
fn metrics_move_with_traffic_and_admin_calls_need_the_token() {
    let s = Setup::new();
    let agent = s.agent(&["--max-conn-per-ip", "1", "--admin-token", "s3cret"]);
    agent
        .wait_for("limiter is ready", startup_deadline())
        .unwrap();
    let admitted = r#"limiter_packets_total{direction="ingress",reason="admitted",verdict="pass"}"#;
    let refused =
        r#"limiter_packets_total{direction="ingress",reason="conn_per_ip",verdict="rst"}"#;
    let (status, before) = http(&s, reqwest::Method::GET, "/metrics", None, None);
    assert_eq!(status, 200);
    assert_eq!(sample(&before, admitted), 0.0);
    assert_eq!(
        sample(&before, r#"limiter_connections{profile="default"}"#),
        0.0
    );

    let _held = s.connect().expect("under the cap");
    assert!(s.refused());
    let (_, after) = http(&s, reqwest::Method::GET, "/metrics", None, None);
    assert_eq!(sample(&after, admitted), 1.0);
    assert_eq!(sample(&after, refused), 1.0);
    assert_eq!(
        sample(&after, r#"limiter_connections{profile="default"}"#),
        1.0
    );
    assert_eq!(sample(&after, "limiter_tracked_sources"), 1.0);

    // Without the token, or with a wrong one: 401, and nothing changes.
    let ban = serde_json::json!({"addr": CLIENT_V4.to_string(), "ttl": "10m"});
    for token in [None, Some("wrong")] {
        let (status, _) = http(
            &s,
            reqwest::Method::POST,
            "/v1/bans",
            token,
            Some(ban.clone()),
        );
        assert_eq!(status, 401);
        let (status, _) = http(
            &s,
            reqwest::Method::POST,
            "/v1/deny",
            token,
            Some(serde_json::json!({"cidr": "10.77.0.0/24"})),
        );
        assert_eq!(status, 401);
    }
    assert!(s.pins.maps().bans().unwrap().is_empty());
    assert_eq!(s.pins.maps().config().unwrap().has_deny, 0);
    // With it, the ban reaches the kernel.
    let (status, body) = http(
        &s,
        reqwest::Method::POST,
        "/v1/bans",
        Some("s3cret"),
        Some(ban),
    );
    assert!((200..300).contains(&status), "{status} {body}");
    assert_eq!(s.pins.maps().bans().unwrap().len(), 1);
    let (_, text) = http(&s, reqwest::Method::GET, "/metrics", None, None);
    assert_eq!(sample(&text, "limiter_bans_active"), 1.0);
}

#[test]
fn a_failed_attach_leaves_no_pins_links_or_socket() {
    let s = Setup::new();
    // The interface exists, so the start gets as far as creating its pins before the attach
    // fails: another agent, with its own pin directory, enforces there.
    let other_pins = PinDir::new();
    let first = AgentProcess::builder(&s.pair.server, &s.pair.server_if, &other_pins)
        .http("127.0.0.1:0")
        .ready()
        .unwrap();
    let mut second = s
        .builder(&s.pair.server_if)
        .http("127.0.0.1:0")
        .start()
        .unwrap();
    let status = second.wait_exit(startup_deadline()).unwrap();
    assert!(!status.success(), "{}", second.log());
    let log = second.log();
    assert!(log.contains("already enforced"), "{log}");
    assert!(!s.pins.0.exists(), "the failed start left its pins: {log}");
    assert!(!s.socket().exists(), "the failed start left its socket");
    drop(first);
    let out = std::process::Command::new(limiter_tests::agent::binary())
        .args(["detach", "--pin-dir", other_pins.arg()])
        .output()
        .unwrap();
    assert!(out.status.success());
}

#[test]
fn a_second_agent_for_the_same_pins_names_the_first_and_leaves_it_alone() {
    let s = Setup::new();
    let first = s
        .builder(&s.pair.server_if)
        .http("127.0.0.1:0")
        .args(["--max-conn-per-ip", "1"])
        .start()
        .unwrap();
    first
        .wait_for("limiter is ready", startup_deadline())
        .unwrap();
    let _held = s.connect().unwrap();
    assert!(s.refused());
    let pid = std::fs::read_dir(&s.pins.0)
        .unwrap()
        .filter_map(Result::ok)
        .find_map(|e| {
            let name = e.file_name().into_string().unwrap();
            name.strip_prefix("agent-").map(str::to_owned)
        })
        .expect("the first agent's pid record");
    let other_socket = s.sockets.path().join("second.sock");
    let mut second = AgentProcess::builder(&s.pair.server, &s.pair.server_if, &s.pins)
        .socket(&other_socket)
        .http("127.0.0.1:0")
        .args(["--max-conn-per-ip", "50"])
        .start()
        .unwrap();
    let status = second.wait_exit(startup_deadline()).unwrap();
    assert_eq!(status.code(), Some(1), "{}", second.log());
    let log = second.log();
    assert!(log.contains(&format!("pid {}", pid.trim())), "{log}");
    assert!(!log.contains("File exists"), "{log}");
    assert!(!other_socket.exists());
    assert!(s.refused(), "the first agent's limits still hold");
    drop(first);
}

#[test]
fn a_private_mount_namespace_is_refused_with_an_explanation() {
    let s = Setup::new();
    let mut agent = s
        .builder(&s.pair.server_if)
        .in_private_mount_namespace()
        .start()
        .unwrap();
    // Bounded: an agent that did not refuse would run until killed.
    let status = agent.wait_exit(startup_deadline()).ok();
    let log = agent.log();
    assert_eq!(status.and_then(|s| s.code()), Some(2), "{log}");
    assert!(log.contains("nsenter --net="), "{log}");
    assert!(!s.pins.0.exists());
    assert!(!s.socket().exists());
}

#[test]
fn admin_requests_over_tcp_need_the_broker_admin_token() {
    let s = Setup::new();
    let file = s.sockets.path().join("limiter.toml");
    std::fs::write(&file, "[broker]\nlisten = \"127.0.0.1:7171\"\n").unwrap();
    let agent = s.agent(&["--config", file.to_str().unwrap()]);
    agent
        .wait_for("limiter is ready", startup_deadline())
        .unwrap();
    let addr = IpAddr::V4(CLIENT_V4);
    let code = |result: Result<(), limiter_client::ClientError>| match result {
        Err(limiter_client::ClientError::Server { code, .. }) => Some(code),
        Ok(()) => None,
        Err(other) => panic!("{other}"),
    };
    // Every TCP client of the agent runs in the server's namespace, where it listens.
    let over_tcp = |token: Option<&'static str>| {
        s.pair
            .server
            .run(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                runtime.block_on(async move {
                    let client =
                        limiter_client::Client::connect_tcp("127.0.0.1:7171".parse().unwrap())
                            .await
                            .unwrap();
                    let authenticated = match token {
                        Some(token) => code(client.authenticate(token).await),
                        None => None,
                    };
                    let banned = code(client.ban(addr, Duration::from_secs(600)).await);
                    (authenticated, banned)
                })
            })
            .unwrap()
    };
    use limiter_client::ErrorCode::{BadToken, NotPermitted};
    assert_eq!(
        over_tcp(None),
        (None, Some(NotPermitted)),
        "no token, no ban"
    );
    assert_eq!(
        over_tcp(Some("s3cret")),
        (Some(NotPermitted), Some(NotPermitted)),
        "an agent without a token accepts none"
    );
    assert!(s.pins.maps().bans().unwrap().is_empty());

    // The token arrives with a reload.
    std::fs::write(
        &file,
        "[broker]\nlisten = \"127.0.0.1:7171\"\nadmin-token = \"s3cret\"\n",
    )
    .unwrap();
    agent.signal(Signal::SIGHUP);
    agent
        .wait_for("configuration reloaded", Duration::from_secs(10))
        .unwrap();
    assert_eq!(
        over_tcp(Some("s3cre")),
        (Some(BadToken), Some(NotPermitted)),
        "a wrong token changes nothing"
    );
    assert!(s.pins.maps().bans().unwrap().is_empty());
    assert_eq!(over_tcp(None), (None, Some(NotPermitted)));
    assert_eq!(
        over_tcp(Some("s3cret")),
        (None, None),
        "authenticated, banned"
    );
    let bans = s.pins.maps().bans().unwrap();
    assert_eq!(bans.len(), 1, "a kernel ban");
    assert_eq!(
        limiter::datapath::kernel_keys::key_address(&bans[0].0),
        addr
    );
}

#[test]
fn pins_of_another_layout_are_refused_naming_the_map_and_the_way_out() {
    let s = Setup::new();
    limiter::datapath::pins::ensure_bpffs(&s.pins.0).unwrap();
    let maps = s.pins.0.join("maps");
    std::fs::create_dir_all(&maps).unwrap();
    // What another build could have left: STATS with 4-byte counters where this one keeps 8.
    aya::maps::PerCpuArray::<aya::maps::MapData, u32>::create(4, 0)
        .unwrap()
        .pin(maps.join("STATS"))
        .unwrap();
    let mut agent = s
        .builder(&s.pair.server_if)
        .http("127.0.0.1:0")
        .start()
        .unwrap();
    let status = agent.wait_exit(startup_deadline()).unwrap();
    assert!(!status.success());
    let log = agent.log();
    assert!(log.contains("pinned map STATS"), "{log}");
    assert!(
        log.contains("value size 4") && log.contains("value size 8"),
        "{log}"
    );
    assert!(log.contains("limiter detach"), "{log}");
    // Checked before anything was loaded: the stale pin is left for the operator, and nothing
    // was added beside it.
    let pinned: Vec<String> = std::fs::read_dir(&maps)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(pinned, ["STATS"]);
    assert!(!s.socket().exists());
    // The way out the message names works.
    let out = std::process::Command::new(limiter_tests::agent::binary())
        .args(["detach", "--pin-dir", s.pins.arg()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let agent = s
        .builder(&s.pair.server_if)
        .http("127.0.0.1:0")
        .start()
        .unwrap();
    agent
        .wait_for("limiter is ready", startup_deadline())
        .unwrap();
}

#[test]
fn syn_cookies_auto_switch_on_under_a_flood_and_off_after_it() {
    let s = Setup::new();
    for setting in ["net.ipv4.tcp_syncookies=2", "net.ipv4.tcp_timestamps=2"] {
        s.pair
            .server
            .exec(&["sysctl", "-q", "-w", setting])
            .unwrap();
    }
    let agent = s.agent(&["--syn-cookies", "auto", "--syn-cookies-threshold", "500"]);
    agent
        .wait_for("limiter is ready", startup_deadline())
        .unwrap();
    let server = match s.server.addr.ip() {
        IpAddr::V4(v4) => v4,
        IpAddr::V6(_) => unreachable!(),
    };
    let flood = || {
        s.pair
            .client
            .run(|| {
                limiter_tests::packet::spoof_syns(
                    &s.pair.client_if,
                    20_000,
                    CLIENT_MAC,
                    limiter_tests::frames::SERVER_MAC,
                    server,
                    s.server.addr.port(),
                )
            })
            .unwrap()
    };
    assert_eq!(flood(), 20_000);
    agent
        .wait_for("SYN cookies on", Duration::from_secs(10))
        .unwrap();
    // Now the programs answer the flood, not the host.
    assert_eq!(flood(), 20_000);
    let (_, text) = http(&s, reqwest::Method::GET, "/v1/status", None, None);
    let status: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(status["syn_cookies"]["mode"], "auto", "{status}");
    // Calm: off after ten seconds under half the threshold.
    agent
        .wait_for("SYN cookies off", Duration::from_secs(20))
        .unwrap();
    let (_, text) = http(&s, reqwest::Method::GET, "/metrics", None, None);
    assert_eq!(sample(&text, "limiter_syn_cookies_active"), 0.0);
    assert_eq!(
        sample(&text, r#"limiter_syn_cookie_switches_total{to="on"}"#),
        1.0
    );
    assert_eq!(
        sample(&text, r#"limiter_syn_cookie_switches_total{to="off"}"#),
        1.0
    );
    let answered = s
        .pins
        .maps()
        .packets(Direction::Ingress, Verdict::Cookie, Reason::Unproven)
        .unwrap();
    assert!(answered > 10_000, "{answered}");
}

//! The sweeper against a real agent's maps: evictions by kind, bounded passes, counter repair,
//! and the adoption of connections the flow table lacks. Flows come from handshakes run
//! through the programs with BPF_PROG_TEST_RUN, or from real sockets across a veth between
//! namespaces of the test's own.

use std::{
    io::{ErrorKind, Read},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener},
    time::Duration,
};

use limiter::{
    buckets::{LimiterConfig, actions::builtin_actions},
    datapath::{Adoption, SweepCursor, kernel_keys::source_key},
    services::sweeper::Sweeper,
    settings::SweepSettings,
};
use limiter_common::{AdjustRequest, Event, FlowKey, ProfileSource};
use limiter_tests::{
    frames::{Flags, Tcp},
    kernel::{TestAgent, XDP_PASS, agent, connect_run, handshake, isn, tc_run, xdp_run},
    model::mapped,
    netns::{self, CLIENT_V4, CLIENT_V6, Netns, Pair, SERVER_V4, SERVER_V6},
};

fn v4(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(192, 0, 2, last))
}

fn syn(src: IpAddr, sport: u16) -> Tcp {
    Tcp::syn(src, sport, IpAddr::V4(Ipv4Addr::new(198, 51, 100, 1)), 5672)
}

fn start(flags: &[&str]) -> TestAgent {
    let config = LimiterConfig {
        actions: builtin_actions(),
        escalation: None,
        mode: limiter::buckets::Enforcement::Enforce,
    };
    agent(flags, config, None)
}

fn send(agent: &TestAgent, seg: &Tcp) -> u32 {
    xdp_run(&agent.datapath(), &seg.build()).action
}

/// A SYN and the rest of its handshake; returns the SYN's action.
fn connect(agent: &TestAgent, syn: &Tcp) -> u32 {
    connect_run(&agent.datapath(), syn)
}

fn evicted(agent: &TestAgent, kind: &str) -> u64 {
    agent.sweep.evictions.with_label_values(&[kind]).get()
}

/// Timeouts are times, not events: the test waits them out.
fn outlive(timeout: Duration) {
    std::thread::sleep(timeout + Duration::from_millis(20));
}

#[test]
fn idle_flows_are_evicted_and_their_slots_released_once() {
    // The kernel no longer refreshes a flow's last-seen time per packet: "idle" counts from
    // the handshake's completion.
    let agent = start(&["--syn-timeout", "30ms", "--idle-timeout", "200ms"]);
    let settings = agent.settings().sweep;
    let half_open = syn(v4(2), 1);
    let established = syn(v4(3), 1);
    assert_eq!(send(&agent, &half_open), XDP_PASS);
    // The host answers; the client never acknowledges.
    tc_run(
        &agent.datapath(),
        &handshake(&half_open, isn(half_open.sport)).syn_ack,
    );
    assert_eq!(connect(&agent, &established), XDP_PASS);
    // The half-open connection is not a flow and holds no slot.
    assert_eq!(agent.with_maps(|m| m.global_connections()).unwrap(), 1);
    assert_eq!(agent.with_maps(|m| m.source_connections(v4(2))).unwrap(), 0);
    let mut sweeper = Sweeper::new();
    let report = agent.sweep_pass(&mut sweeper, &settings).unwrap();
    assert_eq!(
        (report.half_open, report.idle),
        (0, 0),
        "nothing is old yet"
    );

    outlive(settings.idle_timeout.unwrap());
    let report = agent.sweep_pass(&mut sweeper, &settings).unwrap();
    // The SYN that never completed is forgotten after syn-timeout; it held no slot.
    assert_eq!((report.half_open, report.idle), (1, 1));
    assert_eq!(agent.with_maps(|m| m.global_connections()).unwrap(), 0);
    assert_eq!(evicted(&agent, "idle"), 1);
    assert_eq!(agent.with_maps(|m| m.events(Event::Released)).unwrap(), 1);
    // A late RST of an evicted flow releases nothing more.
    send(
        &agent,
        &established.with_flags(Flags {
            rst: true,
            ..Flags::default()
        }),
    );
    assert_eq!(agent.with_maps(|m| m.global_connections()).unwrap(), 0);
    assert_eq!(agent.sweep.duration.get_sample_count(), 2);
}

#[test]
fn expired_bans_are_removed() {
    let agent = start(&[]);
    agent.ban(v4(9), Duration::from_millis(10)).unwrap();
    agent.ban(v4(10), Duration::from_secs(600)).unwrap();
    outlive(Duration::from_millis(10));
    let report = agent
        .sweep_pass(&mut Sweeper::new(), &agent.settings().sweep)
        .unwrap();
    assert_eq!(report.bans, 1);
    let bans = agent.with_maps(|m| m.bans()).unwrap();
    assert_eq!(bans.len(), 1, "the unexpired ban stays");
    assert_eq!(evicted(&agent, "ban"), 1);
}

#[test]
fn each_pass_reads_a_bounded_batch_and_the_next_resumes() {
    let agent = start(&["--idle-timeout", "10ms", "--sweep-batch", "2"]);
    for port in 1..=5 {
        connect(&agent, &syn(v4(2), port));
    }
    let settings = agent.settings().sweep;
    outlive(settings.idle_timeout.unwrap());
    let mut sweeper = Sweeper::new();
    let per_pass: Vec<u64> = (0..3)
        .map(|_| agent.sweep_pass(&mut sweeper, &settings).unwrap().idle)
        .collect();
    assert!(per_pass.iter().all(|n| *n <= 2), "{per_pass:?}");
    assert_eq!(per_pass.iter().sum::<u64>(), 5, "{per_pass:?}");
    assert_eq!(agent.with_maps(|m| m.global_connections()).unwrap(), 0);
}

#[test]
fn drifted_counters_are_repaired_after_two_sightings() {
    let agent = start(&[]);
    for port in 1..=3 {
        connect(&agent, &syn(v4(2), port));
    }
    let config = agent.with_maps(|m| m.config()).unwrap();
    let key = ProfileSource::new(source_key(v4(2), &config), 0);
    // Drift: the source's counter reads 5 for 3 flows, the global 4 for 3.
    agent
        .datapath()
        .adjust(&AdjustRequest::source(&key, 2))
        .unwrap();
    agent
        .datapath()
        .adjust(&AdjustRequest::global(0, 1))
        .unwrap();
    assert_eq!(agent.with_maps(|m| m.source_connections(v4(2))).unwrap(), 5);
    let settings = SweepSettings {
        batch: 1024,
        ..agent.settings().sweep
    };
    let mut sweeper = Sweeper::new();
    assert_eq!(
        agent.sweep_pass(&mut sweeper, &settings).unwrap().repairs,
        0,
        "seen once"
    );
    assert_eq!(
        agent.sweep_pass(&mut sweeper, &settings).unwrap().repairs,
        2,
        "seen twice"
    );
    assert_eq!(agent.with_maps(|m| m.source_connections(v4(2))).unwrap(), 3);
    assert_eq!(agent.with_maps(|m| m.global_connections()).unwrap(), 3);
    assert_eq!(agent.sweep.repairs.get(), 2);
    assert_eq!(
        agent.sweep_pass(&mut sweeper, &settings).unwrap().repairs,
        0,
        "nothing left to repair"
    );
    // Counters that agree are left alone however many passes run.
    connect(&agent, &syn(v4(3), 1));
    for _ in 0..3 {
        assert_eq!(
            agent.sweep_pass(&mut sweeper, &settings).unwrap().repairs,
            0
        );
    }
}

#[test]
fn a_cycle_whose_walk_restarts_counts_each_flow_once() {
    // Finding 12: a cycle over more flows than `sweep-batch` whose cursor (the last key of a
    // batch) is deleted before the next pass, so the walk starts again from the first key
    // and reads the first flow again. Each flow has a source of its own: the first flow's
    // source holds one connection throughout, so its counter is judged every cycle, and a
    // flow read twice must not pass for drift seen twice, "repaired" into a real one.
    let agent = start(&["--sweep-batch", "2"]);
    let mut open: Vec<Tcp> = (10..16).map(|last| syn(v4(last), 1000)).collect();
    for s in &open {
        connect(&agent, s);
    }
    let settings = agent.settings().sweep;
    let mut sweeper = Sweeper::new();
    let mut repairs = 0;
    for _cycle in 0..3 {
        // The first pass of a cycle reads the table's first two keys; the second is its cursor.
        let first = agent
            .with_maps(|m| m.flow_batch(&mut SweepCursor::default(), 2))
            .unwrap();
        repairs += agent.sweep_pass(&mut sweeper, &settings).unwrap().repairs;
        let cursor = first.flows[1].0;
        let at = open.iter().position(|s| flow_key_of(s) == cursor).unwrap();
        let closed = open.remove(at);
        let rst = closed.reply(Flags {
            rst: true,
            ..Flags::default()
        });
        tc_run(&agent.datapath(), &rst.build());
        // The rest of the cycle: from the first key again, to the end (bounded).
        let mut ended = false;
        for _ in 0..8 {
            let report = agent.sweep_pass(&mut sweeper, &settings).unwrap();
            repairs += report.repairs;
            if report.cycle_ended {
                ended = true;
                break;
            }
        }
        assert!(ended, "the walk reaches the end of the table");
    }
    assert_eq!(repairs, 0, "no drift was there to repair");
    for s in &open {
        assert_eq!(agent.with_maps(|m| m.source_connections(s.src)).unwrap(), 1);
    }
    assert_eq!(agent.with_maps(|m| m.global_connections()).unwrap(), 3);
}

fn flow_key_of(s: &Tcp) -> FlowKey {
    FlowKey {
        remote: mapped(s.src),
        local: mapped(s.dst),
        remote_port: s.sport,
        local_port: s.dport,
        _pad: 0,
    }
}

/// Repair used to run only when the whole flow table fitted one pass: a table larger than the
/// batch drifted for good.
#[test]
fn counters_of_a_table_larger_than_one_batch_are_repaired() {
    let agent = start(&["--sweep-batch", "2"]);
    for (source, ports) in [(2, 1..=3), (3, 1..=2), (4, 1..=2)] {
        for port in ports {
            connect(&agent, &syn(v4(source), port));
        }
    }
    let config = agent.with_maps(|m| m.config()).unwrap();
    let request = AdjustRequest::source(&ProfileSource::new(source_key(v4(3), &config), 0), 4);
    agent.datapath().adjust(&request).unwrap();
    assert_eq!(agent.with_maps(|m| m.source_connections(v4(3))).unwrap(), 6);
    let settings = agent.settings().sweep;
    let mut sweeper = Sweeper::new();
    // Seven flows in batches of two: a cycle is four passes; the drift must be seen in two
    // cycles, so it is repaired within three.
    let repaired = (0..12).any(|_| agent.sweep_pass(&mut sweeper, &settings).unwrap().repairs > 0);
    assert!(repaired, "no repair in three cycles");
    assert_eq!(agent.with_maps(|m| m.source_connections(v4(3))).unwrap(), 2);
    assert_eq!(agent.with_maps(|m| m.source_connections(v4(2))).unwrap(), 3);
    assert_eq!(agent.with_maps(|m| m.global_connections()).unwrap(), 7);
}

fn flow(remote: IpAddr, remote_port: u16, local_port: u16) -> FlowKey {
    FlowKey {
        remote: mapped(remote),
        local: mapped(IpAddr::V4(Ipv4Addr::new(198, 51, 100, 1))),
        remote_port,
        local_port,
        _pad: 0,
    }
}

/// The kernel side of adoption: it takes a connection's slots once, even past a cap (the
/// connection exists), and leaves alone what the datapath would not count.
#[test]
fn adoption_takes_slots_once_and_only_for_what_the_datapath_counts() {
    let agent = start(&[
        "--max-conn-per-ip",
        "1",
        "--ports",
        "5672",
        "--allow",
        "192.0.2.200/32",
    ]);
    let adopt = |flow: &FlowKey| agent.datapath().adopt(flow).unwrap();
    let tracked = syn(v4(2), 1);
    assert_eq!(connect(&agent, &tracked), XDP_PASS);
    assert_eq!(adopt(&flow(v4(2), 1, 5672)), Adoption::Skipped, "tracked");
    assert_eq!(
        adopt(&flow(v4(3), 1, 80)),
        Adoption::Skipped,
        "not protected"
    );
    assert_eq!(
        adopt(&flow(v4(200), 1, 5672)),
        Adoption::Skipped,
        "allowlisted"
    );
    assert_eq!(agent.with_maps(|m| m.global_connections()).unwrap(), 1);
    assert_eq!(adopt(&flow(v4(3), 1, 5672)), Adoption::Adopted);
    assert_eq!(adopt(&flow(v4(3), 1, 5672)), Adoption::Skipped, "once");
    assert_eq!(adopt(&flow(v4(3), 2, 5672)), Adoption::OverCap);
    assert_eq!(agent.with_maps(|m| m.source_connections(v4(3))).unwrap(), 2);
    assert_eq!(agent.with_maps(|m| m.global_connections()).unwrap(), 3);
    // An adopted flow closes like any other: the host's RST releases its slot.
    let rst = syn(v4(3), 2).reply(Flags {
        rst: true,
        ..Flags::default()
    });
    tc_run(&agent.datapath(), &rst.build());
    assert_eq!(agent.with_maps(|m| m.source_connections(v4(3))).unwrap(), 1);
}

/// What an attacker gains by getting a handshake past the programs unjudged (holding its ACK
/// back until its half-open record is swept after `syn-timeout`, or flooding the half-open
/// table until the record is evicted): the host completes the connection, and nothing counts
/// it. The sweeper finds such connections in the host's socket table: one open before the
/// agent's first cycle is counted as it is; one that appears later and takes its source past
/// its cap is closed, as the programs would have refused it at its ACK. Only connections from
/// another host, routed back through an interface the programs are attached to, are adopted.
#[test]
fn untracked_connections_are_adopted_and_those_past_a_cap_closed() {
    // One flow per pass: a cycle over the flow table takes several passes, and a connection
    // that gets in unjudged must still be found at the next pass, not at the cycle's end.
    let agent = start(&[
        "--max-conn-per-ip",
        "2",
        "--ports",
        "5672",
        "--sweep-batch",
        "1",
    ]);
    for port in 1..=4 {
        assert_eq!(connect(&agent, &syn(v4(9), port)), XDP_PASS);
    }
    let settings = agent.settings().sweep;
    // Real sockets across a veth (no program attached: the handshakes go unjudged).
    let pair = Pair::new().unwrap();
    let server = SocketAddr::new(IpAddr::V4(SERVER_V4), 5672);
    let listener = pair
        .server
        .run(|| TcpListener::bind(server))
        .unwrap()
        .unwrap();
    let open = |from: &Netns, src: Ipv4Addr| {
        let conn = netns::connect(from, IpAddr::V4(src), server)
            .unwrap()
            .unwrap();
        (conn, listener.accept().unwrap().0)
    };
    // The sweeper reads the socket table and the addresses of the namespace it runs in.
    let pass = |sweeper: &mut Sweeper| {
        pair.server
            .run(|| agent.sweep_pass(sweeper, &settings).unwrap())
            .unwrap()
    };
    let connections = |src: Ipv4Addr| {
        agent
            .with_maps(|m| m.source_connections(IpAddr::V4(src)))
            .unwrap()
    };
    let before = [
        open(&pair.client, CLIENT_V4),
        open(&pair.client, CLIENT_V4),
        open(&pair.client, CLIENT_V4),
    ];
    // From the host's own address: through loopback, never past the programs.
    let _local = open(&pair.server, SERVER_V4);
    assert_eq!(pass(&mut Sweeper::new()).adopted, 0, "no interface judged");
    let mut sweeper = Sweeper::for_interfaces(vec![pair.server_if.clone()]);
    let report = pass(&mut sweeper);
    assert_eq!((report.adopted, report.over_cap), (3, 0), "{report:?}");
    assert_eq!(
        connections(CLIENT_V4),
        3,
        "open before the agent: counted, kept"
    );
    assert_eq!(
        connections(SERVER_V4),
        0,
        "a local client is not the programs' to count"
    );
    assert_eq!(agent.sweep.adoptions.get(), 3);

    let (mut late, _accepted) = open(&pair.client, CLIENT_V4);
    // The second pass of a cycle of at least seven (four flows from test runs, three adopted).
    let report = pass(&mut sweeper);
    assert_eq!((report.adopted, report.over_cap), (1, 1), "{report:?}");
    assert_eq!(evicted(&agent, "over_cap"), 1);
    assert_eq!(connections(CLIENT_V4), 3, "the late one's slot is released");
    late.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut byte = [0; 1];
    match late.read(&mut byte) {
        Err(e) => assert_eq!(e.kind(), ErrorKind::ConnectionReset, "{e}"),
        Ok(n) => assert_eq!(n, 0, "the client's end is closed"),
    }
    assert_eq!(
        pass(&mut sweeper).adopted,
        0,
        "every live connection is tracked now"
    );
    drop(before);
}

/// A listener on the server's side of a fresh pair, and the sweeper's view from inside the
/// server's namespace (the socket table and the routes it reads are that namespace's).
struct Served {
    pair: Pair,
    listener: TcpListener,
    port: u16,
}

impl Served {
    /// Listens on every address of the server's namespace, IPv4 and IPv6, so a connection to
    /// any of them (an alias, another interface's address) is served.
    fn new(port: u16) -> Self {
        let pair = Pair::new().unwrap();
        let listener = pair
            .server
            .run(|| TcpListener::bind((Ipv6Addr::UNSPECIFIED, port)))
            .unwrap()
            .unwrap();
        Self {
            pair,
            listener,
            port,
        }
    }

    /// A connection from `src` (an address of `from`) to `dst`, both ends held.
    fn open(
        &self,
        from: &Netns,
        src: impl Into<IpAddr>,
        dst: impl Into<IpAddr>,
    ) -> (std::net::TcpStream, std::net::TcpStream) {
        let to = SocketAddr::new(dst.into(), self.port);
        let conn = netns::connect(from, src.into(), to).unwrap().unwrap();
        (conn, self.listener.accept().unwrap().0)
    }

    fn pass(
        &self,
        agent: &TestAgent,
        sweeper: &mut Sweeper,
    ) -> limiter::services::sweeper::PassReport {
        let settings = agent.settings().sweep;
        self.pair
            .server
            .run(|| agent.sweep_pass(sweeper, &settings).unwrap())
            .unwrap()
    }

    fn sweeper(&self) -> Sweeper {
        Sweeper::for_interfaces(vec![self.pair.server_if.clone()])
    }
}

fn connections(agent: &TestAgent, src: impl Into<IpAddr>) -> u64 {
    agent
        .with_maps(|m| m.source_connections(src.into()))
        .unwrap()
}

/// Runs `command` (words split at spaces) in `ns`.
fn sh(ns: &Netns, command: &str) {
    ns.exec(&command.split(' ').collect::<Vec<_>>()).unwrap();
}

/// An IPv4 alias with a label (`ip addr add ... label veth:1`) is named after its label, not
/// its interface, by `getifaddrs`: connections to it were judged by the programs but never
/// adopted, so a client that got its handshakes past them unjudged (holding its ACK back past
/// `syn-timeout`) kept more connections than its cap for good.
#[test]
fn connections_to_a_labelled_alias_are_adopted_and_capped() {
    let agent = start(&["--max-conn-per-ip", "2", "--ports", "5673"]);
    let served = Served::new(5673);
    let alias = Ipv4Addr::new(10, 77, 0, 10);
    let label = format!("{}:1", served.pair.server_if);
    served
        .pair
        .server
        .exec(&[
            "ip",
            "addr",
            "add",
            &format!("{alias}/24"),
            "dev",
            &served.pair.server_if,
            "label",
            &label,
        ])
        .unwrap();
    let client = &served.pair.client;
    let before = [
        served.open(client, CLIENT_V4, alias),
        served.open(client, CLIENT_V4, alias),
    ];
    let mut sweeper = served.sweeper();
    let report = served.pass(&agent, &mut sweeper);
    assert_eq!((report.adopted, report.over_cap), (2, 0), "{report:?}");
    assert_eq!(connections(&agent, CLIENT_V4), 2);
    let (mut late, _accepted) = served.open(client, CLIENT_V4, alias);
    let report = served.pass(&agent, &mut sweeper);
    assert_eq!((report.adopted, report.over_cap), (1, 1), "{report:?}");
    assert_eq!(connections(&agent, CLIENT_V4), 2, "the late one is closed");
    late.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut byte = [0; 1];
    match late.read(&mut byte) {
        Err(e) => assert_eq!(e.kind(), ErrorKind::ConnectionReset, "{e}"),
        Ok(n) => assert_eq!(n, 0, "the client's end is closed"),
    }
    drop(before);
}

/// XDP judges packets to any of the host's addresses that arrive on the protected interface,
/// so a connection that came in over it to an address of another interface is the programs'
/// to count too.
#[test]
fn connections_to_another_interfaces_address_that_came_in_are_adopted() {
    let agent = start(&["--max-conn-per-ip", "4", "--ports", "5674"]);
    let served = Served::new(5674);
    let elsewhere = Ipv4Addr::new(10, 78, 0, 1);
    let elsewhere_v6 = Ipv6Addr::new(0xfd00, 0x78, 0, 0, 0, 0, 0, 1);
    // Another interface of the server's (a veth pair of its own: no dummy module needed),
    // removed with the namespace.
    let (other, other_peer) = (netns::unique_name("lvo"), netns::unique_name("lvp"));
    let server = &served.pair.server;
    sh(
        server,
        &format!("ip link add {other} type veth peer name {other_peer}"),
    );
    sh(server, &format!("ip addr add {elsewhere}/32 dev {other}"));
    sh(
        server,
        &format!("ip -6 addr add {elsewhere_v6}/128 dev {other} nodad"),
    );
    sh(server, &format!("ip link set {other} up"));
    sh(server, &format!("ip link set {other_peer} up"));
    let client = &served.pair.client;
    sh(
        client,
        &format!("ip route add {elsewhere}/32 via {SERVER_V4}"),
    );
    sh(
        client,
        &format!("ip -6 route add {elsewhere_v6}/128 via {SERVER_V6}"),
    );
    let _held = [
        served.open(client, CLIENT_V4, elsewhere),
        served.open(client, CLIENT_V6, elsewhere_v6),
    ];
    let report = served.pass(&agent, &mut served.sweeper());
    assert_eq!(report.adopted, 2, "{report:?}");
    assert_eq!(connections(&agent, CLIENT_V4), 1);
    assert_eq!(connections(&agent, CLIENT_V6), 1);
}

/// All of 127.0.0.0/8 is the host's own, not only the 127.0.0.1 that `lo` lists: a local user
/// who bound 127.0.0.2 and connected to the protected address was taken for a remote client
/// and adopted into the global count, and could fill `max-conn-total` for every remote one.
#[test]
fn a_local_user_from_another_loopback_address_is_never_adopted() {
    let agent = start(&["--max-conn-total", "2", "--ports", "5675"]);
    let served = Served::new(5675);
    let mut sweeper = served.sweeper();
    let local_user = Ipv4Addr::new(127, 0, 0, 2);
    let local: Vec<_> = (0..3)
        .map(|_| served.open(&served.pair.server, local_user, SERVER_V4))
        .collect();
    let report = served.pass(&agent, &mut sweeper);
    assert_eq!(report.adopted, 0, "{report:?}");
    assert_eq!(agent.with_maps(|m| m.global_connections()).unwrap(), 0);
    // Remote clients still have the whole of the global cap.
    let remote = [
        served.open(&served.pair.client, CLIENT_V4, SERVER_V4),
        served.open(&served.pair.client, CLIENT_V4, SERVER_V4),
    ];
    let report = served.pass(&agent, &mut sweeper);
    assert_eq!((report.adopted, report.over_cap), (2, 0), "{report:?}");
    assert_eq!(agent.with_maps(|m| m.global_connections()).unwrap(), 2);
    assert_eq!(connections(&agent, local_user), 0);
    drop((local, remote));
}

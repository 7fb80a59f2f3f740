//! The programs attached to a veth in a network namespace, with real TCP from real sockets
//! in another: caps, the SYN burst, IPv6, the allowlist, bans, and connects racing each other.

use std::{
    io::{ErrorKind, Write},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream},
    sync::Barrier,
    time::{Duration, Instant},
};

use limiter_common::{Direction, Reason, Verdict};
use limiter_tests::{
    kernel::Attached,
    netns::{CLIENT_V4, CLIENT_V6, SERVER_V4, SERVER_V6, Server, connect},
};

/// A second client address in the same /24, for tests with two sources.
const CLIENT2_V4: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 3);

fn setup(flags: &[&str]) -> (Attached, Server) {
    let t = Attached::new(flags).expect("namespaces and programs");
    t.pair
        .client
        .exec(&[
            "ip",
            "addr",
            "add",
            &format!("{CLIENT2_V4}/24"),
            "dev",
            &t.pair.client_if,
        ])
        .unwrap();
    let server = Server::start(&t.pair.server, IpAddr::V4(SERVER_V4)).unwrap();
    (t, server)
}

/// Opens `n` connections from `src`; returns those that succeeded, and checks every other one
/// was refused at once ("connection refused", from the XDP RST).
fn open(t: &Attached, src: IpAddr, dst: SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut open = Vec::new();
    for _ in 0..n {
        match connect(&t.pair.client, src, dst).unwrap() {
            Ok(conn) => open.push(conn),
            Err(e) => assert_eq!(e.kind(), ErrorKind::ConnectionRefused, "{e}"),
        }
    }
    open
}

#[test]
fn real_tcp_is_tracked_and_counted_both_ways() {
    let (t, server) = setup(&[]);
    let mut conn = connect(&t.pair.client, IpAddr::V4(CLIENT_V4), server.addr)
        .unwrap()
        .expect("connecting across the veth");
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    conn.write_all(b"hello").unwrap();
    assert_eq!(t.global(), 1);
    let maps = &t.dp.maps;
    assert_eq!(
        maps.packets(Direction::Ingress, Verdict::Pass, Reason::Admitted)
            .unwrap(),
        1
    );
    assert!(
        maps.packets(Direction::Ingress, Verdict::Pass, Reason::Tracked)
            .unwrap()
            >= 2
    );
    // The server's SYN-ACK went out through the TC program.
    assert!(
        maps.packets(Direction::Egress, Verdict::Pass, Reason::Tracked)
            .unwrap()
            >= 1
    );
    let flows = maps.flows().unwrap();
    assert_eq!(flows.len(), 1);
    assert_ne!(
        flows[0].1.state & limiter_common::flow_state::ESTABLISHED,
        0
    );
    drop(conn);
    server.close_all();
    assert_eq!(t.wait_global(0), 0, "closing both ways releases the slot");
    assert!(t.dp.maps.flows().unwrap().is_empty());
}

#[test]
fn per_source_cap_admits_exactly_the_cap_and_closing_frees_slots() {
    let (t, server) = setup(&["--max-conn-per-ip", "3"]);
    let src = IpAddr::V4(CLIENT_V4);
    let conns = open(&t, src, server.addr, 6);
    assert_eq!(conns.len(), 3);
    assert_eq!(t.dp.maps.source_connections(src).unwrap(), 3);
    assert_eq!(
        t.dp.maps
            .packets(Direction::Ingress, Verdict::Rst, Reason::ConnPerIp)
            .unwrap(),
        3
    );
    drop(conns);
    server.close_all();
    assert_eq!(
        t.wait_global(0),
        0,
        "closing every connection frees every slot"
    );
    assert_eq!(t.dp.maps.source_connections(src).unwrap(), 0);
    assert_eq!(
        open(&t, src, server.addr, 4).len(),
        3,
        "freed slots are usable again"
    );
}

#[test]
fn two_sources_share_the_global_cap_exactly() {
    let (t, server) = setup(&["--max-conn-per-ip", "10", "--max-conn-total", "4"]);
    let a = open(&t, IpAddr::V4(CLIENT_V4), server.addr, 3);
    let b = open(&t, IpAddr::V4(CLIENT2_V4), server.addr, 3);
    assert_eq!((a.len(), b.len()), (3, 1));
    assert_eq!(t.global(), 4);
}

#[test]
fn a_syn_burst_admits_exactly_the_burst() {
    let (t, server) = setup(&[
        "--syn-rate",
        "1",
        "--syn-burst",
        "3",
        "--reject-rate",
        "rst",
    ]);
    let conns = open(&t, IpAddr::V4(CLIENT_V4), server.addr, 6);
    assert_eq!(conns.len(), 3);
    assert_eq!(
        t.dp.maps
            .packets(Direction::Ingress, Verdict::Rst, Reason::SynRate)
            .unwrap(),
        3
    );
}

#[test]
fn ipv6_per_source_cap() {
    let (t, _) = setup(&["--max-conn-per-ip", "2"]);
    let server = Server::start(&t.pair.server, IpAddr::V6(SERVER_V6)).unwrap();
    let conns = open(&t, IpAddr::V6(CLIENT_V6), server.addr, 4);
    assert_eq!(conns.len(), 2);
    assert_eq!(
        t.dp.maps.source_connections(IpAddr::V6(CLIENT_V6)).unwrap(),
        2
    );
}

#[test]
fn allowlisted_source_is_exempt() {
    let allow = format!("{CLIENT_V4}/32");
    let (t, server) = setup(&["--max-conn-per-ip", "1", "--allow", &allow]);
    assert_eq!(open(&t, IpAddr::V4(CLIENT_V4), server.addr, 4).len(), 4);
    assert_eq!(open(&t, IpAddr::V4(CLIENT2_V4), server.addr, 3).len(), 1);
}

#[test]
fn a_ban_blocks_and_its_expiry_unblocks() {
    let (mut t, server) = setup(&["--reject-ban", "rst"]);
    let src = IpAddr::V4(CLIENT_V4);
    let ttl = Duration::from_millis(500);
    let banned_at = Instant::now();
    t.dp.maps.ban(src, ttl).unwrap();
    assert!(open(&t, src, server.addr, 1).is_empty(), "banned");
    assert_eq!(open(&t, IpAddr::V4(CLIENT2_V4), server.addr, 1).len(), 1);
    // Expiry is a time, not an event: wait it out.
    std::thread::sleep(ttl.saturating_sub(banned_at.elapsed()) + Duration::from_millis(50));
    assert_eq!(open(&t, src, server.addr, 1).len(), 1, "expired");
}

#[test]
fn racing_connects_never_exceed_the_cap() {
    let (t, server) = setup(&["--max-conn-per-ip", "5"]);
    let threads = 32;
    let barrier = Barrier::new(threads);
    let admitted: usize = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (t, barrier, addr) = (&t, &barrier, server.addr);
                scope.spawn(move || {
                    barrier.wait();
                    // Hold the connection until every thread has tried.
                    connect(&t.pair.client, IpAddr::V4(CLIENT_V4), addr)
                        .unwrap()
                        .ok()
                })
            })
            .collect();
        let conns: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        conns.iter().filter(|c| c.is_some()).count()
    });
    assert_eq!(admitted, 5);
    assert!(t.global() <= 5);
}

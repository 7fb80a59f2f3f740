//! The programs attached to a veth in a network namespace, with real TCP from real sockets
//! in another: caps, the SYN burst, IPv6, the allowlist, bans, connects racing each other,
//! RSTs reaching a bare peer, and a spoofed SYN flood that must lock no one out.
//!
//! Unless a test says otherwise the client's end of the veth runs an XDP program (a NAPI
//! peer, see `limiter_tests::kernel::peer`), so `XDP_TX` frames would reach it too; the RSTs
//! go by the default path (TC ingress), which [`a_bare_peer_gets_connection_refused`] proves
//! needs no such help.

use std::{
    io::{ErrorKind, Write},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream},
    sync::Barrier,
    time::{Duration, Instant},
};

use limiter_common::{Direction, Reason, Verdict};
use limiter_tests::{
    frames::{CLIENT_MAC, SERVER_MAC},
    kernel::{Attached, wait_for},
    netns::{CLIENT_V4, CLIENT_V6, SERVER_V4, SERVER_V6, Server, connect},
    packet::spoof_syns,
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
/// was refused at once ("connection refused", from limiter's RST). Each successful one is
/// waited for until the kernel counts it (its ACK is on its way when `connect` returns), so
/// the next SYN sees it.
fn open(t: &Attached, src: IpAddr, dst: SocketAddr, n: usize) -> Vec<TcpStream> {
    open_counted(t, src, dst, n, true)
}

/// [`open`] for connections the kernel does not count (an allowlisted source's).
fn open_counted(
    t: &Attached,
    src: IpAddr,
    dst: SocketAddr,
    n: usize,
    counted: bool,
) -> Vec<TcpStream> {
    let mut open = Vec::new();
    for _ in 0..n {
        let before = t.global();
        match connect(&t.pair.client, src, dst).unwrap() {
            Ok(conn) => {
                if counted {
                    assert_eq!(t.wait_global(before + 1), before + 1);
                }
                open.push(conn);
            }
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
    assert_eq!(t.wait_global(1), 1);
    let maps = &t.dp.maps;
    let ingress = |reason| {
        maps.packets(Direction::Ingress, Verdict::Pass, reason)
            .unwrap()
    };
    // The SYN passed half-open, the ACK of the server's ISN admitted it (the data goes by
    // the fast path, uncounted).
    assert_eq!(ingress(Reason::HalfOpen), 1);
    assert_eq!(ingress(Reason::Admitted), 1);
    // The server's SYN-ACK went out through the TC program, which noted its ISN.
    assert_eq!(
        maps.packets(Direction::Egress, Verdict::Pass, Reason::Tracked)
            .unwrap(),
        1
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
    assert_eq!(server.accepted(), 4);
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
    let allowed = open_counted(&t, IpAddr::V4(CLIENT_V4), server.addr, 4, false);
    assert_eq!(allowed.len(), 4);
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
    // All 32 SYNs may find the source below its cap; the slots are taken, exactly, by the
    // ACKs. A connect whose ACK finds the cap full succeeds on the client's side, but its ACK
    // reaches the host as a RST: the host never accepts it.
    let (t, server) = setup(&["--max-conn-per-ip", "5"]);
    let threads = 32;
    let barrier = Barrier::new(threads);
    std::thread::scope(|scope| {
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
        assert_eq!(t.wait_global(5), 5);
        let refused = || {
            t.dp.maps
                .packets(Direction::Ingress, Verdict::Rst, Reason::ConnPerIp)
                .unwrap()
        };
        // Every attempt is settled: admitted, or refused at its SYN or at its ACK.
        assert_eq!(wait_for(27, refused), 27);
        assert_eq!(server.accepted(), 5);
        assert_eq!(t.global(), 5);
        drop(conns);
    });
}

#[test]
fn a_bare_peer_gets_connection_refused() {
    // Nothing runs on the client's end of the veth: an XDP_TX frame would vanish there. The
    // RST goes out through TC ingress's redirect instead.
    let t = Attached::bare(&["--max-conn-per-ip", "1"]).expect("namespaces and programs");
    let server = Server::start(&t.pair.server, IpAddr::V4(SERVER_V4)).unwrap();
    let src = IpAddr::V4(CLIENT_V4);
    let first = connect(&t.pair.client, src, server.addr)
        .unwrap()
        .expect("the first connection");
    assert_eq!(t.wait_global(1), 1);
    let started = Instant::now();
    let second = connect(&t.pair.client, src, server.addr).unwrap();
    let error = second.expect_err("over the cap");
    assert_eq!(error.kind(), ErrorKind::ConnectionRefused, "{error}");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "refused at once"
    );
    assert_eq!(
        t.dp.maps
            .packets(Direction::Ingress, Verdict::Rst, Reason::ConnPerIp)
            .unwrap(),
        1
    );
    drop(first);
}

#[test]
fn a_spoofed_syn_flood_locks_no_real_client_out() {
    const FLOOD: u32 = 200_000;
    let (t, server) = setup(&["--max-conn-per-ip", "3", "--max-conn-total", "10000"]);
    // The host answers the spoofed sources, as it would on the internet (the client's
    // namespace drops the SYN-ACKs).
    t.pair
        .server
        .exec(&[
            "ip",
            "route",
            "add",
            "198.18.0.0/15",
            "via",
            &CLIENT_V4.to_string(),
        ])
        .unwrap();
    let server_v4 = match server.addr.ip() {
        IpAddr::V4(v4) => v4,
        IpAddr::V6(_) => unreachable!(),
    };
    let port = server.addr.port();
    let done = std::sync::atomic::AtomicBool::new(false);
    let sent = std::thread::scope(|scope| {
        let flood = scope.spawn(|| {
            t.pair
                .client
                .run(|| {
                    spoof_syns(
                        &t.pair.client_if,
                        FLOOD,
                        CLIENT_MAC,
                        SERVER_MAC,
                        server_v4,
                        port,
                    )
                })
                .unwrap()
        });
        // Real connections while the flood runs: each gets in on its first try, and the
        // source's cap holds exactly.
        let src = IpAddr::V4(CLIENT_V4);
        let mut conns = Vec::new();
        for _ in 0..3 {
            let started = Instant::now();
            conns.push(
                connect(&t.pair.client, src, server.addr)
                    .unwrap()
                    .expect("a real client within its caps"),
            );
            assert!(started.elapsed() < Duration::from_secs(1), "no SYN lost");
        }
        assert_eq!(t.wait_source(src, 3), 3);
        let refused = connect(&t.pair.client, src, server.addr).unwrap();
        assert_eq!(
            refused.expect_err("the fourth").kind(),
            ErrorKind::ConnectionRefused
        );
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        let sent = flood.join().unwrap();
        drop(conns);
        sent
    });
    assert!(done.into_inner());
    assert_eq!(sent, FLOOD);
    let maps = &t.dp.maps;
    let half_open = maps
        .packets(Direction::Ingress, Verdict::Pass, Reason::HalfOpen)
        .unwrap();
    assert!(
        half_open > u64::from(FLOOD) / 2,
        "the flood arrived: {half_open}"
    );
    // Only the real source holds slots.
    let sources = maps.all_source_connections().unwrap();
    assert_eq!(sources.len(), 1, "{sources:?}");
    assert_eq!(t.global(), 3);
}

//! SYN cookies made by the programs, with real TCP across two namespaces: a spoofed flood
//! leaves the host no half-open state while a real client connects on its first try, a
//! cookie connection agrees the window scale, SACK and timestamps a normal one does, and
//! only an ACK with the right cookie takes a slot.
//!
//! The server's namespace runs `net.ipv4.tcp_syncookies = 2` and `tcp_timestamps = 2`, as
//! README asks of a host that turns cookies on. The client's end of the veth runs an XDP
//! program (a NAPI peer), but the SYN-ACKs go by the default path (TC ingress, redirected out
//! of the interface), which works on a bare peer too.

use std::{
    io::ErrorKind,
    net::{IpAddr, Ipv4Addr},
    time::{Duration, Instant},
};

use etherparse::{PacketBuilder, SlicedPacket, TransportSlice};
use limiter_common::{Direction, Reason, Verdict};
use limiter_tests::{
    frames::{CLIENT_MAC, SERVER_MAC},
    kernel::{Attached, wait_for},
    netns::{CLIENT_V4, Netns, SERVER_V4, Server, connect},
    packet::{PacketSocket, spoof_syns},
    transfer::{Sink, transfer},
};

/// The programs loaded with `flags` on a server namespace that takes cookies.
fn cookie_host(flags: &[&str]) -> Attached {
    host(
        flags,
        &["net.ipv4.tcp_syncookies=2", "net.ipv4.tcp_timestamps=2"],
    )
}

/// The programs loaded with `flags` on a server namespace with `sysctls` set.
fn host(flags: &[&str], sysctls: &[&str]) -> Attached {
    Attached::prepared(flags, |pair| {
        for setting in sysctls {
            pair.server.exec(&["sysctl", "-q", "-w", setting])?;
        }
        Ok(())
    })
    .expect("namespaces and programs")
}

/// A counter of `TcpExt` in the namespace's `/proc/net/netstat`.
fn tcp_ext(ns: &Netns, name: &str) -> u64 {
    let text = ns
        .run(|| std::fs::read_to_string("/proc/thread-self/net/netstat"))
        .unwrap()
        .unwrap();
    let mut lines = text.lines().filter(|l| l.starts_with("TcpExt:"));
    let (names, values) = (lines.next().unwrap(), lines.next().unwrap());
    let at = names
        .split_whitespace()
        .position(|n| n == name)
        .unwrap_or_else(|| panic!("no TcpExt {name}"));
    values.split_whitespace().nth(at).unwrap().parse().unwrap()
}

/// Sockets of the namespace in `SYN_RECV` (request sockets) on local `port`.
fn syn_recv(ns: &Netns, port: u16) -> usize {
    let text = ns
        .run(|| std::fs::read_to_string("/proc/thread-self/net/tcp"))
        .unwrap()
        .unwrap();
    let port = format!(":{port:04X}");
    text.lines()
        .skip(1)
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields.len() > 3 && fields[1].ends_with(&port) && fields[3] == "03"
        })
        .count()
}

fn server_v4(server: &Server) -> Ipv4Addr {
    match server.addr.ip() {
        IpAddr::V4(v4) => v4,
        IpAddr::V6(_) => unreachable!(),
    }
}

#[test]
fn a_spoofed_flood_with_cookies_leaves_the_host_no_half_open_state() {
    const FLOOD: u32 = 50_000;
    let t = cookie_host(&[
        "--syn-cookies",
        "always",
        "--max-conn-per-ip",
        "3",
        "--max-conn-total",
        "10000",
    ]);
    let server = Server::start(&t.pair.server, IpAddr::V4(SERVER_V4)).unwrap();
    // Were the host to answer a spoofed source itself, its SYN-ACK would leave (and the
    // client's namespace drop it), as on the internet.
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
    let port = server.addr.port();
    let sent_before = tcp_ext(&t.pair.server, "SyncookiesSent");
    let received_before = tcp_ext(&t.pair.server, "SyncookiesRecv");
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
                        server_v4(&server),
                        port,
                    )
                })
                .unwrap()
        });
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
            assert_eq!(t.wait_source(src, conns.len() as u64), conns.len() as u64);
        }
        let refused = connect(&t.pair.client, src, server.addr).unwrap();
        assert_eq!(
            refused.expect_err("the fourth").kind(),
            ErrorKind::ConnectionRefused
        );
        let sent = flood.join().unwrap();
        drop(conns);
        sent
    });
    assert_eq!(sent, FLOOD);
    let answered =
        t.dp.maps
            .packets(Direction::Ingress, Verdict::Cookie, Reason::Unproven)
            .unwrap();
    assert!(
        answered > u64::from(FLOOD) / 2,
        "the programs answered the flood: {answered}"
    );
    // The host sent no cookie of its own for the flood (only for the real client's second
    // and third SYNs: a proven source's SYN reaches it), and holds no request socket.
    let host_sent = tcp_ext(&t.pair.server, "SyncookiesSent") - sent_before;
    assert!(host_sent <= 2, "the host answered {host_sent} SYNs itself");
    assert_eq!(syn_recv(&t.pair.server, port), 0);
    // The real client's first connection was built by the host from the programs' cookie.
    assert!(tcp_ext(&t.pair.server, "SyncookiesRecv") > received_before);
    let sources = t.dp.maps.all_source_connections().unwrap();
    assert!(
        sources.len() <= 1,
        "only the real source holds slots: {sources:?}"
    );
}

/// A cookie connection against a normal one (cookies off, the host's own cookies only for a
/// full queue, the kernel's default): a proven source on a cookie host would reach the host's
/// stack, but the host there runs `tcp_syncookies = 2` and answers it with its own cookie, so
/// it would compare a cookie with a cookie. Both hosts have the same programs, veth and peer.
/// Each moves 10 MB, so the agreed window scale is used. (How fast each is, is the flood
/// bench's: `cargo xtask bench flood --spoofed`.)
#[test]
fn a_cookie_connection_agrees_every_option_a_normal_one_does() {
    const BYTES: usize = 10 << 20;
    let cookie = cookie_host(&["--syn-cookies", "always"]);
    let normal = host(&["--syn-cookies", "off"], &["net.ipv4.tcp_timestamps=2"]);
    let cookie_sink = Sink::new(&cookie.pair.server, 1).unwrap();
    let normal_sink = Sink::new(&normal.pair.server, 1).unwrap();
    let normal_cookies = tcp_ext(&normal.pair.server, "SyncookiesSent");
    let cookies_received = tcp_ext(&cookie.pair.server, "SyncookiesRecv");
    let data = vec![0x5Au8; BYTES];
    let through_cookie = transfer(
        &cookie.pair.client,
        IpAddr::V4(CLIENT_V4),
        &cookie_sink,
        &data,
    )
    .unwrap();
    assert_eq!(
        wait_for(1, || cookie
            .dp
            .maps
            .packets(Direction::Ingress, Verdict::Cookie, Reason::Unproven)
            .unwrap()),
        1,
        "the SYN was answered with the programs' cookie"
    );
    assert_eq!(
        tcp_ext(&cookie.pair.server, "SyncookiesRecv"),
        cookies_received + 1,
        "the host built the connection from that cookie"
    );
    let normal_way = transfer(
        &normal.pair.client,
        IpAddr::V4(CLIENT_V4),
        &normal_sink,
        &data,
    )
    .unwrap();
    assert_eq!(
        tcp_ext(&normal.pair.server, "SyncookiesSent"),
        normal_cookies,
        "the normal connection was not a cookie"
    );
    // The host read the client's SACK and scale back from the cookie's timestamp, and scales
    // its own windows by what the cookie's SYN-ACK announced: the same on both sides as the
    // normal handshake agreed.
    assert_eq!(through_cookie.client, normal_way.client);
    assert_eq!(through_cookie.server, normal_way.server);
    let server = through_cookie.server;
    assert!(
        server.timestamps && server.sack && server.window_scaling && server.rcv_wscale > 0,
        "{server:?}"
    );
    assert_eq!(server.rcv_wscale, through_cookie.client.snd_wscale);
    assert_eq!(server.snd_wscale, through_cookie.client.rcv_wscale);
}

/// The cookie's SYN-ACK answering a SYN the test sent from `src`:`sport`, captured on the
/// client's end of the veth.
fn syn_ack_to(socket: &PacketSocket, src: Ipv4Addr, sport: u16) -> Option<(u32, u32)> {
    socket
        .receive(Duration::from_secs(3), |frame| {
            let packet = SlicedPacket::from_ethernet(frame).ok()?;
            let Some(TransportSlice::Tcp(tcp)) = packet.transport else {
                return None;
            };
            (tcp.syn() && tcp.ack() && tcp.destination_port() == sport && {
                let ip = packet.net.as_ref()?;
                matches!(ip, etherparse::NetSlice::Ipv4(v4) if v4.header().destination_addr() == src)
            })
            .then(|| (tcp.sequence_number(), tcp.acknowledgment_number()))
        })
        .unwrap()
}

#[test]
fn only_an_ack_with_the_right_cookie_takes_a_slot() {
    let t = cookie_host(&["--syn-cookies", "always"]);
    let server = Server::start(&t.pair.server, IpAddr::V4(SERVER_V4)).unwrap();
    let (dst, port) = (server_v4(&server), server.addr.port());
    // A source the client's namespace does not hold: its kernel neither answers nor resets
    // the SYN-ACK, so the test plays the client by hand.
    let src = Ipv4Addr::new(10, 77, 0, 50);
    let (sport, isn) = (40_000u16, 0x1234_5678u32);
    let frame = |seq: u32, ack: u32, syn: bool| {
        let mut out = Vec::new();
        let builder = PacketBuilder::ethernet2(CLIENT_MAC, SERVER_MAC)
            .ipv4(src.octets(), dst.octets(), 64)
            .tcp(sport, port, seq, 64_240);
        if syn {
            builder.syn().write(&mut out, &[]).unwrap();
        } else {
            builder.ack(ack).write(&mut out, &[]).unwrap();
        }
        out
    };
    let cookie = t
        .pair
        .client
        .run(|| {
            let socket = PacketSocket::bind(&t.pair.client_if).unwrap();
            assert!(socket.send(&frame(isn, 0, true)).unwrap());
            syn_ack_to(&socket, src, sport)
        })
        .unwrap()
        .expect("the cookie's SYN-ACK");
    assert_eq!(cookie.1, isn.wrapping_add(1));
    let send = |frame: &[u8]| {
        t.pair
            .client
            .run(|| {
                let socket = PacketSocket::bind(&t.pair.client_if).unwrap();
                assert!(socket.send(frame).unwrap());
            })
            .unwrap();
    };
    let global = || t.dp.maps.global_connections().unwrap();
    let bad = || {
        t.dp.maps
            .packets(Direction::Ingress, Verdict::Drop, Reason::BadCookie)
            .unwrap()
    };
    // The right acknowledgment with another sequence number: the cookie was made for the
    // SYN's, so it does not check, and nothing is charged.
    send(&frame(
        isn.wrapping_add(1000),
        cookie.0.wrapping_add(1),
        false,
    ));
    assert_eq!(wait_for(1, bad), 1, "a wrong cookie is dropped and counted");
    assert_eq!(global(), 0);
    assert_eq!(server.accepted(), 0);
    // The ACK the cookie was made for: the source is proven, charged, and the host builds
    // the connection.
    send(&frame(isn.wrapping_add(1), cookie.0.wrapping_add(1), false));
    assert_eq!(t.wait_global(1), 1);
    assert_eq!(wait_for(1, || server.accepted()), 1);
    assert_eq!(
        t.wait_source(IpAddr::V4(src), 1),
        1,
        "the connection is charged to its source"
    );
}

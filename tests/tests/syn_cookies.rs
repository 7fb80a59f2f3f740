//! SYN cookies made by the programs, with real TCP across two namespaces: a spoofed flood
//! leaves the host no half-open state while a real client connects on its first try, a
//! cookie connection keeps its window scale and SACK, and only an ACK with the right cookie
//! takes a slot.
//!
//! The server's namespace runs `net.ipv4.tcp_syncookies = 2` and `tcp_timestamps = 2`, as
//! README asks of a host that turns cookies on. The client's end of the veth runs an XDP
//! program (a NAPI peer), but the SYN-ACKs go by the default path (TC ingress, redirected out
//! of the interface), which works on a bare peer too.

use std::{
    io::{ErrorKind, Read, Write},
    net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener},
    sync::mpsc,
    time::{Duration, Instant},
};

use etherparse::{PacketBuilder, SlicedPacket, TransportSlice};
use limiter_common::{Direction, Reason, Verdict};
use limiter_tests::{
    frames::{CLIENT_MAC, SERVER_MAC},
    kernel::{Attached, wait_for},
    netns::{CLIENT_V4, Netns, SERVER_V4, Server, connect},
    packet::{PacketSocket, spoof_syns},
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

/// What TCP agreed for a connection (`TCP_INFO`): its options and both window scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Agreed {
    timestamps: bool,
    sack: bool,
    /// The scale this end applies to the peer's windows, and the one it announced for its own.
    snd_wscale: u8,
    rcv_wscale: u8,
}

fn agreed(socket: &impl std::os::fd::AsRawFd) -> Agreed {
    // SAFETY: a plain C struct, all zeros valid; the kernel fills at most `len` bytes of it.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &mut len,
        )
    };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    // `tcpi_options`: TCPI_OPT_TIMESTAMPS 1, TCPI_OPT_SACK 2, TCPI_OPT_WSCALE 4.
    assert!(info.tcpi_options & 4 != 0, "window scaling agreed");
    Agreed {
        timestamps: info.tcpi_options & 1 != 0,
        sack: info.tcpi_options & 2 != 0,
        snd_wscale: info.tcpi_snd_rcv_wscale & 0xF,
        rcv_wscale: info.tcpi_snd_rcv_wscale >> 4,
    }
}

#[test]
fn a_cookie_connection_keeps_its_window_scale_and_sack() {
    const BYTES: usize = 10 << 20;
    let t = cookie_host(&["--syn-cookies", "always"]);
    let listener = t
        .pair
        .server
        .run(|| TcpListener::bind((SERVER_V4, 0)))
        .unwrap()
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let received = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        let server = agreed(&conn);
        conn.set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut total = 0usize;
        let mut buffer = vec![0u8; 1 << 16];
        loop {
            match conn.read(&mut buffer).unwrap() {
                0 => return (server, total),
                n => total += n,
            }
        }
    });
    let mut client = connect(&t.pair.client, IpAddr::V4(CLIENT_V4), addr)
        .unwrap()
        .expect("connects through a cookie");
    assert_eq!(
        wait_for(1, || t
            .dp
            .maps
            .packets(Direction::Ingress, Verdict::Cookie, Reason::Unproven)
            .unwrap()),
        1,
        "the SYN was answered with a cookie"
    );
    let data = vec![0x5Au8; BYTES];
    client.write_all(&data).unwrap();
    let client_side = agreed(&client);
    drop(client);
    let (server_side, total) = received.join().unwrap();
    assert_eq!(total, BYTES);
    // The host read the client's SACK and scale back from the cookie's timestamp, and scales
    // its own windows by what the cookie's SYN-ACK announced.
    assert!(
        server_side.timestamps && server_side.sack,
        "{server_side:?}"
    );
    assert!(
        client_side.timestamps && client_side.sack,
        "{client_side:?}"
    );
    assert_eq!(server_side.rcv_wscale, client_side.snd_wscale);
    assert_eq!(server_side.snd_wscale, client_side.rcv_wscale);
    assert!(server_side.rcv_wscale > 0, "{server_side:?}");
}

/// A listener in `ns` that reads each connection to its end, for `rounds` connections, and
/// reports for each what TCP agreed on the server's side, the bytes read, and when the last
/// arrived.
fn sink(ns: &Netns, rounds: usize) -> (SocketAddr, mpsc::Receiver<(Agreed, usize, Instant)>) {
    let listener = ns
        .run(|| TcpListener::bind((SERVER_V4, 0)))
        .unwrap()
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buffer = vec![0u8; 1 << 16];
        for _ in 0..rounds {
            let Ok((mut conn, _)) = listener.accept() else {
                return;
            };
            let server = agreed(&conn);
            conn.set_read_timeout(Some(Duration::from_secs(20)))
                .unwrap();
            let mut total = 0usize;
            while let Ok(n @ 1..) = conn.read(&mut buffer) {
                total += n;
            }
            if tx.send((server, total, Instant::now())).is_err() {
                return;
            }
        }
    });
    (addr, rx)
}

/// One transfer of `data` from `src` to the sink at `addr`: bytes a second (from the first
/// write to the sink's last read) and what each side agreed.
fn transfer(
    t: &Attached,
    src: IpAddr,
    addr: SocketAddr,
    done: &mpsc::Receiver<(Agreed, usize, Instant)>,
    data: &[u8],
) -> (f64, Agreed, Agreed) {
    let mut client = connect(&t.pair.client, src, addr)
        .unwrap()
        .expect("connects");
    client
        .set_write_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let client_side = agreed(&client);
    let started = Instant::now();
    client.write_all(data).unwrap();
    client.shutdown(Shutdown::Write).unwrap();
    let (server_side, total, ended) = done.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!(total, data.len());
    let rate = data.len() as f64 / (ended - started).as_secs_f64();
    (rate, client_side, server_side)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The normal connection is one with cookies off (and the host's own cookies only for a full
/// queue, the kernel's default): a proven source on a cookie host would reach the host's
/// stack, but the host there runs `tcp_syncookies = 2` and answers it with its own cookie, so
/// it would compare a cookie with a cookie. Both hosts have the same programs, veth and peer.
/// The two take turns over the rounds, so the machine's noise hits both alike, and the
/// medians are compared; every transfer is bounded by its socket timeouts.
#[test]
fn a_cookie_connection_moves_data_as_fast_as_a_normal_one() {
    const BYTES: usize = 10 << 20;
    const ROUNDS: usize = 7;
    let cookie = cookie_host(&["--syn-cookies", "always"]);
    let normal = host(&["--syn-cookies", "off"], &["net.ipv4.tcp_timestamps=2"]);
    let (cookie_addr, cookie_done) = sink(&cookie.pair.server, ROUNDS);
    let (normal_addr, normal_done) = sink(&normal.pair.server, ROUNDS);
    let answered = || {
        cookie
            .dp
            .maps
            .packets(Direction::Ingress, Verdict::Cookie, Reason::Unproven)
            .unwrap()
    };
    let normal_cookies = tcp_ext(&normal.pair.server, "SyncookiesSent");
    let data = vec![0x5Au8; BYTES];
    let started = Instant::now();
    let (mut cookie_rates, mut normal_rates) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        // Each round's cookie connection from a source of its own, new to the programs, so
        // it gets a cookie. (A closed one's source keeps its slot until the sweeper's pass:
        // the client's FIN, first here, acknowledges the cookie's ISN + 1, so the programs
        // take it for a cookie's ACK, find the socket established and pass it without noting
        // the FIN; the host's FIN then closes nothing.)
        let fresh = Ipv4Addr::new(10, 77, 0, 10 + round as u8);
        cookie
            .pair
            .client
            .exec(&[
                "ip",
                "addr",
                "add",
                &format!("{fresh}/24"),
                "dev",
                &cookie.pair.client_if,
            ])
            .unwrap();
        let (rate, client_side, server_side) =
            transfer(&cookie, IpAddr::V4(fresh), cookie_addr, &cookie_done, &data);
        assert_eq!(wait_for(round as u64 + 1, answered), round as u64 + 1);
        cookie_rates.push(rate);
        let (normal_rate, normal_client, normal_server) = transfer(
            &normal,
            IpAddr::V4(CLIENT_V4),
            normal_addr,
            &normal_done,
            &data,
        );
        normal_rates.push(normal_rate);
        // The cookie carried every option the normal handshake agreed, on both sides.
        assert_eq!(client_side, normal_client);
        assert_eq!(server_side, normal_server);
        assert!(
            server_side.sack && server_side.rcv_wscale > 0,
            "{server_side:?}"
        );
    }
    assert_eq!(
        tcp_ext(&normal.pair.server, "SyncookiesSent"),
        normal_cookies,
        "the normal connections were not cookies"
    );
    let (cookie_rate, normal_rate) = (median(cookie_rates), median(normal_rates));
    eprintln!(
        "10 MB: cookie {:.0} MB/s, normal {:.0} MB/s (medians of {ROUNDS}), in {:?}",
        cookie_rate / 1e6,
        normal_rate / 1e6,
        started.elapsed()
    );
    assert!(
        cookie_rate >= 0.9 * normal_rate,
        "a cookie connection moved {:.0} MB/s, a normal one {:.0} MB/s",
        cookie_rate / 1e6,
        normal_rate / 1e6
    );
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
            .unwrap()
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

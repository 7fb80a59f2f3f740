//! Both programs attached to a veth in a namespace, with real TCP across it.

use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    time::Duration,
};

use limiter::{
    loader::{Datapath, XdpAttachMode},
    maps,
};
use limiter_common::Stat;
use limiter_tests::netns::{CLIENT_V4, Pair, SERVER_V4};

#[test]
fn counters_see_real_tcp_both_ways() {
    let pair = Pair::new().expect("creating the namespaces");
    let datapath = pair
        .server
        .run(|| {
            let mut dp = Datapath::load()?;
            dp.attach(&pair.server_if, XdpAttachMode::Native)?;
            anyhow::Ok(dp)
        })
        .unwrap()
        .expect("attaching in the server namespace");
    let listener = pair
        .server
        .run(|| TcpListener::bind((SERVER_V4, 0)))
        .unwrap()
        .expect("binding the server");
    let port = listener.local_addr().unwrap().port();
    let xdp_before = maps::stat(&datapath, Stat::XdpPackets).unwrap();
    let tc_before = maps::stat(&datapath, Stat::TcPackets).unwrap();

    let server = std::thread::spawn(move || {
        let (mut conn, peer) = listener.accept().unwrap();
        let mut buf = [0u8; 5];
        conn.read_exact(&mut buf).unwrap();
        conn.write_all(&buf).unwrap();
        peer
    });
    let mut client = pair
        .client
        .run(|| TcpStream::connect_timeout(&(SERVER_V4, port).into(), Duration::from_secs(5)))
        .unwrap()
        .expect("connecting across the veth");
    client
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    client.write_all(b"hello").unwrap();
    let mut echo = [0u8; 5];
    client.read_exact(&mut echo).unwrap();
    assert_eq!(&echo, b"hello");
    assert_eq!(
        server.join().unwrap().ip().to_string(),
        CLIENT_V4.to_string()
    );

    // SYN, ACK and data at least came in; SYN-ACK and the echo at least went out.
    let xdp = maps::stat(&datapath, Stat::XdpPackets).unwrap() - xdp_before;
    let tc = maps::stat(&datapath, Stat::TcPackets).unwrap() - tc_before;
    assert!(xdp >= 3, "XDP saw {xdp} packets");
    assert!(tc >= 2, "TC saw {tc} packets");
}

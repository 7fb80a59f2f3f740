//! The kernel programs under BPF_PROG_TEST_RUN, on frames built with etherparse: parsing,
//! every refusal reason, close tracking, and the RST reply read back by an independent parser.

use std::{
    net::{IpAddr, Ipv4Addr},
    time::{Duration, Instant},
};

use limiter_common::{Direction, Event, FlowKey, Reason, Verdict};
use limiter_tests::{
    frames::{self, CLIENT_MAC, Flags, SERVER_MAC, Tcp, Vlans},
    kernel::{Kernel, TC_ACT_OK, XDP_DROP, XDP_PASS, XDP_TX, settings},
};

const PORT: u16 = 5672;

fn v4(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(192, 0, 2, last))
}

fn server4() -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(198, 51, 100, 1))
}

fn v6(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn syn(src: IpAddr, sport: u16) -> Tcp {
    let dst = if src.is_ipv4() {
        server4()
    } else {
        v6("2001:db8:ffff::1")
    };
    Tcp::syn(src, sport, dst, PORT)
}

const ACK: Flags = Flags {
    syn: false,
    ack: true,
    fin: false,
    rst: false,
};
const FIN: Flags = Flags {
    syn: false,
    ack: true,
    fin: true,
    rst: false,
};
const RST: Flags = Flags {
    syn: false,
    ack: false,
    fin: false,
    rst: true,
};

fn flow_key(seg: &Tcp) -> FlowKey {
    let mapped = |a: IpAddr| match a {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    };
    FlowKey {
        remote: mapped(seg.src),
        local: mapped(seg.dst),
        remote_port: seg.sport,
        local_port: seg.dport,
        _pad: 0,
    }
}

/// Checks an RST|ACK reply to `syn` byte by byte, through etherparse.
fn assert_rst_reply(syn: &Tcp, frame: &[u8]) {
    let reply = frames::parse_reply(frame);
    assert_eq!(reply.src_mac, SERVER_MAC, "MACs swapped");
    assert_eq!(reply.dst_mac, CLIENT_MAC, "MACs swapped");
    let want_vlans = match syn.vlans {
        Vlans::None => vec![],
        Vlans::One(a) => vec![a],
        Vlans::Two(a, b) => vec![a, b],
    };
    assert_eq!(reply.vlan_ids, want_vlans, "VLAN tags kept");
    assert_eq!(reply.src, syn.dst);
    assert_eq!(reply.dst, syn.src);
    assert_eq!(reply.tcp.source_port, syn.dport);
    assert_eq!(reply.tcp.destination_port, syn.sport);
    assert!(reply.tcp.rst && reply.tcp.ack, "RST|ACK");
    assert!(!reply.tcp.syn && !reply.tcp.fin);
    assert_eq!(reply.tcp.sequence_number, 0);
    assert_eq!(reply.tcp.acknowledgment_number, syn.seq.wrapping_add(1));
    assert_eq!(reply.tcp.data_offset(), 5, "no TCP options");
    assert_eq!(reply.tcp_payload_len, 0);
    assert!(reply.checksums_ok, "IP and TCP checksums verify");
}

#[test]
fn syn_is_admitted_tracked_and_counted_once() {
    let k = Kernel::new(&[]);
    let s = syn(v4(2), 40000);
    assert_eq!(k.xdp(&s.build()).action, XDP_PASS);
    assert_eq!(k.ingress(Verdict::Pass, Reason::Admitted), 1);
    assert_eq!(k.global(), 1);
    assert_eq!(k.dp.maps.source_connections(s.src).unwrap(), 1);
    // A retransmitted SYN is not a second connection.
    assert_eq!(k.xdp(&s.build()).action, XDP_PASS);
    assert_eq!(k.ingress(Verdict::Pass, Reason::Retransmit), 1);
    assert_eq!(k.global(), 1);
    assert_eq!(k.dp.maps.events(Event::Opened).unwrap(), 1);
    let flows = k.dp.maps.flows().unwrap();
    assert_eq!(flows.len(), 1);
    assert_eq!(flows[0].0, flow_key(&s));
}

#[test]
fn per_source_cap_refuses_with_a_valid_rst() {
    let k = Kernel::new(&["--max-conn-per-ip", "2"]);
    for port in [40000, 40001] {
        assert_eq!(k.xdp(&syn(v4(2), port).build()).action, XDP_PASS);
    }
    let third = syn(v4(2), 40002);
    let run = k.xdp(&third.build());
    assert_eq!(run.action, XDP_TX);
    assert_rst_reply(&third, &run.frame);
    assert_eq!(k.ingress(Verdict::Rst, Reason::ConnPerIp), 1);
    assert_eq!(k.dp.maps.source_connections(v4(2)).unwrap(), 2);
    // Another source is not affected.
    assert_eq!(k.xdp(&syn(v4(3), 40000).build()).action, XDP_PASS);
    // The refusal is recorded against the source for the top-blocked lists.
    let blocked = k.dp.maps.blocked().unwrap();
    assert_eq!(blocked.len(), 1);
    assert_eq!(
        blocked[0].1.counts[Reason::ConnPerIp.blocked_slot().unwrap()],
        1
    );
}

#[test]
fn drop_mode_drops_instead_of_resetting() {
    let k = Kernel::new(&["--max-conn-per-ip", "1", "--reject-conn", "drop"]);
    assert_eq!(k.xdp(&syn(v4(2), 1).build()).action, XDP_PASS);
    assert_eq!(k.xdp(&syn(v4(2), 2).build()).action, XDP_DROP);
    assert_eq!(k.ingress(Verdict::Drop, Reason::ConnPerIp), 1);
}

#[test]
fn global_cap_is_shared_by_sources() {
    let k = Kernel::new(&["--max-conn-total", "3"]);
    let actions: Vec<u32> = [(2, 1), (3, 1), (2, 2), (3, 2)]
        .iter()
        .map(|(host, port)| k.xdp(&syn(v4(*host), *port).build()).action)
        .collect();
    assert_eq!(actions, vec![XDP_PASS, XDP_PASS, XDP_PASS, XDP_TX]);
    assert_eq!(k.global(), 3);
    assert_eq!(k.ingress(Verdict::Rst, Reason::ConnTotal), 1);
    // The refused SYN's source slot was rolled back.
    assert_eq!(k.dp.maps.source_connections(v4(3)).unwrap(), 1);
}

#[test]
fn syn_rate_admits_exactly_the_burst() {
    let k = Kernel::new(&["--syn-rate", "1", "--syn-burst", "3"]);
    let admitted = (0..10)
        .filter(|i| k.xdp(&syn(v4(2), 1000 + i).build()).action == XDP_PASS)
        .count();
    assert_eq!(admitted, 3);
    assert_eq!(k.ingress(Verdict::Drop, Reason::SynRate), 7);
    // Rate refusals consume nothing: the source holds exactly the admitted connections.
    assert_eq!(k.global(), 3);
}

#[test]
fn rst_either_way_closes_the_flow_once() {
    let k = Kernel::new(&[]);
    let a = syn(v4(2), 1);
    let b = syn(v4(2), 2);
    k.xdp(&a.build());
    k.xdp(&b.build());
    assert_eq!(k.global(), 2);
    assert_eq!(k.xdp(&a.with_flags(RST).build()).action, XDP_PASS);
    assert_eq!(k.global(), 1);
    // A second RST of the same flow finds nothing to release.
    k.xdp(&a.with_flags(RST).build());
    assert_eq!(k.global(), 1);
    assert_eq!(k.tc(&b.reply(RST).build()), TC_ACT_OK);
    assert_eq!(k.global(), 0);
    assert_eq!(k.dp.maps.source_connections(v4(2)).unwrap(), 0);
    assert_eq!(k.dp.maps.events(Event::ClosedRst).unwrap(), 2);
}

#[test]
fn fins_both_ways_close_the_flow() {
    let k = Kernel::new(&[]);
    let s = syn(v4(2), 1);
    k.xdp(&s.build());
    k.xdp(&s.with_flags(ACK).build());
    k.xdp(&s.with_flags(FIN).build());
    k.xdp(&s.with_flags(FIN).build()); // retransmitted FIN
    assert_eq!(k.global(), 1, "one FIN leaves the flow open");
    k.tc(&s.reply(FIN).build());
    assert_eq!(k.global(), 0);
    assert!(k.dp.maps.flows().unwrap().is_empty());
    assert_eq!(k.dp.maps.events(Event::ClosedFin).unwrap(), 1);
    assert_eq!(
        k.packets(Direction::Egress, Verdict::Pass, Reason::Tracked),
        1
    );
}

#[test]
fn a_syn_reusing_a_closing_tuple_keeps_one_slot() {
    let k = Kernel::new(&[]);
    let s = syn(v4(2), 1);
    k.xdp(&s.build());
    k.xdp(&s.with_flags(FIN).build());
    // The client reuses the 4-tuple before the host's FIN: the new connection takes over
    // the old one's slot.
    assert_eq!(k.xdp(&s.build()).action, XDP_PASS);
    assert_eq!(k.global(), 1);
    k.xdp(&s.with_flags(FIN).build());
    k.tc(&s.reply(FIN).build());
    assert_eq!(k.global(), 0);
}

#[test]
fn ipv6_sources_are_keyed_by_their_prefix() {
    let k = Kernel::new(&["--max-conn-per-ip", "2"]);
    // Two addresses of one /64 share a key; a neighbouring /64 has its own.
    let a = syn(v6("2001:db8:1:2::10"), 1);
    let b = syn(v6("2001:db8:1:2::20"), 1);
    let c = syn(v6("2001:db8:1:2::30"), 1);
    let other = syn(v6("2001:db8:1:3::10"), 1);
    assert_eq!(k.xdp(&a.build()).action, XDP_PASS);
    assert_eq!(k.xdp(&b.build()).action, XDP_PASS);
    let run = k.xdp(&c.build());
    assert_eq!(run.action, XDP_TX);
    assert_rst_reply(&c, &run.frame);
    assert_eq!(k.xdp(&other.build()).action, XDP_PASS);
}

#[test]
fn ipv4_prefix_groups_sources() {
    let k = Kernel::new(&["--max-conn-per-ip", "1", "--ipv4-prefix", "24"]);
    assert_eq!(k.xdp(&syn(v4(2), 1).build()).action, XDP_PASS);
    assert_eq!(k.xdp(&syn(v4(3), 1).build()).action, XDP_TX);
}

#[test]
fn vlan_qinq_ip_options_and_extension_headers_parse_and_reset() {
    let k = Kernel::new(&["--max-conn-per-ip", "1"]);
    let mut cases = Vec::new();
    let mut s = syn(v4(10), 1);
    s.vlans = Vlans::One(100);
    cases.push(s);
    let mut s = syn(v4(11), 1);
    s.vlans = Vlans::Two(200, 300);
    cases.push(s);
    let mut s = syn(v4(12), 1);
    s.ipv4_options = vec![148, 4, 0, 0, 1, 1, 1, 0]; // router alert, NOPs, end of list
    cases.push(s);
    let mut s = syn(v6("2001:db8:5::1"), 1);
    s.ipv6_extensions = true;
    cases.push(s);
    let mut s = syn(v6("2001:db8:6::1"), 1);
    s.ipv6_extensions = true;
    s.vlans = Vlans::Two(10, 20);
    cases.push(s);
    for first in &cases {
        assert_eq!(k.xdp(&first.build()).action, XDP_PASS, "{first:?}");
        let mut second = first.clone();
        second.sport = 2;
        second.seq = 0xFFFF_FFFF; // the ack wraps to 0
        let run = k.xdp(&second.build());
        assert_eq!(run.action, XDP_TX, "{second:?}");
        assert_rst_reply(&second, &run.frame);
    }
    assert_eq!(
        k.ingress(Verdict::Pass, Reason::Admitted),
        cases.len() as u64
    );
}

#[test]
fn non_first_fragments_pass_untouched() {
    let k = Kernel::new(&["--max-conn-per-ip", "1"]);
    for src in [v4(2), v6("2001:db8::2")] {
        let mut s = syn(src, 1);
        s.fragment_offset = 100;
        for _ in 0..3 {
            let frame = s.build();
            let run = k.xdp(&frame);
            assert_eq!(run.action, XDP_PASS);
            assert_eq!(run.frame, frame);
        }
    }
    assert_eq!(k.ingress(Verdict::Pass, Reason::Fragment), 6);
    assert_eq!(k.global(), 0);
    // The same SYN unfragmented is policed as usual.
    assert_eq!(k.xdp(&syn(v4(2), 1).build()).action, XDP_PASS);
    assert_eq!(k.global(), 1);
}

#[test]
fn truncated_and_garbage_frames_always_pass() {
    let k = Kernel::new(&["--max-conn-per-ip", "1", "--max-conn-total", "1"]);
    let mut malformed = 0;
    for src in [v4(2), v6("2001:db8::2")] {
        let mut s = syn(src, 1);
        s.vlans = Vlans::One(5);
        let frame = s.build();
        // Every cut short of the full TCP header (BPF_PROG_TEST_RUN needs 14 bytes).
        let tcp_end = frame.len() - 12;
        for len in 14..tcp_end {
            let run = k.xdp(&frame[..len]);
            assert_eq!(run.action, XDP_PASS, "cut at {len}");
            assert_eq!(run.frame, &frame[..len]);
            malformed += 1;
        }
    }
    assert_eq!(k.ingress(Verdict::Pass, Reason::Malformed), malformed);
    // Pseudo-random garbage, with an IPv4 or IPv6 EtherType to get past the first check.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for i in 0..2000 {
        let len = 14 + (i % 120);
        let mut frame: Vec<u8> = (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        if i % 2 == 0 {
            frame[12..14].copy_from_slice(if i % 4 == 0 {
                &[0x08, 0]
            } else {
                &[0x86, 0xDD]
            });
        }
        let action = k.xdp(&frame).action;
        // Garbage that happens to parse as a SYN may be admitted or refused; never aborted.
        assert!(
            matches!(action, XDP_PASS | XDP_DROP | XDP_TX),
            "frame {i}: {action}"
        );
    }
    assert!(k.global() <= 1);
}

#[test]
fn other_traffic_passes_counted_by_why() {
    let k = Kernel::new(&["--ports", "5672", "--max-conn-per-ip", "1"]);
    assert_eq!(k.xdp(&frames::udp(v4(2), server4())).action, XDP_PASS);
    assert_eq!(k.xdp(&frames::non_ip()).action, XDP_PASS);
    for port in [22, 23] {
        let mut s = syn(v4(2), port);
        s.dport = 22;
        assert_eq!(k.xdp(&s.build()).action, XDP_PASS);
    }
    // A packet of no tracked flow (it opened before the programs came).
    assert_eq!(
        k.xdp(&syn(v4(2), 9).with_flags(ACK).build()).action,
        XDP_PASS
    );
    assert_eq!(k.ingress(Verdict::Pass, Reason::NonTcp), 1);
    assert_eq!(k.ingress(Verdict::Pass, Reason::NonIp), 1);
    assert_eq!(k.ingress(Verdict::Pass, Reason::UnprotectedPort), 2);
    assert_eq!(k.ingress(Verdict::Pass, Reason::Untracked), 1);
    assert_eq!(k.global(), 0);
}

#[test]
fn allowlisted_sources_are_never_limited_and_denylisted_ones_are_dropped() {
    let k = Kernel::new(&[
        "--max-conn-per-ip",
        "1",
        "--allow",
        "192.0.2.0/28",
        "--deny",
        "192.0.2.64/26,2001:db8:bad::/48",
    ]);
    for port in 1..=5 {
        assert_eq!(k.xdp(&syn(v4(2), port).build()).action, XDP_PASS);
    }
    assert_eq!(k.ingress(Verdict::Pass, Reason::Allowlisted), 5);
    assert_eq!(k.xdp(&syn(v4(70), 1).build()).action, XDP_DROP);
    // Every packet of a denied source, not just SYNs.
    assert_eq!(
        k.xdp(&syn(v4(70), 1).with_flags(ACK).build()).action,
        XDP_DROP
    );
    assert_eq!(
        k.xdp(&syn(v6("2001:db8:bad:1::1"), 1).build()).action,
        XDP_DROP
    );
    assert_eq!(k.ingress(Verdict::Drop, Reason::Denylisted), 3);
    // Outside both lists, the cap applies.
    assert_eq!(k.xdp(&syn(v4(20), 1).build()).action, XDP_PASS);
    assert_eq!(k.xdp(&syn(v4(20), 2).build()).action, XDP_TX);
}

#[test]
fn a_ban_blocks_until_it_expires() {
    let mut k = Kernel::new(&[]);
    let ttl = Duration::from_millis(300);
    let banned_at = Instant::now();
    k.dp.maps.ban(v4(2), ttl).unwrap();
    assert_eq!(k.xdp(&syn(v4(2), 1).build()).action, XDP_DROP);
    assert_eq!(k.ingress(Verdict::Drop, Reason::Banned), 1);
    assert_eq!(k.xdp(&syn(v4(3), 1).build()).action, XDP_PASS);
    assert_eq!(k.dp.maps.bans().unwrap().len(), 1);
    // The expiry is a time, not an event: wait it out, then the same SYN is admitted.
    std::thread::sleep(ttl.saturating_sub(banned_at.elapsed()) + Duration::from_millis(20));
    assert_eq!(k.xdp(&syn(v4(2), 2).build()).action, XDP_PASS);
    assert!(k.dp.maps.bans().unwrap().is_empty());
    // Unban lifts a ban at once.
    k.dp.maps.ban(v4(4), Duration::from_secs(600)).unwrap();
    assert_eq!(k.xdp(&syn(v4(4), 1).build()).action, XDP_DROP);
    assert!(k.dp.maps.unban(v4(4)).unwrap());
    assert_eq!(k.xdp(&syn(v4(4), 1).build()).action, XDP_PASS);
}

#[test]
fn a_full_flow_table_fails_open_or_closed_as_configured() {
    let k = Kernel::new(&["--flow-table-size", "2"]);
    for port in 1..=4 {
        assert_eq!(k.xdp(&syn(v4(2), port).build()).action, XDP_PASS);
    }
    assert_eq!(k.ingress(Verdict::Pass, Reason::FlowTableFull), 2);
    assert_eq!(k.global(), 2, "untracked connections hold no slot");
    let k = Kernel::new(&["--flow-table-size", "2", "--fail-closed"]);
    k.xdp(&syn(v4(2), 1).build());
    k.xdp(&syn(v4(2), 2).build());
    assert_eq!(k.xdp(&syn(v4(2), 3).build()).action, XDP_TX);
    assert_eq!(k.ingress(Verdict::Rst, Reason::FlowTableFull), 1);
    assert_eq!(k.global(), 2);
}

#[test]
fn the_agent_releases_a_flow_exactly_once() {
    let mut k = Kernel::new(&[]);
    let s = syn(v4(2), 1);
    k.xdp(&s.build());
    assert_eq!(k.global(), 1);
    assert!(k.dp.release(&flow_key(&s)).unwrap());
    assert_eq!(k.global(), 0);
    assert_eq!(k.dp.maps.source_connections(v4(2)).unwrap(), 0);
    assert!(!k.dp.release(&flow_key(&s)).unwrap(), "already released");
    // A late RST of the released flow releases nothing more.
    k.xdp(&s.with_flags(RST).build());
    assert_eq!(k.global(), 0);
    assert_eq!(k.dp.maps.events(Event::Released).unwrap(), 1);
}

#[test]
fn limits_change_live_without_reloading() {
    let mut k = Kernel::new(&["--max-conn-per-ip", "5"]);
    for port in 1..=3 {
        assert_eq!(k.xdp(&syn(v4(2), port).build()).action, XDP_PASS);
    }
    k.dp.maps
        .apply(&settings(&["--max-conn-per-ip", "3"]).policy)
        .unwrap();
    assert_eq!(k.xdp(&syn(v4(2), 4).build()).action, XDP_TX);
    k.dp.maps
        .apply(&settings(&["--max-conn-per-ip", "0"]).policy)
        .unwrap();
    assert_eq!(
        k.xdp(&syn(v4(2), 4).build()).action,
        XDP_PASS,
        "0 means no limit"
    );
    // Scope changes live too: protect only another port.
    k.dp.maps
        .apply(&settings(&["--ports", "8883", "--max-conn-per-ip", "1"]).policy)
        .unwrap();
    assert_eq!(k.xdp(&syn(v4(2), 5).build()).action, XDP_PASS);
    assert_eq!(k.ingress(Verdict::Pass, Reason::UnprotectedPort), 1);
}

#[test]
fn concurrent_syns_never_exceed_the_caps() {
    // BPF_PROG_TEST_RUN from several threads runs the program on several CPUs at once.
    let k = Kernel::new(&["--max-conn-per-ip", "50", "--max-conn-total", "80"]);
    std::thread::scope(|scope| {
        for t in 0..4u8 {
            let k = &k;
            scope.spawn(move || {
                for port in 0..200u16 {
                    k.xdp(&syn(v4(2 + t % 2), 1000 * u16::from(t) + port).build());
                }
            });
        }
    });
    assert_eq!(k.global(), 80);
    let a = k.dp.maps.source_connections(v4(2)).unwrap();
    let b = k.dp.maps.source_connections(v4(3)).unwrap();
    assert!(a <= 50 && b <= 50, "{a} {b}");
    assert_eq!(a + b, 80);
    assert_eq!(k.dp.maps.flows().unwrap().len(), 80);
}

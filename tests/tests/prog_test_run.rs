//! The kernel programs under BPF_PROG_TEST_RUN, on frames built with etherparse: parsing,
//! every refusal reason, the handshake that admits a connection, close tracking, the RSTs read
//! back by an independent parser, and the attacks the datapath must withstand (fragments,
//! truncation, long IPv6 header chains, spoofed SYN floods).

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::{Duration, Instant},
};

use etherparse::{
    IpFragOffset, IpHeaders, IpNumber, Ipv4Extensions, Ipv4Header, Ipv6Extensions,
    Ipv6FragmentHeader, Ipv6Header, PacketBuilder,
};
use limiter::datapath::{ADJUST_PROGRAM, RELEASE_PROGRAM};
use limiter_common::{
    AdjustRequest, COOKIE_MARK, Direction, Event, FlowKey, FlowRequest, HalfOpen, ProfileSource,
    RST_MARK, Reason, Verdict, attempt_signature, bucket_place, flow_state, helper, map_catalogue,
    seen_slot, source_key,
};
use limiter_tests::{
    frames::{self, CLIENT_MAC, Flags, SERVER_MAC, Tcp, Vlans},
    kernel::{Kernel, TC_ACT_OK, XDP_DROP, XDP_PASS, XDP_TX, handshake, helper_run, isn, settings},
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

fn half_open(k: &Kernel) -> Vec<(FlowKey, HalfOpen)> {
    k.dp.maps.half_open().unwrap()
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
fn a_syn_holds_no_slot_until_its_handshake_completes() {
    let k = Kernel::new(&[]);
    let s = syn(v4(2), 40000);
    assert_eq!(k.xdp(&s.build()).action, XDP_PASS);
    assert_eq!(k.ingress(Verdict::Pass, Reason::HalfOpen), 1);
    assert_eq!(k.global(), 0);
    assert!(k.dp.maps.all_source_connections().unwrap().is_empty());
    // Admitting a SYN writes no hash table: the record waits for the host's SYN-ACK.
    assert!(half_open(&k).is_empty());
    // A retransmitted SYN is the same connection attempt: it too takes nothing.
    assert_eq!(k.xdp(&s.build()).action, XDP_PASS);
    assert_eq!(k.ingress(Verdict::Pass, Reason::HalfOpen), 2);
    assert!(
        k.dp.maps.syn_buckets().unwrap().is_empty(),
        "no bucket claimed"
    );
    let h = handshake(&s, 0xDEAD_BEEF);
    // An ACK before the SYN-ACK acknowledges nothing the host sent.
    k.xdp(&h.ack);
    assert_eq!(k.global(), 0);
    assert_eq!(k.tc(&h.syn_ack), TC_ACT_OK);
    assert_eq!(
        k.packets(Direction::Egress, Verdict::Pass, Reason::Tracked),
        1
    );
    let recorded = half_open(&k);
    assert_eq!(recorded.len(), 1);
    assert_eq!(recorded[0].1.server_isn, 0xDEAD_BEEF);
    // A retransmitted SYN-ACK keeps the record as it is.
    assert_eq!(k.tc(&h.syn_ack), TC_ACT_OK);
    assert_eq!(half_open(&k), recorded);
    // An ACK of another number does not complete it.
    let mut wrong = s.with_flags(ACK);
    wrong.ack = 0xDEAD_BEF1;
    k.xdp(&wrong.build());
    assert_eq!(k.global(), 0);
    assert_eq!(k.xdp(&h.ack).action, XDP_PASS);
    assert_eq!(k.ingress(Verdict::Pass, Reason::Admitted), 1);
    assert_eq!(k.global(), 1);
    assert_eq!(k.dp.maps.source_connections(s.src).unwrap(), 1);
    assert_eq!(k.dp.maps.events(Event::Opened).unwrap(), 1);
    assert!(half_open(&k).is_empty());
    // The same ACK again (or a SYN retransmitted late) takes nothing more.
    k.xdp(&h.ack);
    assert_eq!(k.xdp(&s.build()).action, XDP_PASS);
    assert_eq!(k.global(), 1);
    let flows = k.dp.maps.flows().unwrap();
    assert_eq!(flows.len(), 1);
    assert_eq!(flows[0].0, flow_key(&s));
    assert_ne!(flows[0].1.state & flow_state::ESTABLISHED, 0);
}

#[test]
fn data_on_the_handshake_ack_completes_it_too() {
    let k = Kernel::new(&[]);
    let s = syn(v4(2), 1);
    k.xdp(&s.build());
    let h = handshake(&s, 7);
    k.tc(&h.syn_ack);
    let mut ack = s.with_flags(ACK);
    ack.seq = s.seq.wrapping_add(1);
    ack.ack = 8;
    ack.payload = b"AMQP\x00\x00\x09\x01".to_vec();
    assert_eq!(k.xdp(&ack.build()).action, XDP_PASS);
    assert_eq!(k.global(), 1);
}

#[test]
fn established_segments_pass_without_a_lookup() {
    let k = Kernel::new(&[]);
    let s = syn(v4(2), 1);
    k.connect(&s);
    let mut data = s.with_flags(ACK);
    data.ack = 12345;
    data.payload = vec![0; 100];
    let before = k.all_packets();
    for _ in 0..3 {
        assert_eq!(k.xdp(&data.build()).action, XDP_PASS);
    }
    // No map write on this path: not even a counter moves.
    assert_eq!(k.all_packets(), before);
    assert_eq!(k.tc(&s.reply(ACK).build()), TC_ACT_OK);
    assert_eq!(
        k.packets(Direction::Egress, Verdict::Pass, Reason::Segment),
        1
    );
}

#[test]
fn per_source_cap_refuses_with_a_valid_rst() {
    let k = Kernel::new(&["--max-conn-per-ip", "2", "--rst-xdp-tx"]);
    for port in [40000, 40001] {
        assert_eq!(k.connect(&syn(v4(2), port)).action, XDP_PASS);
    }
    let third = syn(v4(2), 40002);
    let run = k.xdp(&third.build());
    assert_eq!(run.action, XDP_TX);
    assert_rst_reply(&third, &run.frame);
    assert_eq!(k.ingress(Verdict::Rst, Reason::ConnPerIp), 1);
    assert_eq!(k.dp.maps.source_connections(v4(2)).unwrap(), 2);
    // Another source is not affected.
    assert_eq!(k.connect(&syn(v4(3), 40000)).action, XDP_PASS);
    assert_eq!(k.global(), 3);
    // The refusal is recorded against the source for the top-blocked lists.
    let blocked = k.dp.maps.blocked().unwrap();
    assert_eq!(blocked.len(), 1);
    assert_eq!(
        blocked[0].1.counts[Reason::ConnPerIp.blocked_slot().unwrap()],
        1
    );
}

#[test]
fn by_default_a_refused_syn_is_marked_for_tc_ingress() {
    let k = Kernel::new(&["--max-conn-per-ip", "1"]);
    k.connect(&syn(v4(2), 1));
    let frame = syn(v4(2), 2).build();
    let run = k.xdp(&frame);
    assert_eq!(run.action, XDP_PASS);
    // The frame as it was but for its Ethernet type, which is the mark.
    assert_eq!(run.frame.len(), frame.len(), "{:?}", run.frame);
    assert_eq!(run.frame[12..14], RST_MARK.to_be_bytes());
    assert_eq!(run.frame[..12], frame[..12]);
    assert_eq!(run.frame[14..], frame[14..]);
    assert_eq!(k.ingress(Verdict::Rst, Reason::ConnPerIp), 1);
}

#[test]
fn drop_mode_drops_instead_of_resetting() {
    let k = Kernel::new(&["--max-conn-per-ip", "1", "--reject-conn", "drop"]);
    assert_eq!(k.connect(&syn(v4(2), 1)).action, XDP_PASS);
    assert_eq!(k.xdp(&syn(v4(2), 2).build()).action, XDP_DROP);
    assert_eq!(k.ingress(Verdict::Drop, Reason::ConnPerIp), 1);
}

#[test]
fn global_cap_is_shared_by_sources() {
    let k = Kernel::new(&["--max-conn-total", "3", "--rst-xdp-tx"]);
    for (host, port) in [(2, 1), (3, 1), (2, 2)] {
        k.connect(&syn(v4(host), port));
    }
    assert_eq!(k.xdp(&syn(v4(3), 2).build()).action, XDP_TX);
    assert_eq!(k.global(), 3);
    assert_eq!(k.ingress(Verdict::Rst, Reason::ConnTotal), 1);
    assert_eq!(k.dp.maps.source_connections(v4(3)).unwrap(), 1);
}

#[test]
fn caps_are_taken_exactly_when_handshakes_complete() {
    // Both SYNs find the source below its cap; only the first ACK finds a slot.
    let k = Kernel::new(&["--max-conn-per-ip", "1"]);
    let (a, b) = (syn(v4(2), 1), syn(v4(2), 2));
    k.xdp(&a.build());
    k.xdp(&b.build());
    let (ha, hb) = (handshake(&a, 100), handshake(&b, 200));
    k.tc(&ha.syn_ack);
    k.tc(&hb.syn_ack);
    assert_eq!(k.xdp(&ha.ack).action, XDP_PASS);
    let run = k.xdp(&hb.ack);
    // The second ACK goes on to the host as a RST, so the host drops that connection.
    assert_eq!(run.action, XDP_PASS);
    let reply = frames::parse_reply(&run.frame);
    assert_eq!((reply.src, reply.dst), (b.src, b.dst));
    assert_eq!(
        (reply.tcp.source_port, reply.tcp.destination_port),
        (b.sport, b.dport)
    );
    assert!(reply.tcp.rst && !reply.tcp.ack && !reply.tcp.syn);
    assert_eq!(reply.tcp.sequence_number, b.seq.wrapping_add(1));
    assert!(reply.checksums_ok);
    assert_eq!(k.global(), 1);
    assert_eq!(k.dp.maps.source_connections(v4(2)).unwrap(), 1);
    assert_eq!(k.ingress(Verdict::Rst, Reason::ConnPerIp), 1);
    assert_eq!(k.dp.maps.events(Event::RefusedAtAck).unwrap(), 1);
    assert_eq!(k.dp.maps.flows().unwrap().len(), 1);
}

/// The host's RST closing the connection `syn` opened, through the egress program.
fn host_rst(syn: &Tcp) -> Vec<u8> {
    syn.reply(RST).build()
}

/// A SYN, and only if the programs pass it, the host's SYN-ACK and the client's ACK: whether
/// the connection was admitted.
fn attempt(k: &Kernel, s: &Tcp) -> bool {
    if k.xdp(&s.build()).action != XDP_PASS {
        return false;
    }
    let before = k.dp.maps.events(Event::Opened).unwrap();
    let h = handshake(s, isn(s.sport));
    k.tc(&h.syn_ack);
    k.xdp(&h.ack);
    k.dp.maps.events(Event::Opened).unwrap() > before
}

/// Of `n` connection attempts of `src` (fresh ports from `first_port`), those admitted.
fn admitted(k: &Kernel, src: IpAddr, first_port: u16, n: u16) -> usize {
    (0..n)
        .filter(|i| attempt(k, &syn(src, first_port + i)))
        .count()
}

#[test]
fn overrides_raise_and_lower_a_sources_cap_the_most_specific_prefix_winning() {
    let flags = ["--max-conn-per-ip", "2", "--rst-xdp-tx"];
    let overrides = [
        "--override",
        "192.0.2.0/24:max-conn-per-ip=4",
        "--override",
        "192.0.2.3:max-conn-per-ip=1",
        "--override",
        "2001:db8:1:2::/64:max-conn-per-ip=3",
    ];
    let mut k = Kernel::new(&[&flags[..], &overrides].concat());
    assert_eq!(admitted(&k, v4(2), 100, 6), 4, "the /24's cap");
    assert_eq!(admitted(&k, v4(3), 100, 6), 1, "the /32's inside it");
    let outside = IpAddr::V4(Ipv4Addr::new(203, 0, 113, 9));
    assert_eq!(admitted(&k, outside, 100, 6), 2, "the top level's");
    assert_eq!(admitted(&k, v6("2001:db8:1:2::10"), 100, 6), 3);
    assert_eq!(admitted(&k, v6("2001:db8:1:3::10"), 100, 6), 2);
    assert_eq!(
        k.ingress(Verdict::Rst, Reason::ConnPerIp),
        2 + 5 + 4 + 3 + 4
    );
    // Live: without the overrides the top level's cap holds for every source again.
    k.dp.maps.apply(&settings(&flags).policy).unwrap();
    assert_eq!(k.dp.maps.config().unwrap().has_overrides, 0);
    assert_eq!(admitted(&k, v4(4), 100, 6), 2);
    assert_eq!(
        admitted(&k, v4(2), 200, 2),
        0,
        "holds 4, over the cap of 2 now"
    );
}

#[test]
fn an_override_gives_its_sources_a_syn_rate_of_their_own() {
    let k = Kernel::new(&[
        "--syn-rate",
        "1",
        "--syn-burst",
        "3",
        "--override",
        "192.0.2.2:syn-burst=6",
        "--override",
        "192.0.2.3:syn-rate=1,syn-burst=1",
    ]);
    assert_eq!(admitted(&k, v4(2), 100, 10), 6);
    assert_eq!(admitted(&k, v4(3), 100, 10), 1);
    assert_eq!(admitted(&k, v4(4), 100, 10), 3);
}

#[test]
fn syn_rate_admits_exactly_the_burst_of_handshakes() {
    let k = Kernel::new(&["--syn-rate", "1", "--syn-burst", "3"]);
    let admitted = (0..10)
        .filter(|i| attempt(&k, &syn(v4(2), 1000 + i)))
        .count();
    assert_eq!(admitted, 3);
    assert_eq!(
        k.ingress(Verdict::Drop, Reason::SynRate),
        7,
        "refused at the SYN"
    );
    assert_eq!(k.ingress(Verdict::Pass, Reason::HalfOpen), 3);
    assert_eq!(k.global(), 3);
}

#[test]
fn handshakes_racing_past_their_syns_take_exactly_the_burst() {
    // Five SYNs pass while the bucket is full; their handshakes complete after: only the
    // burst's worth get a token, the rest are refused at the ACK.
    let k = Kernel::new(&["--syn-rate", "1", "--syn-burst", "3"]);
    let syns: Vec<Tcp> = (0..5).map(|i| syn(v4(2), 1000 + i)).collect();
    for s in &syns {
        assert_eq!(k.xdp(&s.build()).action, XDP_PASS);
    }
    let handshakes: Vec<_> = syns.iter().map(|s| handshake(s, isn(s.sport))).collect();
    for h in &handshakes {
        k.tc(&h.syn_ack);
    }
    for h in &handshakes {
        k.xdp(&h.ack);
    }
    assert_eq!(k.global(), 3);
    assert_eq!(k.ingress(Verdict::Rst, Reason::SynRate), 2);
    assert_eq!(k.dp.maps.events(Event::RefusedAtAck).unwrap(), 2);
}

/// The ACK completing `s`'s handshake, once its SYN passed and the host's SYN-ACK left.
fn pending_ack(k: &Kernel, s: &Tcp) -> Vec<u8> {
    assert_eq!(k.xdp(&s.build()).action, XDP_PASS);
    let h = handshake(s, isn(s.sport));
    k.tc(&h.syn_ack);
    h.ack
}

/// Each list of ACKs from its own thread, all starting at once: BPF_PROG_TEST_RUN runs them
/// on several CPUs side by side.
fn race(k: &Kernel, acks: &[Vec<Vec<u8>>]) {
    let start = std::sync::Barrier::new(acks.len());
    std::thread::scope(|scope| {
        for acks in acks {
            let start = &start;
            scope.spawn(move || {
                start.wait();
                for ack in acks {
                    k.xdp(ack);
                }
            });
        }
    });
}

#[test]
fn the_connection_rate_admits_exactly_its_burst_from_many_sources_at_once() {
    // A reconnect storm: 120 sources' SYNs all pass while the rate is full, and their
    // handshakes complete on four CPUs at once; only the burst's worth are admitted. Before
    // that, a flood of spoofed SYNs (never completed) spends none of it.
    let k = Kernel::new(&["--syn-rate", "0", "--conn-rate", "1", "--conn-burst", "20"]);
    for i in 0..1000u16 {
        let spoofed = syn(IpAddr::from([198, 18, (i >> 8) as u8, i as u8]), 5000);
        assert_eq!(k.xdp(&spoofed.build()).action, XDP_PASS);
    }
    let acks: Vec<Vec<Vec<u8>>> = (0..4u8)
        .map(|t| {
            (0..30u8)
                .map(|i| pending_ack(&k, &syn(IpAddr::from([10, 20, t, i + 1]), 1000)))
                .collect()
        })
        .collect();
    race(&k, &acks);
    assert_eq!(k.global(), 20);
    assert_eq!(k.ingress(Verdict::Rst, Reason::ConnRate), 100);
    // Spent, the rate refuses the next SYN at once, whoever sends it.
    assert_eq!(
        k.xdp(&syn(v4(77), 1000).build()).action,
        XDP_DROP,
        "a SYN while the rate is spent"
    );
    assert_eq!(k.ingress(Verdict::Drop, Reason::ConnRate), 1);
}

#[test]
fn spoofed_syns_of_a_victims_address_spend_none_of_its_allowance() {
    // An attacker forging the victim's address never sees the SYN-ACKs, so its SYNs complete
    // no handshake: however many, the victim still connects on its first tries.
    let k = Kernel::new(&["--syn-rate", "1", "--syn-burst", "2"]);
    let victim = v4(2);
    for i in 0..500 {
        assert_eq!(k.xdp(&syn(victim, 20_000 + i).build()).action, XDP_PASS);
    }
    assert!(attempt(&k, &syn(victim, 1000)));
    assert!(attempt(&k, &syn(victim, 1001)));
    assert!(!attempt(&k, &syn(victim, 1002)), "its own rate still holds");
}

#[test]
fn replaying_the_last_admitted_syn_takes_a_token_each_handshake() {
    // The same SYN (4-tuple and ISN) after each handshake and RST: each handshake is a new
    // connection and pays for itself.
    let k = Kernel::new(&["--syn-rate", "1", "--syn-burst", "2"]);
    let s = syn(v4(2), 1000);
    let passed = (0..10)
        .filter(|_| {
            let passed = attempt(&k, &s) || k.ingress(Verdict::Drop, Reason::SynRate) == 0;
            k.xdp(&s.with_flags(RST).build());
            k.tc(&host_rst(&s));
            passed
        })
        .count();
    assert_eq!(passed, 2, "the burst, and no more");
    assert_eq!(k.ingress(Verdict::Drop, Reason::SynRate), 8);
}

/// An address of another source whose SYN bucket slot is `victim`'s under the live seed (with
/// another tag: a source of its own), what an attacker would need the seed for. Bounded: 1,024
/// slots, so one in about a thousand addresses shares it.
fn sharing_a_slot(k: &Kernel, victim: IpAddr) -> IpAddr {
    let config = k.dp.maps.config().unwrap();
    assert_eq!(
        config.bucket_mask, 1023,
        "the array is the flow table's size"
    );
    assert_ne!(config.bucket_seed, 0, "the agent drew a seed");
    let place = |addr: IpAddr| {
        let key = source_key(&limiter_tests::model::mapped(addr), 32, 128);
        bucket_place(
            &ProfileSource::new(key, 0),
            config.bucket_seed,
            config.bucket_mask,
        )
    };
    let victim = place(victim);
    (1..1u32 << 20)
        .map(|i| IpAddr::V4(Ipv4Addr::from(0x0A00_0000 | i)))
        .find(|addr| place(*addr).slot == victim.slot && place(*addr).tag != victim.tag)
        .expect("an address sharing the slot")
}

#[test]
fn sources_sharing_a_bucket_slot_cannot_lock_each_other_out() {
    let k = Kernel::new(&[
        "--syn-rate",
        "1",
        "--syn-burst",
        "1",
        "--flow-table-size",
        "1024",
    ]);
    let victim = v4(2);
    let attacker = sharing_a_slot(&k, victim);
    assert!(attempt(&k, &syn(victim, 1000)));
    assert_eq!(
        k.xdp(&syn(victim, 1001).build()).action,
        XDP_DROP,
        "its rate"
    );
    // The attacker connects from the victim's slot: its handshake takes the slot over with a
    // fresh bucket, and its own rate refuses its next SYNs.
    assert!(attempt(&k, &syn(attacker, 2000)));
    let flood = (0..50)
        .filter(|i| k.xdp(&syn(attacker, 2001 + i).build()).action == XDP_PASS)
        .count();
    assert_eq!(flood, 0);
    // Top-blocked lists name the source that claimed the slot last, with its refusals.
    let rate = Reason::SynRate.blocked_slot().unwrap();
    let blocked = k.dp.maps.blocked().unwrap();
    assert_eq!(blocked.len(), 1, "{blocked:?}");
    assert_eq!(blocked[0].0.addr, limiter_tests::model::mapped(attacker));
    assert_eq!(blocked[0].1.counts[rate], 50);
    // The slot is another source's now, so the victim finds a full bucket: sharing a slot
    // can hand a source a fresh burst, never lock it out. Its handshake takes the slot back.
    assert!(attempt(&k, &syn(victim, 1002)));
    // The takeover starts the slot's history afresh, as an LRU's eviction would.
    assert!(k.dp.maps.blocked().unwrap().is_empty());
}

#[test]
fn a_source_at_its_cap_is_refused_at_the_syn_whoever_shares_its_slot() {
    let k = Kernel::new(&["--max-conn-per-ip", "1", "--flow-table-size", "1024"]);
    let victim = v4(2);
    let other = sharing_a_slot(&k, victim);
    k.connect(&syn(victim, 1000));
    // The other source takes its slot over (and back), connects and closes: the slot still
    // counts the victim's connection, so the victim's next SYN is judged on its count.
    k.connect(&syn(other, 1000));
    k.tc(&host_rst(&syn(other, 1000)));
    assert_eq!(k.dp.maps.source_connections(other).unwrap(), 0);
    assert_eq!(k.xdp(&syn(victim, 1001).build()).action, XDP_PASS);
    assert_eq!(
        k.ingress(Verdict::Rst, Reason::ConnPerIp),
        1,
        "refused at the SYN"
    );
    // Once the victim's connection closes, nothing in the slot holds one: its SYN passes
    // without a lookup of its count.
    k.tc(&host_rst(&syn(victim, 1000)));
    assert_eq!(k.global(), 0);
    assert_eq!(k.xdp(&syn(victim, 1002).build()).action, XDP_PASS);
    assert_eq!(k.ingress(Verdict::Rst, Reason::ConnPerIp), 1);
    assert_eq!(k.ingress(Verdict::Pass, Reason::HalfOpen), 3);
}

#[test]
fn refused_connection_attempts_count_apart_from_refused_packets() {
    let k = Kernel::new(&["--syn-rate", "1", "--syn-burst", "1"]);
    assert!(attempt(&k, &syn(v4(2), 1000)), "its one token");
    let attempts = |reason| k.dp.maps.refused_connections(reason).unwrap();
    let top = |k: &Kernel, reason: Reason| {
        let blocked = k.dp.maps.blocked().unwrap();
        assert_eq!(blocked.len(), 1, "{blocked:?}");
        blocked[0].1.counts[reason.blocked_slot().unwrap()]
    };
    // One refused connect, its SYN retransmitted four times: five packets, one attempt.
    let refused = syn(v4(2), 1001);
    for _ in 0..5 {
        assert_eq!(k.xdp(&refused.build()).action, XDP_DROP);
    }
    assert_eq!(k.ingress(Verdict::Drop, Reason::SynRate), 5);
    assert_eq!(attempts(Reason::SynRate), 1);
    assert_eq!(top(&k, Reason::SynRate), 1);
    // A new connect on the same 4-tuple has a new ISN: a second attempt, retransmitted once.
    let mut again = refused.clone();
    again.seq = refused.seq.wrapping_add(0x0100_0000);
    k.xdp(&again.build());
    k.xdp(&again.build());
    // And one from another port.
    k.xdp(&syn(v4(2), 1002).build());
    assert_eq!(k.ingress(Verdict::Drop, Reason::SynRate), 8);
    assert_eq!(attempts(Reason::SynRate), 3);
    assert_eq!(top(&k, Reason::SynRate), 3);
    let slot = |t: &Tcp| {
        let octets = |ip: IpAddr| match ip {
            IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
            IpAddr::V6(v6) => v6.octets(),
        };
        seen_slot(attempt_signature(
            &octets(t.src),
            &octets(t.dst),
            t.sport,
            t.dport,
            t.seq,
        ))
    };
    let overwritten = [&again, &syn(v4(2), 1002)]
        .iter()
        .any(|later| slot(later) == slot(&refused));
    // Going back to the first ISN after others counts it again only if a later refused SYN
    // of the source took its slot (one of four): whether it did is known from the signatures.
    k.xdp(&refused.build());
    assert_eq!(attempts(Reason::SynRate), 3 + u64::from(overwritten));
    assert_eq!(attempts(Reason::ConnPerIp), 0);

    // A cap refusal answered with RST, retransmitted: three RSTs, one attempt; and a
    // handshake refused at its ACK is one attempt too.
    let k = Kernel::new(&["--max-conn-per-ip", "1"]);
    let first = syn(v4(3), 1);
    k.connect(&first);
    let over = syn(v4(3), 2);
    for _ in 0..3 {
        k.xdp(&over.build());
    }
    assert_eq!(k.ingress(Verdict::Rst, Reason::ConnPerIp), 3);
    assert_eq!(k.dp.maps.refused_connections(Reason::ConnPerIp).unwrap(), 1);
    assert_eq!(top(&k, Reason::ConnPerIp), 1);
    k.tc(&host_rst(&first));
    let (a, b) = (syn(v4(3), 3), syn(v4(3), 4));
    let (ha, hb) = (handshake(&a, 7000), handshake(&b, 8000));
    for (s, h) in [(&a, &ha), (&b, &hb)] {
        k.xdp(&s.build());
        k.tc(&h.syn_ack);
    }
    k.xdp(&ha.ack);
    k.xdp(&hb.ack);
    assert_eq!(k.dp.maps.events(Event::RefusedAtAck).unwrap(), 1);
    assert_eq!(k.dp.maps.refused_connections(Reason::ConnPerIp).unwrap(), 2);
    assert_eq!(top(&k, Reason::ConnPerIp), 2);
}

#[test]
fn a_clients_rst_only_marks_its_flow_and_the_hosts_closes_it_once() {
    let k = Kernel::new(&[]);
    let a = syn(v4(2), 1);
    let b = syn(v4(2), 2);
    k.connect(&a);
    k.connect(&b);
    assert_eq!(k.global(), 2);
    // The attacker's try: RSTs naming the flow, which the host may well discard (outside the
    // window, a bad checksum). They release nothing; the sweeper releases the flow once the
    // host's socket is gone.
    for _ in 0..3 {
        assert_eq!(k.xdp(&a.with_flags(RST).build()).action, XDP_PASS);
    }
    assert_eq!(k.global(), 2);
    let flows = k.dp.maps.flows().unwrap();
    let marked = flows.iter().find(|(key, _)| *key == flow_key(&a)).unwrap();
    assert_ne!(marked.1.state & flow_state::RST_IN, 0, "marked");
    // The host's own RST closes it, once.
    assert_eq!(k.tc(&host_rst(&a)), TC_ACT_OK);
    assert_eq!(k.global(), 1);
    k.tc(&host_rst(&a));
    assert_eq!(k.global(), 1);
    assert_eq!(k.tc(&host_rst(&b)), TC_ACT_OK);
    assert_eq!(k.global(), 0);
    assert_eq!(k.dp.maps.source_connections(v4(2)).unwrap(), 0);
    assert_eq!(k.dp.maps.events(Event::ClosedRst).unwrap(), 2);
}

#[test]
fn the_limiters_own_rst_leaving_the_host_releases_nothing() {
    // A spoofed SYN on a victim's 4-tuple at its cap is refused with the limiter's RST|ACK,
    // which TC ingress redirects out through the egress program: marked as the limiter's
    // own, it must not be taken for the host closing the victim's connection.
    let k = Kernel::new(&["--max-conn-per-ip", "1"]);
    let victim = syn(v4(2), 1);
    k.connect(&victim);
    let run = k.xdp(&victim.build());
    assert_eq!(run.action, XDP_PASS, "marked for TC ingress");
    assert_eq!(k.ingress(Verdict::Rst, Reason::ConnPerIp), 1);
    // The RST|ACK `limiter_tc_ingress` makes of that SYN, as it leaves with its mark.
    let mut answer = victim.reply(Flags {
        rst: true,
        ack: true,
        ..Flags::default()
    });
    answer.seq = 0;
    answer.ack = victim.seq.wrapping_add(1);
    let answer = answer.build();
    assert_eq!(k.tc_marked(&answer, limiter_common::REPLY_MARK), TC_ACT_OK);
    assert_eq!(k.global(), 1, "the victim's connection still counts");
    // Without the mark (the host's own RST), the same frame closes it.
    assert_eq!(k.tc(&answer), TC_ACT_OK);
    assert_eq!(k.global(), 0);
}

/// The client's RST for the connection `syn` opened, then the sweeper's release of the flow
/// once the host's socket is gone (the RST only marks it).
fn client_rst_and_sweep(k: &Kernel, s: &Tcp) {
    let mut rst = s.with_flags(RST);
    rst.seq = s.seq.wrapping_add(1);
    k.xdp(&rst.build());
    let request = FlowRequest { flow: flow_key(s) };
    assert_eq!(helper_run(&k.dp, RELEASE_PROGRAM, &request), helper::DONE);
}

#[test]
fn sources_that_hold_nothing_hold_no_entry() {
    // The attacker's try (finding 9): a handshake and a RST from each of more sources than
    // the source table holds, leaving an entry at zero per source on the old code, then a
    // new source with the table failing closed. Half close by the host's RST, half by the
    // client's, released as the sweeper does.
    let k = Kernel::new(&["--flow-table-size", "256", "--fail-closed"]);
    for i in 0..300u32 {
        let s = syn(IpAddr::V4(Ipv4Addr::from(0x0A00_0000 + i)), 1000);
        k.connect(&s);
        if i % 2 == 0 {
            k.tc(&host_rst(&s));
        } else {
            client_rst_and_sweep(&k, &s);
        }
    }
    assert_eq!(k.dp.maps.events(Event::Opened).unwrap(), 300);
    assert_eq!(k.ingress(Verdict::Rst, Reason::FlowTableFull), 0);
    assert!(k.dp.maps.all_source_connections().unwrap().is_empty());
    assert_eq!(k.global(), 0);
    k.connect(&syn(v4(9), 1));
    assert_eq!(k.global(), 1, "a new source is admitted");
    assert_eq!(k.dp.maps.source_connections(v4(9)).unwrap(), 1);
}

/// Whether the ACK of `s`'s handshake was refused at the ACK (a RST to the host) rather than
/// admitted; panics if it was neither (let in uncounted).
fn connect_counted(k: &Kernel, s: &Tcp) -> bool {
    let opened = k.dp.maps.events(Event::Opened).unwrap();
    let refused = k.dp.maps.events(Event::RefusedAtAck).unwrap();
    k.connect(s);
    let opened = k.dp.maps.events(Event::Opened).unwrap() > opened;
    let refused = k.dp.maps.events(Event::RefusedAtAck).unwrap() > refused;
    assert!(opened || refused, "a handshake let in uncounted");
    opened
}

/// `rounds` rounds of: one thread opening and closing connections of `churned` (each time
/// the entry may reach zero and be removed) while another opens 100 of `held` that stay
/// open; after each, `held` holds exactly the connections admitted, and closing them leaves
/// no entry. Returns how many of the held connections were refused at the ACK (a retiring
/// entry outlasting every look; never expected, but a refusal loses no count).
fn churn_rounds(k: &Kernel, churned: IpAddr, held: IpAddr, rounds: u16) -> u64 {
    let start = std::sync::Barrier::new(2);
    let mut refused = 0;
    for round in 0..rounds {
        let base = 1000 + round * 600;
        let admitted = std::thread::scope(|scope| {
            let start = &start;
            scope.spawn(move || {
                start.wait();
                for i in 0..400u16 {
                    let s = syn(churned, base + i);
                    if connect_counted(k, &s) {
                        k.tc(&host_rst(&s));
                    }
                }
            });
            let opener = scope.spawn(move || {
                start.wait();
                (0..100u16)
                    .filter(|i| connect_counted(k, &syn(held, base + 400 + i)))
                    .map(|i| syn(held, base + 400 + i))
                    .collect::<Vec<_>>()
            });
            opener.join().unwrap()
        });
        refused += 100 - admitted.len() as u64;
        let counted = k.dp.maps.source_connections(held).unwrap();
        assert_eq!(counted, admitted.len() as u64, "round {round}");
        assert_eq!(k.global(), counted, "round {round}");
        assert_eq!(
            k.dp.maps.flows().unwrap().len() as u64,
            counted,
            "round {round}"
        );
        for s in &admitted {
            k.tc(&host_rst(s));
        }
        assert!(k.dp.maps.all_source_connections().unwrap().is_empty());
        assert_eq!(k.global(), 0);
    }
    assert_eq!(k.ingress(Verdict::Pass, Reason::FlowTableFull), 0);
    refused
}

#[test]
fn a_source_churning_on_two_cpus_loses_no_count() {
    // The source's entry keeps reaching zero and being removed on one CPU while the other
    // takes slots in it: every slot lands in a live entry.
    let k = Kernel::new(&["--syn-rate", "0", "--max-conn-per-ip", "0"]);
    let refused = churn_rounds(&k, v4(2), v4(2), 20);
    assert!(refused <= 1, "{refused} handshakes refused as busy");
}

#[test]
fn sources_churning_side_by_side_keep_their_own_counts() {
    // A removed entry's memory is reused at once for the next new entry, so a slot taken
    // through a pointer from before the removal could land in another source's count.
    let k = Kernel::new(&["--syn-rate", "0", "--max-conn-per-ip", "0"]);
    let refused = churn_rounds(&k, v4(3), v4(4), 20);
    assert!(refused <= 1, "{refused} handshakes refused as busy");
}

#[test]
fn removing_idle_sources_races_no_handshake() {
    // The sweeper removes entries it reads at zero. A read from user space and a delete
    // after it lose a slot taken in between; the kernel's retirement cannot.
    let k = Kernel::new(&["--syn-rate", "0", "--max-conn-per-ip", "0"]);
    let source = source_key(&limiter_tests::model::mapped(v4(5)), 32, 128);
    let idle = AdjustRequest::source(&ProfileSource::new(source, 0), 0);
    let done = std::sync::atomic::AtomicBool::new(false);
    let (mut removed, mut admitted) = (0u32, 0u64);
    std::thread::scope(|scope| {
        let (k, done, idle) = (&k, &done, &idle);
        let sweeper = scope.spawn(move || {
            let mut removed = 0;
            // Bounded: the opener's 200 handshakes end it much sooner.
            for _ in 0..200_000 {
                if done.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                if helper_run(&k.dp, ADJUST_PROGRAM, idle) == helper::DONE {
                    removed += 1;
                }
            }
            removed
        });
        for i in 0..200u16 {
            let s = syn(v4(5), 3000 + i);
            // Every other connection closes, so the entry keeps coming back to zero.
            if connect_counted(k, &s) {
                admitted += 1;
                if i % 2 == 0 {
                    k.tc(&host_rst(&s));
                    admitted -= 1;
                }
            }
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        removed = sweeper.join().unwrap();
    });
    assert_eq!(k.dp.maps.source_connections(v4(5)).unwrap(), admitted);
    assert_eq!(k.global(), admitted);
    assert!(admitted >= 99, "{admitted} of 100 admitted");
    // An entry holding connections is never removed; one at zero is.
    assert_eq!(helper_run(&k.dp, ADJUST_PROGRAM, &idle), helper::ABSENT);
    eprintln!("the sweeper's removal ran into {removed} idle entries");
}

#[test]
fn fins_both_ways_close_the_flow() {
    let k = Kernel::new(&[]);
    let s = syn(v4(2), 1);
    k.connect(&s);
    k.xdp(&s.with_flags(FIN).build());
    k.xdp(&s.with_flags(FIN).build()); // retransmitted FIN
    assert_eq!(k.global(), 1, "one FIN leaves the flow open");
    k.tc(&s.reply(FIN).build());
    assert_eq!(k.global(), 0);
    assert!(k.dp.maps.flows().unwrap().is_empty());
    assert_eq!(k.dp.maps.events(Event::ClosedFin).unwrap(), 1);
}

#[test]
fn while_cookies_are_checked_a_clients_fin_acking_a_fresh_hint_still_closes_its_flow() {
    // The client closes first, before the server sent anything: its FIN acknowledges the
    // server's ISN + 1, whose hint is fresh, so it is looked at as a cookie's ACK might be;
    // the check finds no listener's cookie in it, and the FIN must still mark the flow.
    let k = Kernel::new(&["--syn-cookies", "always"]);
    let s = syn(v4(2), 1);
    k.connect(&s);
    assert_eq!(k.global(), 1);
    let mut fin = s.with_flags(FIN);
    fin.seq = s.seq.wrapping_add(1);
    fin.ack = isn(s.sport).wrapping_add(1);
    assert_eq!(k.xdp(&fin.build()).action, XDP_PASS);
    k.tc(&s.reply(FIN).build());
    assert_eq!(
        k.global(),
        0,
        "the host's FIN after the client's closes the flow"
    );
    assert!(k.dp.maps.flows().unwrap().is_empty());
}

#[test]
fn a_syn_reusing_a_closing_tuple_keeps_one_slot() {
    let k = Kernel::new(&[]);
    let s = syn(v4(2), 1);
    k.connect(&s);
    k.xdp(&s.with_flags(FIN).build());
    // The client reuses the 4-tuple (a new ISN) before the host's FIN: the new connection
    // takes over the old one's slot, and its handshake takes no second one.
    let mut reuse = s.clone();
    reuse.seq = s.seq.wrapping_add(100_000);
    assert_eq!(k.xdp(&reuse.build()).action, XDP_PASS);
    assert_eq!(k.ingress(Verdict::Pass, Reason::HalfOpen), 2);
    let h = handshake(&reuse, 999);
    k.tc(&h.syn_ack);
    k.xdp(&h.ack);
    assert_eq!(k.global(), 1);
    assert_eq!(k.dp.maps.events(Event::Opened).unwrap(), 1);
    // Open again: the old connection's FIN no longer counts, so the host's FIN alone does
    // not close it. Nor does the client's next one: a FIN from outside never closes (the
    // host may discard it); the sweeper releases the flow once the socket is gone.
    k.tc(&s.reply(FIN).build());
    assert_eq!(k.global(), 1);
    k.xdp(&s.with_flags(FIN).build());
    assert_eq!(k.global(), 1);
}

#[test]
fn ipv6_sources_are_keyed_by_their_prefix() {
    let k = Kernel::new(&["--max-conn-per-ip", "2", "--rst-xdp-tx"]);
    // Two addresses of one /64 share a key; a neighbouring /64 has its own.
    let a = syn(v6("2001:db8:1:2::10"), 1);
    let b = syn(v6("2001:db8:1:2::20"), 1);
    let c = syn(v6("2001:db8:1:2::30"), 1);
    let other = syn(v6("2001:db8:1:3::10"), 1);
    assert_eq!(k.connect(&a).action, XDP_PASS);
    assert_eq!(k.connect(&b).action, XDP_PASS);
    let run = k.xdp(&c.build());
    assert_eq!(run.action, XDP_TX);
    assert_rst_reply(&c, &run.frame);
    assert_eq!(k.connect(&other).action, XDP_PASS);
    assert_eq!(k.global(), 3);
}

#[test]
fn ipv4_prefix_groups_sources() {
    let k = Kernel::new(&[
        "--max-conn-per-ip",
        "1",
        "--ipv4-prefix",
        "24",
        "--rst-xdp-tx",
    ]);
    k.connect(&syn(v4(2), 1));
    assert_eq!(k.xdp(&syn(v4(3), 1).build()).action, XDP_TX);
}

#[test]
fn vlan_qinq_ip_options_and_extension_headers_parse_and_reset() {
    let k = Kernel::new(&["--max-conn-per-ip", "1", "--rst-xdp-tx"]);
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
        assert_eq!(k.connect(first).action, XDP_PASS, "{first:?}");
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
fn a_tiny_first_fragment_syn_is_refused() {
    // The attack: the first fragment carries only 8 bytes of TCP header (ports and sequence
    // number), the flags come in the second. Both are refused, for every source.
    let k = Kernel::new(&["--max-conn-per-ip", "1"]);
    for src in [v4(2), v6("2001:db8::2")] {
        for fragment in syn(src, 1).fragments(8) {
            assert_eq!(k.xdp(&fragment).action, XDP_DROP, "{src}");
        }
    }
    assert_eq!(k.ingress(Verdict::Drop, Reason::Fragment), 4);
    assert!(half_open(&k).is_empty());
    // A first fragment with the whole header, to a protected port, is refused too.
    let whole_header = syn(v4(2), 1).fragments(32);
    assert_eq!(k.xdp(&whole_header[0]).action, XDP_DROP);
    assert_eq!(k.ingress(Verdict::Drop, Reason::Fragment), 5);
}

#[test]
fn a_fast_open_syn_is_judged_and_counted_exactly_like_a_syn() {
    // TCP Fast Open: a SYN carrying a cookie and data, which a server with TFO enabled hands
    // to the application at once, before the handshake completes. The limiter judges it as
    // the SYN it is (lists, bans, rate, caps) and counts it only at the proven handshake, so
    // data in a SYN buys nothing: a refused one is dropped or reset with its data.
    let k = Kernel::new(&["--max-conn-per-ip", "1", "--syn-rate", "0"]);
    let tfo = |sport: u16| {
        let mut s = syn(v4(8), sport);
        s.fast_open_cookie = Some(*b"cookie!!");
        s.payload = b"CONNECT broker".to_vec();
        s
    };
    let first = tfo(45000);
    assert_eq!(k.xdp(&first.build()).action, XDP_PASS);
    assert_eq!(k.ingress(Verdict::Pass, Reason::HalfOpen), 1);
    assert_eq!(k.global(), 0, "no slot before the handshake completes");
    // The server acknowledges the SYN and its data; the client's ACK proves it.
    let h = handshake(&first, isn(first.sport));
    k.tc(&h.syn_ack);
    let mut ack = first.with_flags(ACK);
    ack.fast_open_cookie = None;
    ack.payload.clear();
    ack.seq = first.seq.wrapping_add(1 + first.payload.len() as u32);
    ack.ack = isn(first.sport).wrapping_add(1);
    k.xdp(&ack.build());
    assert_eq!(k.dp.maps.source_connections(v4(8)).unwrap(), 1);
    // At the cap, a second Fast Open SYN is refused like any SYN, its data never delivered.
    let second = tfo(45001);
    let run = k.xdp(&second.build());
    assert_eq!(
        run.action, XDP_PASS,
        "marked for the TC ingress program's RST"
    );
    assert_eq!(run.frame[12..14], RST_MARK.to_be_bytes());
    assert_eq!(k.ingress(Verdict::Rst, Reason::ConnPerIp), 1);
    assert_eq!(k.dp.maps.source_connections(v4(8)).unwrap(), 1);
}

/// A SYN to the protected port inside each kind of tunnel the programs recognise, from
/// outside to the host: IPIP and GRE over IPv4, IPv6 in IPv4 (SIT), IPIP and IPv6 in IPv6
/// and GRE over IPv6.
fn tunnelled_syns() -> Vec<Vec<u8>> {
    let (outer4, host4) = (v4(66), server4());
    let (outer6, host6) = (v6("2001:db8:66::1"), v6("2001:db8:ffff::1"));
    let inner4 = syn(v4(77), 41000).build();
    let inner6 = syn(v6("2001:db8:77::1"), 41000).build();
    vec![
        frames::tunnel(outer4, host4, frames::IPIP, &inner4),
        frames::tunnel(outer4, host4, frames::GRE, &inner4),
        frames::tunnel(outer4, host4, frames::IPV6_IN_IP, &inner6),
        frames::tunnel(outer6, host6, frames::IPIP, &inner4),
        frames::tunnel(outer6, host6, frames::IPV6_IN_IP, &inner6),
        frames::tunnel(outer6, host6, frames::GRE, &inner6),
    ]
}

#[test]
fn tunnels_to_a_protected_interface_are_dropped_unless_passed() {
    // The attacker's try (finding 10): a SYN wrapped in a tunnel the host ends reaches its
    // sockets from the tunnel device, never judged on the interface it came in on.
    let k = Kernel::new(&["--max-conn-per-ip", "1"]);
    let frames = tunnelled_syns();
    for frame in &frames {
        assert_eq!(k.xdp(frame).action, XDP_DROP);
    }
    let n = frames.len() as u64;
    assert_eq!(k.ingress(Verdict::Drop, Reason::Tunnel), n);
    assert_eq!(k.ingress(Verdict::Pass, Reason::NonTcp), 0);
    // Leaving the host, a tunnel passes, counted.
    for frame in &frames {
        assert_eq!(k.tc(frame), TC_ACT_OK);
    }
    assert_eq!(
        k.packets(Direction::Egress, Verdict::Pass, Reason::Tunnel),
        n
    );
    // Other non-TCP traffic still passes.
    assert_eq!(k.xdp(&frames::udp(v4(66), server4())).action, XDP_PASS);
    assert_eq!(k.ingress(Verdict::Pass, Reason::NonTcp), 1);

    // A host that ends tunnels lets them through, live: the same maps, a new policy.
    let mut k = k;
    k.dp.maps
        .apply(&settings(&["--max-conn-per-ip", "1", "--tunnels", "pass"]).policy)
        .unwrap();
    for frame in &frames {
        assert_eq!(k.xdp(frame).action, XDP_PASS);
    }
    assert_eq!(k.ingress(Verdict::Pass, Reason::Tunnel), n);
    assert_eq!(k.ingress(Verdict::Drop, Reason::Tunnel), n, "no more drops");
    assert_eq!(k.global(), 0, "nothing inside was judged or counted");
}

#[test]
fn fragments_to_unprotected_ports_and_non_tcp_fragments_pass() {
    let k = Kernel::new(&["--ports", "5672"]);
    let mut s = syn(v4(2), 1);
    s.dport = 22;
    let parts = s.fragments(32);
    assert_eq!(k.xdp(&parts[0]).action, XDP_PASS, "whole header, port 22");
    assert_eq!(k.ingress(Verdict::Pass, Reason::UnprotectedPort), 1);
    // A later fragment names no port: every TCP one is refused.
    assert_eq!(k.xdp(&parts[1]).action, XDP_DROP);
    // UDP fragments are not TCP's business.
    for (offset, more) in [(0, true), (1, false)] {
        let IpAddr::V4(src) = v4(2) else {
            unreachable!()
        };
        let IpAddr::V4(dst) = server4() else {
            unreachable!()
        };
        let mut h = Ipv4Header::new(0, 64, IpNumber::UDP, src.octets(), dst.octets()).unwrap();
        h.more_fragments = more;
        h.fragment_offset = IpFragOffset::try_new(offset).unwrap();
        let mut frame = Vec::new();
        PacketBuilder::ethernet2(CLIENT_MAC, SERVER_MAC)
            .ip(IpHeaders::Ipv4(h, Ipv4Extensions::default()))
            .write(&mut frame, IpNumber::UDP, &[0; 16])
            .unwrap();
        assert_eq!(k.xdp(&frame).action, XDP_PASS);
    }
    assert_eq!(k.ingress(Verdict::Pass, Reason::NonTcp), 2);
    // IPv6 UDP fragments likewise: the first names UDP behind its fragment header, the
    // later ones in it.
    for (offset, more) in [(0, true), (1, false)] {
        let IpAddr::V6(src) = v6("2001:db8::2") else {
            unreachable!()
        };
        let IpAddr::V6(dst) = v6("2001:db8:ffff::1") else {
            unreachable!()
        };
        let ip = Ipv6Header {
            next_header: IpNumber::IPV6_FRAGMENTATION_HEADER,
            hop_limit: 64,
            source: src.octets(),
            destination: dst.octets(),
            ..Default::default()
        };
        let extensions = Ipv6Extensions {
            fragment: Some(Ipv6FragmentHeader::new(
                IpNumber::UDP,
                IpFragOffset::try_new(offset).unwrap(),
                more,
                7,
            )),
            ..Default::default()
        };
        let mut frame = Vec::new();
        PacketBuilder::ethernet2(CLIENT_MAC, SERVER_MAC)
            .ip(IpHeaders::Ipv6(ip, extensions))
            .write(&mut frame, IpNumber::UDP, &[0; 16])
            .unwrap();
        assert_eq!(k.xdp(&frame).action, XDP_PASS, "IPv6 UDP fragment {offset}");
    }
    assert_eq!(k.ingress(Verdict::Pass, Reason::NonTcp), 4);
    // With every port protected, every TCP fragment is refused.
    let all = Kernel::new(&[]);
    assert_eq!(all.xdp(&parts[0]).action, XDP_DROP);
}

#[test]
fn frames_the_host_discards_change_nothing() {
    // The attacker's try: RSTs and SYNs the host will discard, naming a victim's connection
    // or address. Dropped and counted by why, before anything is judged.
    let k = Kernel::new(&["--syn-rate", "1", "--syn-burst", "1"]);
    let victim = syn(v4(2), 1);
    k.connect(&victim);
    let before = k.dp.maps.flows().unwrap();
    let bad_checksum = |tcp: &Tcp| {
        let mut frame = tcp.build();
        // The IPv4 header checksum, after an untagged Ethernet header.
        frame[14 + 10] ^= 0x5A;
        frame
    };
    for frame in [
        bad_checksum(&victim.with_flags(RST)),
        bad_checksum(&victim.with_flags(FIN)),
        bad_checksum(&syn(v4(2), 2)),
    ] {
        assert_eq!(k.xdp(&frame).action, XDP_DROP);
    }
    assert_eq!(k.ingress(Verdict::Drop, Reason::Checksum), 3);
    // The victim's IPv4 address, IPv4-mapped in an IPv6 source, which the programs would key
    // exactly as the victim.
    let IpAddr::V4(address) = victim.src else {
        unreachable!()
    };
    let mut mapped = victim.clone();
    mapped.src = IpAddr::V6(address.to_ipv6_mapped());
    mapped.dst = v6("2001:db8:ffff::1");
    for flags in [RST, FIN] {
        assert_eq!(k.xdp(&mapped.with_flags(flags).build()).action, XDP_DROP);
    }
    assert_eq!(k.xdp(&mapped.build()).action, XDP_DROP);
    assert_eq!(k.ingress(Verdict::Drop, Reason::Martian), 3);
    // With options, the options' words count in the checksum too.
    let mut with_options = syn(v4(3), 1);
    with_options.ipv4_options = vec![1; 8];
    assert_eq!(k.xdp(&with_options.build()).action, XDP_PASS);
    assert_eq!(k.xdp(&bad_checksum(&with_options)).action, XDP_DROP);
    assert_eq!(k.ingress(Verdict::Drop, Reason::Checksum), 4);
    // Nothing moved: the victim's flow unmarked, its count, and no SYN but the two valid
    // ones (the victim's and the one with options) judged.
    assert_eq!(k.dp.maps.flows().unwrap(), before);
    assert_eq!(k.global(), 1);
    assert_eq!(k.ingress(Verdict::Pass, Reason::HalfOpen), 2);
    assert_eq!(k.ingress(Verdict::Drop, Reason::SynRate), 0);
}

#[test]
fn a_syn_behind_seven_extension_headers_is_refused() {
    let k = Kernel::new(&[]);
    let s = syn(v6("2001:db8::7"), 1);
    assert_eq!(k.xdp(&s.behind_ipv6_chain(7)).action, XDP_DROP);
    assert_eq!(k.ingress(Verdict::Drop, Reason::HeaderChain), 1);
    assert!(half_open(&k).is_empty());
    // A chain the parser follows is judged as usual.
    assert_eq!(k.xdp(&s.behind_ipv6_chain(3)).action, XDP_PASS);
    assert_eq!(k.ingress(Verdict::Pass, Reason::HalfOpen), 1);
}

#[test]
fn a_syn_cut_at_any_offset_is_refused() {
    let k = Kernel::new(&[]);
    let mut refused = 0;
    for src in [v4(2), v6("2001:db8::2")] {
        let mut s = syn(src, 1);
        s.vlans = Vlans::One(5);
        let frame = s.build();
        // Every cut short of the whole frame (BPF_PROG_TEST_RUN needs 14 bytes).
        for len in 14..frame.len() {
            assert_eq!(k.xdp(&frame[..len]).action, XDP_DROP, "cut at {len}");
            refused += 1;
        }
    }
    assert_eq!(k.ingress(Verdict::Drop, Reason::Truncated), refused);
    assert!(half_open(&k).is_empty());
}

#[test]
fn garbage_never_aborts_the_program() {
    let k = Kernel::new(&["--max-conn-per-ip", "1", "--max-conn-total", "1"]);
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
    // A segment of a connection opened before the programs came, and its close.
    let old = syn(v4(2), 9);
    assert_eq!(k.xdp(&old.with_flags(ACK).build()).action, XDP_PASS);
    assert_eq!(k.xdp(&old.with_flags(FIN).build()).action, XDP_PASS);
    assert_eq!(k.ingress(Verdict::Pass, Reason::NonTcp), 1);
    assert_eq!(k.ingress(Verdict::Pass, Reason::NonIp), 1);
    assert_eq!(k.ingress(Verdict::Pass, Reason::UnprotectedPort), 2);
    // The plain segment passes uncounted; its FIN is counted.
    assert_eq!(k.ingress(Verdict::Pass, Reason::Segment), 0);
    assert_eq!(k.ingress(Verdict::Pass, Reason::Untracked), 1);
    assert_eq!(k.global(), 0);
}

#[test]
fn a_forged_mark_from_outside_is_dropped_before_the_tc_program_can_answer_it() {
    // The Ethernet types XDP marks a frame with for `limiter_tc_ingress` to answer: a sender
    // that wrote one itself would have the limiter send answers it chose (a RST, or a cookie's
    // SYN-ACK to any address) with no refusal behind them.
    let k = Kernel::new(&["--max-conn-per-ip", "1"]);
    for (i, mark) in [RST_MARK, COOKIE_MARK].into_iter().enumerate() {
        let mut frame = syn(v4(2), 1).build();
        frame[12..14].copy_from_slice(&mark.to_be_bytes());
        assert_eq!(k.xdp(&frame).action, XDP_DROP, "{mark:#x}");
        assert_eq!(k.ingress(Verdict::Drop, Reason::Malformed), i as u64 + 1);
    }
    assert_eq!(k.ingress(Verdict::Rst, Reason::ConnPerIp), 0);
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
        "--rst-xdp-tx",
    ]);
    for port in 1..=5 {
        assert_eq!(k.connect(&syn(v4(2), port)).action, XDP_PASS);
    }
    assert_eq!(k.global(), 0, "allowlisted connections are not counted");
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
    assert_eq!(k.connect(&syn(v4(20), 1)).action, XDP_PASS);
    assert_eq!(k.xdp(&syn(v4(20), 2).build()).action, XDP_TX);
}

#[test]
fn a_ban_blocks_until_it_expires() {
    let mut k = Kernel::new(&[]);
    assert_eq!(k.dp.maps.config().unwrap().has_bans, 0);
    let ttl = Duration::from_millis(300);
    let banned_at = Instant::now();
    k.dp.maps.ban(v4(2), ttl).unwrap();
    assert_eq!(
        k.dp.maps.config().unwrap().has_bans,
        1,
        "a ban turns the lookup on"
    );
    assert_eq!(k.xdp(&syn(v4(2), 1).build()).action, XDP_DROP);
    assert_eq!(k.ingress(Verdict::Drop, Reason::Banned), 1);
    // Not only its SYNs: a data segment of a connection it opened before the ban is dropped
    // too (no fast path while a ban is in force).
    let mut data = syn(v4(2), 9).with_flags(ACK);
    data.payload = vec![0; 64];
    assert_eq!(k.xdp(&data.build()).action, XDP_DROP);
    assert_eq!(k.ingress(Verdict::Drop, Reason::Banned), 2);
    assert_eq!(k.xdp(&syn(v4(3), 1).build()).action, XDP_PASS);
    assert_eq!(k.dp.maps.bans().unwrap().len(), 1);
    // Applying settings keeps the lookup on while bans exist.
    k.dp.maps.apply(&settings(&[]).policy).unwrap();
    assert_eq!(k.dp.maps.config().unwrap().has_bans, 1);
    // The expiry is a time, not an event: wait it out, then the same SYN passes.
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
        assert_eq!(k.connect(&syn(v4(2), port)).action, XDP_PASS);
    }
    assert_eq!(k.ingress(Verdict::Pass, Reason::FlowTableFull), 2);
    assert_eq!(k.global(), 2, "untracked connections hold no slot");
    let k = Kernel::new(&["--flow-table-size", "2", "--fail-closed"]);
    k.connect(&syn(v4(2), 1));
    k.connect(&syn(v4(2), 2));
    let run = k.connect(&syn(v4(2), 3));
    assert_eq!(run.action, XDP_PASS);
    assert!(
        frames::parse_reply(&run.frame).tcp.rst,
        "the ACK became a RST"
    );
    assert_eq!(k.ingress(Verdict::Rst, Reason::FlowTableFull), 1);
    assert_eq!(k.global(), 2);
}

#[test]
fn the_agent_releases_a_flow_exactly_once() {
    let mut k = Kernel::new(&[]);
    let s = syn(v4(2), 1);
    k.connect(&s);
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
    let mut k = Kernel::new(&["--max-conn-per-ip", "5", "--rst-xdp-tx"]);
    for port in 1..=3 {
        assert_eq!(k.connect(&syn(v4(2), port)).action, XDP_PASS);
    }
    k.dp.maps
        .apply(&settings(&["--max-conn-per-ip", "3", "--rst-xdp-tx"]).policy)
        .unwrap();
    assert_eq!(k.xdp(&syn(v4(2), 4).build()).action, XDP_TX);
    k.dp.maps
        .apply(&settings(&["--max-conn-per-ip", "0"]).policy)
        .unwrap();
    k.connect(&syn(v4(2), 4));
    assert_eq!(k.global(), 4, "0 means no limit");
    // Scope changes live too: protect only another port.
    k.dp.maps
        .apply(&settings(&["--ports", "8883", "--max-conn-per-ip", "1"]).policy)
        .unwrap();
    assert_eq!(k.xdp(&syn(v4(2), 5).build()).action, XDP_PASS);
    assert_eq!(k.ingress(Verdict::Pass, Reason::UnprotectedPort), 1);
}

#[test]
fn concurrent_handshakes_never_exceed_the_caps() {
    // BPF_PROG_TEST_RUN from several threads runs the program on several CPUs at once.
    let k = Kernel::new(&["--max-conn-per-ip", "50", "--max-conn-total", "80"]);
    std::thread::scope(|scope| {
        for t in 0..4u8 {
            let k = &k;
            scope.spawn(move || {
                for port in 0..200u16 {
                    k.connect(&syn(v4(2 + t % 2), 1000 * u16::from(t) + port));
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

#[test]
fn racing_a_new_sources_first_handshakes_across_cpus_wins_no_extra_token() {
    // The attacker's try: a source with no bucket yet completes its first handshakes on two
    // CPUs at once, so both find the slot unclaimed and both claim it; only one claim wins,
    // and the other handshake must take its token from the winner's bucket.
    let k = Kernel::new(&["--syn-rate", "1", "--syn-burst", "5"]);
    for round in 0..20u8 {
        let acks: Vec<Vec<Vec<u8>>> = (0..2u16)
            .map(|t| {
                (0..8u16)
                    .map(|i| pending_ack(&k, &syn(v4(100 + round), 1000 + 100 * t + i)))
                    .collect()
            })
            .collect();
        let before = k.global();
        race(&k, &acks);
        assert_eq!(k.global() - before, 5, "round {round}");
    }
    assert_eq!(k.ingress(Verdict::Rst, Reason::SynRate), 20 * 11);
}

#[test]
fn a_spoofed_syn_flood_holds_no_slot_and_locks_no_one_out() {
    let k = Kernel::new(&["--max-conn-total", "10000", "--max-conn-per-ip", "3"]);
    let server = server4();
    // 120,000 SYNs from as many sources in 198.18.0.0/15, each answered by the host.
    let sources = 120_000u32;
    for i in 0..sources {
        let src = IpAddr::V4(Ipv4Addr::from(0xC612_0000 + i));
        let s = Tcp::syn(src, 1024 + (i % 60_000) as u16, server, PORT);
        assert_eq!(k.xdp(&s.build()).action, XDP_PASS);
        if i % 16 == 0 {
            k.tc(&handshake(&s, isn(s.sport)).syn_ack);
        }
    }
    assert_eq!(
        k.ingress(Verdict::Pass, Reason::HalfOpen),
        u64::from(sources)
    );
    assert_eq!(k.global(), 0);
    assert!(k.dp.maps.all_source_connections().unwrap().is_empty());
    assert!(half_open(&k).len() <= map_catalogue::HALF_OPEN.default_entries as usize);
    // A real client right after gets in on its first try.
    let real = syn(
        IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 9)),
        4000,
    );
    assert_eq!(k.connect(&real).action, XDP_PASS);
    assert_eq!(k.global(), 1);
    assert_eq!(k.ingress(Verdict::Pass, Reason::Admitted), 1);
}

#[test]
fn the_object_holds_exactly_the_catalogued_maps() {
    use aya::maps::Map;
    let ebpf = aya::Ebpf::load(limiter::datapath::EBPF_OBJECT).expect("the object");
    for def in map_catalogue::ALL {
        let map = ebpf
            .map(def.name)
            .unwrap_or_else(|| panic!("{} is catalogued but not in the object", def.name));
        let kind = match map {
            Map::Array(_) => map_catalogue::MapKind::Array,
            Map::PerCpuArray(_) => map_catalogue::MapKind::PerCpuArray,
            Map::HashMap(_) => map_catalogue::MapKind::Hash,
            Map::LruHashMap(_) => map_catalogue::MapKind::LruHash,
            Map::LpmTrie(_) => map_catalogue::MapKind::LpmTrie,
            other => panic!("{}: unexpected {other:?}", def.name),
        };
        assert_eq!(kind, def.kind, "{}", def.name);
    }
    // Besides them only aya-log's ring and the object's data sections.
    let others: Vec<&str> = ebpf
        .maps()
        .map(|(name, _)| name)
        .filter(|name| !map_catalogue::ALL.iter().any(|def| def.name == *name))
        .filter(|name| *name != "AYA_LOGS" && !name.starts_with('.'))
        .collect();
    assert!(others.is_empty(), "not catalogued: {others:?}");
}

/// Enforce mode's refusals of the attempts in `traffic` (each a source and a number of
/// connection attempts, made in turn, each held open) against monitor mode's would-refuse
/// counts, on the same limits: (refused at the SYN by reason, would-refuse by reason, the
/// connections monitor mode let in).
fn enforce_and_monitor(
    flags: &[&str],
    traffic: &[(IpAddr, u16)],
    ban: Option<IpAddr>,
) -> (Vec<u64>, Vec<u64>, u64) {
    let run = |mode: &str| {
        // Refused SYNs answered by `XDP_TX`, so `admitted` sees them refused and goes on.
        let mut k = Kernel::new(&[flags, &["--mode", mode, "--rst-xdp-tx"]].concat());
        if let Some(banned) = ban {
            k.dp.maps.ban(banned, Duration::from_secs(600)).unwrap();
        }
        let mut port = 1000;
        let admitted: usize = traffic
            .iter()
            .map(|&(src, n)| {
                port += 100;
                admitted(&k, src, port, n)
            })
            .sum();
        let refusals = &Reason::ALL[..Reason::REFUSAL_COUNT];
        let counted = |verdicts: &[Verdict]| -> Vec<u64> {
            refusals
                .iter()
                .map(|&r| verdicts.iter().map(|&v| k.ingress(v, r)).sum())
                .collect()
        };
        (
            counted(&[Verdict::Drop, Verdict::Rst]),
            counted(&[Verdict::WouldRefuse]),
            admitted as u64,
            k.global(),
        )
    };
    let (refused, none, _, _) = run("enforce");
    assert!(
        none.iter().all(|&n| n == 0),
        "enforce mode monitors nothing"
    );
    let (nothing, would_refuse, admitted, held) = run("monitor");
    assert!(
        nothing.iter().all(|&n| n == 0),
        "monitor mode refused {nothing:?}"
    );
    let attempts: u64 = traffic.iter().map(|&(_, n)| u64::from(n)).sum();
    assert_eq!(admitted, attempts, "monitor mode let every attempt in");
    (refused, would_refuse, held)
}

#[test]
fn monitor_mode_refuses_nothing_and_counts_exactly_what_enforce_mode_refuses() {
    let (a, b, c) = (v4(2), v4(3), v4(4));
    let denied = IpAddr::V4(Ipv4Addr::new(203, 0, 113, 7));
    // The limits, the attempts of each source in turn, and a source banned first.
    type Case<'a> = (&'a [&'a str], Vec<(IpAddr, u16)>, Option<IpAddr>);
    let cases: [Case; 5] = [
        (&["--max-conn-per-ip", "2"], vec![(a, 6), (b, 1)], None),
        (
            &["--max-conn-total", "3"],
            vec![(a, 2), (b, 2), (c, 2)],
            None,
        ),
        (
            &["--syn-rate", "1", "--syn-burst", "3"],
            vec![(a, 10)],
            None,
        ),
        (
            &["--deny", "203.0.113.0/24"],
            vec![(denied, 3), (a, 2)],
            None,
        ),
        (&[], vec![(b, 4), (a, 1)], Some(b)),
    ];
    for (flags, traffic, ban) in cases {
        let (refused, would_refuse, held) = enforce_and_monitor(flags, &traffic, ban);
        assert!(
            refused.iter().sum::<u64>() > 0,
            "{flags:?} refuses something"
        );
        assert_eq!(would_refuse, refused, "{flags:?}");
        // Every connection monitor mode let in is tracked (a barred source's too), so its
        // close would give its slots back.
        let attempts: u64 = traffic.iter().map(|&(_, n)| u64::from(n)).sum();
        assert_eq!(held, attempts, "{flags:?}");
    }
}

/// A port of the profiles' tests: the MQTT listener's, in profile `mqtt`.
const MQTT: u16 = 1883;

fn syn_to(src: IpAddr, sport: u16, port: u16) -> Tcp {
    Tcp {
        dport: port,
        ..syn(src, sport)
    }
}

/// Two profiles with different caps: 5672 at the top level (3 per source, 40 in all) and 1883
/// in `mqtt` (10 per source, 25 in all).
const TWO_PROFILES: &[&str] = &[
    "--ports",
    "5672",
    "--max-conn-per-ip",
    "3",
    "--max-conn-total",
    "40",
    "--syn-rate",
    "0",
    "--profile",
    "mqtt:ports=1883,max-conn-per-ip=10,max-conn-total=25",
];

#[test]
fn two_profiles_hold_their_own_caps_exactly_at_once() {
    // Handshakes of the same sources to both profiles' ports, racing on four CPUs: each
    // profile's caps hold exactly on its own counts, and a source's connections to one
    // profile never spend its allowance on the other.
    let k = Kernel::new(TWO_PROFILES);
    let acks: Vec<Vec<Vec<u8>>> = (0..4u16)
        .map(|t| {
            (0..30u16)
                .map(|i| {
                    let port = if i % 2 == 0 { PORT } else { MQTT };
                    let source = v4(2 + (t % 2) as u8 + 2 * (i % 5) as u8);
                    pending_ack(&k, &syn_to(source, 1000 * (t + 1) + i, port))
                })
                .collect()
        })
        .collect();
    race(&k, &acks);
    let counts = k.dp.maps.profile_connections().unwrap();
    let mqtt = 1;
    assert_eq!(counts[0], 30, "the top level: 10 sources, 3 each");
    assert_eq!(counts[mqtt], 25, "mqtt: its total");
    for last in 2..12 {
        let source = v4(last);
        let top = k.dp.maps.source_connections_in(source, 0).unwrap();
        let own =
            k.dp.maps
                .source_connections_in(source, mqtt as u32)
                .unwrap();
        assert_eq!(top, 3, "{source} at the top level");
        assert!(own <= 10, "{source} in mqtt: {own}");
    }
    let refused = |profile, reason| k.dp.maps.refusals_in(profile, false, reason).unwrap();
    assert_eq!(
        refused(0, Reason::ConnPerIp),
        30,
        "each source's 6 tries, 3 over"
    );
    assert_eq!(refused(mqtt as u32, Reason::ConnTotal), 35);
    assert_eq!(refused(mqtt as u32, Reason::ConnPerIp), 0);
    assert_eq!(k.dp.maps.flows().unwrap().len(), 55);
}

#[test]
fn a_source_at_its_cap_in_one_profile_still_connects_in_the_other() {
    let k = Kernel::new(TWO_PROFILES);
    for port in 1..=3 {
        assert_eq!(k.connect(&syn(v4(2), port)).action, XDP_PASS);
    }
    // At its top-level cap: refused there, at the SYN...
    assert_eq!(k.xdp(&syn(v4(2), 4).build()).action, XDP_PASS, "marked");
    assert_eq!(k.ingress(Verdict::Rst, Reason::ConnPerIp), 1);
    // ...and admitted to the profile's port, whose count is its own.
    for port in 10..20 {
        k.connect(&syn_to(v4(2), port, MQTT));
    }
    assert_eq!(k.dp.maps.source_connections_in(v4(2), 1).unwrap(), 10);
    assert_eq!(k.dp.maps.source_connections(v4(2)).unwrap(), 13);
    assert_eq!(k.ingress(Verdict::Rst, Reason::ConnPerIp), 1);
}

#[test]
fn a_flow_gives_its_slots_back_to_the_profile_it_was_counted_in() {
    // A reload that moves a port to another profile (or back to the top level) while it has
    // connections: each connection was counted in its old profile and gives its slots back
    // there, so no count goes below zero or keeps a slot forever.
    let mut k = Kernel::new(TWO_PROFILES);
    let s = syn_to(v4(2), 4000, MQTT);
    k.connect(&s);
    assert_eq!(k.dp.maps.profile_connections().unwrap()[1], 1);
    k.dp.maps
        .apply(&settings(&["--ports", "5672,1883", "--syn-rate", "0"]).policy)
        .unwrap();
    // The port is the top level's now; a new connection counts there.
    k.connect(&syn_to(v4(2), 4001, MQTT));
    let counts = k.dp.maps.profile_connections().unwrap();
    assert_eq!((counts[0], counts[1]), (1, 1));
    // The host's RST closes the first: its slot goes back to `mqtt`'s count.
    k.tc(&host_rst(&s));
    let counts = k.dp.maps.profile_connections().unwrap();
    assert_eq!((counts[0], counts[1]), (1, 0));
    assert_eq!(k.dp.maps.source_connections_in(v4(2), 1).unwrap(), 0);
    assert_eq!(k.dp.maps.source_connections_in(v4(2), 0).unwrap(), 1);
}

#[test]
fn a_profile_keeps_its_slot_by_name_across_reloads() {
    // Flows record their profile's slot: a reload that adds a profile before another, or
    // renames one, must not move a kept profile to another slot, or its connections' slots
    // would go back to someone else's counts.
    let mut k = Kernel::new(TWO_PROFILES);
    k.connect(&syn_to(v4(2), 4000, MQTT));
    let with_dash = [
        TWO_PROFILES,
        &["--profile", "admin:ports=8080,max-conn-per-ip=1"],
    ]
    .concat();
    k.dp.maps.apply(&settings(&with_dash).policy).unwrap();
    let held = k.dp.maps.profile_slots().unwrap();
    let slot_of = |name: &str| held.iter().find(|(_, n, _)| n == name).map(|(s, ..)| *s);
    assert_eq!(slot_of("mqtt"), Some(1), "kept");
    assert_eq!(slot_of("admin"), Some(2), "a new one takes a free slot");
    assert_eq!(k.dp.maps.profile_connections().unwrap()[1], 1);
    // Removed, then back: a profile gone leaves its slot empty, and its name finds a slot.
    k.dp.maps
        .apply(&settings(&["--ports", "5672", "--syn-rate", "0"]).policy)
        .unwrap();
    assert!(k.dp.maps.profile_slots().unwrap().is_empty());
    k.dp.maps.apply(&settings(&with_dash).policy).unwrap();
    assert_eq!(k.dp.maps.profile_slots().unwrap().len(), 2);
}

/// One connection a source on 5672 at the top level, no rate, and profile `mqtt` on 1883 as
/// `mqtt` says, then `more`.
fn beside_mqtt(mqtt: &str, more: &[&str]) -> Kernel {
    let profile = format!("mqtt:ports=1883,{mqtt}");
    let top = [
        "--ports",
        "5672",
        "--max-conn-per-ip",
        "1",
        "--syn-rate",
        "0",
        "--profile",
        &profile,
    ];
    Kernel::new(&[&top[..], more].concat())
}

#[test]
fn a_profile_in_monitor_mode_refuses_nothing_while_the_top_level_enforces() {
    let k = beside_mqtt("max-conn-per-ip=1,mode=monitor", &["--rst-xdp-tx"]);
    k.connect(&syn(v4(2), 1));
    for port in 1..=3 {
        assert_eq!(k.connect(&syn_to(v4(2), port, MQTT)).action, XDP_PASS);
    }
    for port in 2..=3 {
        assert_eq!(k.xdp(&syn(v4(2), port).build()).action, XDP_TX);
    }
    let counts = k.dp.maps.profile_connections().unwrap();
    assert_eq!(
        (counts[0], counts[1]),
        (1, 3),
        "the top level refused, mqtt let in"
    );
    let m = &k.dp.maps;
    assert_eq!(m.refusals_in(0, false, Reason::ConnPerIp).unwrap(), 2);
    assert_eq!(m.refusals_in(1, false, Reason::ConnPerIp).unwrap(), 0);
    assert_eq!(m.refusals_in(1, true, Reason::ConnPerIp).unwrap(), 2);
    assert_eq!(m.refusals_in(0, true, Reason::ConnPerIp).unwrap(), 0);
}

#[test]
fn an_override_keeps_its_ports_profile_limits_where_it_sets_none() {
    // A NAT gateway's /24 gets 5 connections a source everywhere; its SYN rate stays each
    // profile's (the top level's none, mqtt's 1 a second after a burst of 2).
    let k = beside_mqtt(
        "max-conn-per-ip=1,syn-rate=1,syn-burst=2",
        &["--override", "192.0.2.0/24:max-conn-per-ip=5"],
    );
    for port in 1..=6 {
        k.connect(&syn(v4(2), port));
        k.connect(&syn_to(v4(2), 100 + port, MQTT));
    }
    let counts = k.dp.maps.profile_connections().unwrap();
    assert_eq!(counts[0], 5, "the override's cap, no rate");
    assert_eq!(counts[1], 2, "mqtt's rate: its burst of 2");
    assert!(k.dp.maps.refusals_in(1, false, Reason::SynRate).unwrap() >= 3);
}

//! Frames for `BPF_PROG_TEST_RUN`, built with etherparse so no test hand-writes a header,
//! and an independent parse of what the program sends back.

use std::net::IpAddr;

use etherparse::{
    EtherType, Ethernet2Header, IpFragOffset, IpHeaders, IpNumber, Ipv4Extensions, Ipv4Header,
    Ipv6Extensions, Ipv6FragmentHeader, Ipv6Header, Ipv6RawExtHeader, NetSlice, PacketBuilder,
    SlicedPacket, TcpHeader, TransportSlice, VlanId,
};

pub const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
pub const SERVER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Vlans {
    #[default]
    None,
    One(u16),
    /// 802.1ad outer tag, 802.1Q inner tag.
    Two(u16, u16),
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Flags {
    pub syn: bool,
    pub ack: bool,
    pub fin: bool,
    pub rst: bool,
}

/// A TCP segment to frame. Start from [`Tcp::syn`] and adjust fields.
#[derive(Clone, Debug)]
pub struct Tcp {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
    pub seq: u32,
    /// The acknowledgment number (sent with the ACK flag).
    pub ack: u32,
    pub flags: Flags,
    /// The flag bits [`Flags`] leaves out (PSH 0x08, URG 0x20, ECE 0x40, CWR 0x80): the
    /// programs must ignore them, so tests set them to check that they do.
    pub other_flags: u8,
    pub vlans: Vlans,
    /// IPv4 options (a multiple of 4 bytes).
    pub ipv4_options: Vec<u8>,
    /// IPv6: a hop-by-hop and a destination options header before TCP.
    pub ipv6_extensions: bool,
    /// Fragment offset in 8-byte units: non-zero makes a non-first fragment.
    pub fragment_offset: u16,
    /// TCP options as a SYN carries them (MSS, SACK permitted, window scale).
    pub tcp_options: bool,
    /// A TCP Fast Open cookie option (kind 34) after the usual options, as a client's SYN
    /// carrying data on a cookie the server gave it earlier.
    pub fast_open_cookie: Option<[u8; 8]>,
    pub payload: Vec<u8>,
}

impl Tcp {
    pub fn syn(src: IpAddr, sport: u16, dst: IpAddr, dport: u16) -> Self {
        Self {
            src,
            dst,
            sport,
            dport,
            seq: 0x1234_5678,
            ack: 0,
            flags: Flags {
                syn: true,
                ..Flags::default()
            },
            other_flags: 0,
            vlans: Vlans::None,
            ipv4_options: Vec::new(),
            ipv6_extensions: false,
            fragment_offset: 0,
            tcp_options: true,
            fast_open_cookie: None,
            payload: Vec::new(),
        }
    }

    /// The same 4-tuple with other flags.
    pub fn with_flags(&self, flags: Flags) -> Self {
        Self {
            flags,
            ..self.clone()
        }
    }

    /// The same 4-tuple with all eight flag bits taken from `byte`, as on the wire.
    pub fn with_flag_byte(&self, byte: u8) -> Self {
        Self {
            flags: Flags {
                fin: byte & 0x01 != 0,
                syn: byte & 0x02 != 0,
                rst: byte & 0x04 != 0,
                ack: byte & 0x10 != 0,
            },
            other_flags: byte & 0xE8,
            ..self.clone()
        }
    }

    /// The flag byte as the TCP header carries it.
    pub fn flag_byte(&self) -> u8 {
        let f = self.flags;
        u8::from(f.fin)
            | u8::from(f.syn) << 1
            | u8::from(f.rst) << 2
            | u8::from(f.ack) << 4
            | self.other_flags
    }

    /// The reverse direction (as the host would send it), with `flags`.
    pub fn reply(&self, flags: Flags) -> Self {
        Self {
            src: self.dst,
            dst: self.src,
            sport: self.dport,
            dport: self.sport,
            flags,
            ..self.clone()
        }
    }

    /// The TCP header, checksum not yet set.
    fn tcp_header(&self) -> TcpHeader {
        let mut tcp = TcpHeader::new(self.sport, self.dport, self.seq, 64_240);
        tcp.acknowledgment_number = self.ack;
        tcp.syn = self.flags.syn;
        tcp.ack = self.flags.ack;
        tcp.fin = self.flags.fin;
        tcp.rst = self.flags.rst;
        tcp.psh = self.other_flags & 0x08 != 0;
        tcp.urg = self.other_flags & 0x20 != 0;
        tcp.ece = self.other_flags & 0x40 != 0;
        tcp.cwr = self.other_flags & 0x80 != 0;
        let mut options = Vec::new();
        if self.tcp_options {
            // MSS 1460, SACK permitted, NOP, window scale 7: 12 bytes.
            options.extend_from_slice(&[2, 4, 5, 180, 4, 2, 1, 3, 3, 7, 1, 1]);
        }
        if let Some(cookie) = self.fast_open_cookie {
            // Fast Open (kind 34, length 10) and two NOPs to a four-byte boundary.
            options.extend_from_slice(&[34, 10]);
            options.extend_from_slice(&cookie);
            options.extend_from_slice(&[1, 1]);
        }
        if !options.is_empty() {
            tcp.set_options_raw(&options).expect("valid TCP options");
        }
        tcp
    }

    /// The TCP segment (header with its checksum, and payload) as bytes.
    fn segment_bytes(&self) -> Vec<u8> {
        let mut tcp = self.tcp_header();
        tcp.checksum = match (self.src, self.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => tcp
                .calc_checksum_ipv4_raw(s.octets(), d.octets(), &self.payload)
                .expect("checksum"),
            (IpAddr::V6(s), IpAddr::V6(d)) => tcp
                .calc_checksum_ipv6_raw(s.octets(), d.octets(), &self.payload)
                .expect("checksum"),
            _ => panic!("mixed families"),
        };
        let mut bytes = tcp.to_bytes().to_vec();
        bytes.extend_from_slice(&self.payload);
        bytes
    }

    /// The segment as IP fragments: the first carries `first` bytes of the TCP segment (a
    /// multiple of 8), the second the rest.
    pub fn fragments(&self, first: usize) -> Vec<Vec<u8>> {
        assert_eq!(first % 8, 0, "fragment payloads come in 8-byte units");
        let segment = self.segment_bytes();
        let parts = [
            (0, &segment[..first], true),
            (first, &segment[first..], false),
        ];
        parts
            .iter()
            .map(|(offset, part, more)| {
                let offset = IpFragOffset::try_new((*offset / 8) as u16).expect("offset");
                let ip = match (self.src, self.dst) {
                    (IpAddr::V4(src), IpAddr::V4(dst)) => {
                        let mut h =
                            Ipv4Header::new(0, 64, IpNumber::TCP, src.octets(), dst.octets())
                                .expect("valid IPv4 header");
                        h.more_fragments = *more;
                        h.fragment_offset = offset;
                        IpHeaders::Ipv4(h, Ipv4Extensions::default())
                    }
                    (IpAddr::V6(src), IpAddr::V6(dst)) => {
                        let header = Ipv6Header {
                            hop_limit: 64,
                            source: src.octets(),
                            destination: dst.octets(),
                            ..Default::default()
                        };
                        let exts = Ipv6Extensions {
                            fragment: Some(Ipv6FragmentHeader::new(
                                IpNumber::TCP,
                                offset,
                                *more,
                                0x5EED,
                            )),
                            ..Default::default()
                        };
                        IpHeaders::Ipv6(header, exts)
                    }
                    _ => panic!("mixed families"),
                };
                let mut frame = Vec::new();
                PacketBuilder::ethernet2(CLIENT_MAC, SERVER_MAC)
                    .ip(ip)
                    .write(&mut frame, IpNumber::TCP, part)
                    .expect("writing to a Vec");
                frame
            })
            .collect()
    }

    /// The (IPv6) segment behind a chain of `count` destination-options headers.
    pub fn behind_ipv6_chain(&self, count: usize) -> Vec<u8> {
        let (IpAddr::V6(src), IpAddr::V6(dst)) = (self.src, self.dst) else {
            panic!("an IPv6 segment");
        };
        let padding = [1, 4, 0, 0, 0, 0];
        let mut chain = Vec::new();
        for i in 1..count {
            let next = if i + 1 == count {
                IpNumber::TCP
            } else {
                IpNumber::IPV6_DESTINATION_OPTIONS
            };
            let ext = Ipv6RawExtHeader::new_raw(next, &padding).expect("ext");
            chain.extend_from_slice(&ext.to_bytes());
        }
        chain.extend_from_slice(&self.segment_bytes());
        let header = Ipv6Header {
            hop_limit: 64,
            source: src.octets(),
            destination: dst.octets(),
            ..Default::default()
        };
        let exts = Ipv6Extensions {
            hop_by_hop_options: Some(
                Ipv6RawExtHeader::new_raw(IpNumber::TCP, &padding).expect("ext"),
            ),
            ..Default::default()
        };
        let first_next = if count > 1 {
            IpNumber::IPV6_DESTINATION_OPTIONS
        } else {
            IpNumber::TCP
        };
        let mut frame = Vec::new();
        PacketBuilder::ethernet2(CLIENT_MAC, SERVER_MAC)
            .ip(IpHeaders::Ipv6(header, exts))
            .write(&mut frame, first_next, &chain)
            .expect("writing to a Vec");
        frame
    }

    pub fn build(&self) -> Vec<u8> {
        let tcp = self.tcp_header();
        let ip = match (self.src, self.dst) {
            (IpAddr::V4(src), IpAddr::V4(dst)) => {
                let mut h = Ipv4Header::new(0, 64, IpNumber::TCP, src.octets(), dst.octets())
                    .expect("valid IPv4 header");
                h.options = self.ipv4_options[..]
                    .try_into()
                    .expect("valid IPv4 options");
                h.fragment_offset = IpFragOffset::try_new(self.fragment_offset).expect("offset");
                IpHeaders::Ipv4(h, Ipv4Extensions::default())
            }
            (IpAddr::V6(src), IpAddr::V6(dst)) => {
                let header = Ipv6Header {
                    hop_limit: 64,
                    source: src.octets(),
                    destination: dst.octets(),
                    ..Default::default()
                };
                let mut exts = Ipv6Extensions::default();
                if self.ipv6_extensions {
                    let padding = [1, 4, 0, 0, 0, 0];
                    exts.hop_by_hop_options =
                        Some(Ipv6RawExtHeader::new_raw(IpNumber::TCP, &padding).expect("ext"));
                    exts.destination_options =
                        Some(Ipv6RawExtHeader::new_raw(IpNumber::TCP, &padding).expect("ext"));
                }
                if self.fragment_offset != 0 {
                    exts.fragment = Some(Ipv6FragmentHeader::new(
                        IpNumber::TCP,
                        IpFragOffset::try_new(self.fragment_offset).expect("offset"),
                        true,
                        7,
                    ));
                }
                IpHeaders::Ipv6(header, exts)
            }
            _ => panic!("source and destination of different families"),
        };
        let eth = PacketBuilder::ethernet2(CLIENT_MAC, SERVER_MAC);
        let builder = match self.vlans {
            Vlans::None => eth.ip(ip),
            Vlans::One(id) => eth.single_vlan(VlanId::try_new(id).expect("vlan")).ip(ip),
            Vlans::Two(outer, inner) => eth
                .double_vlan(
                    VlanId::try_new(outer).expect("vlan"),
                    VlanId::try_new(inner).expect("vlan"),
                )
                .ip(ip),
        };
        let builder = builder.tcp_header(tcp);
        let mut frame = Vec::with_capacity(builder.size(self.payload.len()));
        builder
            .write(&mut frame, &self.payload)
            .expect("writing to a Vec");
        frame
    }
}

/// A UDP datagram: traffic the programs must pass as non-TCP.
pub fn udp(src: IpAddr, dst: IpAddr) -> Vec<u8> {
    let builder = match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            PacketBuilder::ethernet2(CLIENT_MAC, SERVER_MAC).ipv4(s.octets(), d.octets(), 64)
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            PacketBuilder::ethernet2(CLIENT_MAC, SERVER_MAC).ipv6(s.octets(), d.octets(), 64)
        }
        _ => panic!("mixed families"),
    }
    .udp(5353, 5353);
    let mut frame = Vec::new();
    builder
        .write(&mut frame, b"hello")
        .expect("writing to a Vec");
    frame
}

/// The protocols a tunnel ending on the host arrives in (IPv4 protocol, IPv6 next header).
pub const IPIP: IpNumber = IpNumber(4);
pub const IPV6_IN_IP: IpNumber = IpNumber(41);
pub const GRE: IpNumber = IpNumber(47);

/// `inner`, an Ethernet frame whose IP packet goes through a tunnel from `src` to `dst`: in
/// IP (`IPIP` for an IPv4 packet, `IPV6_IN_IP` for an IPv6 one) or in GRE (a four-byte GRE
/// header naming the inner packet's EtherType).
pub fn tunnel(src: IpAddr, dst: IpAddr, protocol: IpNumber, inner: &[u8]) -> Vec<u8> {
    let builder = match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            PacketBuilder::ethernet2(CLIENT_MAC, SERVER_MAC).ipv4(s.octets(), d.octets(), 64)
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            PacketBuilder::ethernet2(CLIENT_MAC, SERVER_MAC).ipv6(s.octets(), d.octets(), 64)
        }
        _ => panic!("mixed families"),
    };
    let (ether_type, packet) = (&inner[12..14], &inner[14..]);
    let mut payload = Vec::new();
    if protocol == GRE {
        payload.extend_from_slice(&[0, 0]);
        payload.extend_from_slice(ether_type);
    }
    payload.extend_from_slice(packet);
    let mut frame = Vec::new();
    builder
        .write(&mut frame, protocol, &payload)
        .expect("writing to a Vec");
    frame
}

/// An ARP frame (its body filler): neither IPv4 nor IPv6, nor a type the programs mark with.
pub fn non_ip() -> Vec<u8> {
    let header = Ethernet2Header {
        source: CLIENT_MAC,
        destination: SERVER_MAC,
        ether_type: EtherType::ARP,
    };
    let mut frame = header.to_bytes().to_vec();
    frame.extend_from_slice(&[0xAB; 46]);
    frame
}

/// What an RST reply says, read back by etherparse (not by the code under test).
#[derive(Debug)]
pub struct Reply {
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
    pub vlan_ids: Vec<u16>,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub tcp: TcpHeader,
    pub tcp_payload_len: usize,
    /// Whether the IPv4 header checksum (where there is one) and the TCP checksum verify.
    pub checksums_ok: bool,
}

pub fn parse_reply(frame: &[u8]) -> Reply {
    let sliced = SlicedPacket::from_ethernet(frame).expect("the reply parses");
    let eth = match sliced.link.expect("an Ethernet header") {
        etherparse::LinkSlice::Ethernet2(eth) => eth.to_header(),
        other => panic!("unexpected link {other:?}"),
    };
    let vlan_ids = sliced
        .link_exts
        .iter()
        .filter_map(|e| match e {
            etherparse::LinkExtSlice::Vlan(v) => Some(v.vlan_identifier().value()),
            _ => None,
        })
        .collect();
    let Some(TransportSlice::Tcp(tcp)) = sliced.transport else {
        panic!("the reply is not TCP");
    };
    let header = tcp.to_header();
    let payload = tcp.payload();
    let (src, dst, checksums_ok) = match sliced.net.expect("an IP header") {
        NetSlice::Ipv4(ip) => {
            let h = ip.header().to_header();
            let ip_ok = h.calc_header_checksum() == h.header_checksum;
            let tcp_ok = header.calc_checksum_ipv4(&h, payload).unwrap() == header.checksum;
            (
                IpAddr::from(h.source),
                IpAddr::from(h.destination),
                ip_ok && tcp_ok,
            )
        }
        NetSlice::Ipv6(ip) => {
            let h = ip.header().to_header();
            let tcp_ok = header.calc_checksum_ipv6(&h, payload).unwrap() == header.checksum;
            (IpAddr::from(h.source), IpAddr::from(h.destination), tcp_ok)
        }
        other => panic!("unexpected network layer {other:?}"),
    };
    Reply {
        src_mac: eth.source,
        dst_mac: eth.destination,
        vlan_ids,
        src,
        dst,
        tcp: header,
        tcp_payload_len: payload.len(),
        checksums_ok,
    }
}

//! Frames for `BPF_PROG_TEST_RUN`, built with etherparse so that no test hand-writes headers.

use etherparse::PacketBuilder;

pub const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
pub const SERVER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];

/// A TCP SYN from `src:sport` to `dst:dport` over IPv4.
pub fn syn_v4(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16) -> Vec<u8> {
    let builder = PacketBuilder::ethernet2(CLIENT_MAC, SERVER_MAC)
        .ipv4(src, dst, 64)
        .tcp(sport, dport, 1000, 64240)
        .syn();
    let mut frame = Vec::with_capacity(builder.size(0));
    builder
        .write(&mut frame, &[])
        .expect("writing to a Vec cannot fail");
    frame
}

//! The source key: the one masking rule the kernel charges connections by and the agent
//! looks them up by.

/// A source address masked to its configured prefix. IPv4 addresses are stored IPv4-mapped
/// (`::ffff:a.b.c.d`) so that one set of maps serves both families.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SourceKey {
    /// The masked address, IPv6 byte order; bits beyond the prefix are zero.
    pub addr: [u8; 16],
}

const _: () = assert!(core::mem::size_of::<SourceKey>() == 16);

/// The `::ffff:0:0/96` prefix of an IPv4-mapped address.
pub const V4_MAPPED: [u8; 12] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF];

/// `addr` (IPv6, IPv4 as `::ffff:a.b.c.d`) masked to its family's prefix: an IPv4-mapped
/// address keeps `96 + ipv4_prefix` bits, any other `ipv6_prefix`. Prefixes past the
/// address length count as the full length. Two 64-bit halves, no loop and no panic path,
/// so the verifier accepts it inline.
#[inline(always)]
pub fn source_key(addr: &[u8; 16], ipv4_prefix: u8, ipv6_prefix: u8) -> SourceKey {
    let v4 = addr[..12] == V4_MAPPED;
    let prefix = if v4 {
        96 + u32::from(ipv4_prefix.min(32))
    } else {
        u32::from(ipv6_prefix.min(128))
    };
    let hi = u64::from_be_bytes([
        addr[0], addr[1], addr[2], addr[3], addr[4], addr[5], addr[6], addr[7],
    ]);
    let lo = u64::from_be_bytes([
        addr[8], addr[9], addr[10], addr[11], addr[12], addr[13], addr[14], addr[15],
    ]);
    let hi = hi & mask(prefix);
    let lo = lo & mask(prefix.saturating_sub(64));
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&hi.to_be_bytes());
    out[8..].copy_from_slice(&lo.to_be_bytes());
    SourceKey { addr: out }
}

/// The top `bits` bits of a u64 set (0 to 64; more counts as 64).
#[inline(always)]
fn mask(bits: u32) -> u64 {
    if bits >= 64 {
        u64::MAX
    } else if bits == 0 {
        0
    } else {
        u64::MAX << (64 - bits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(a: [u8; 4]) -> [u8; 16] {
        let mut out = [0u8; 16];
        out[..12].copy_from_slice(&V4_MAPPED);
        out[12..].copy_from_slice(&a);
        out
    }

    #[test]
    fn ipv4_masks_from_bit_96() {
        assert_eq!(
            source_key(&v4([10, 1, 2, 3]), 32, 64).addr,
            v4([10, 1, 2, 3])
        );
        assert_eq!(
            source_key(&v4([10, 1, 2, 3]), 24, 64).addr,
            v4([10, 1, 2, 0])
        );
        assert_eq!(source_key(&v4([10, 1, 2, 3]), 0, 64).addr, v4([0, 0, 0, 0]));
        // Past 32 counts as 32.
        assert_eq!(
            source_key(&v4([10, 1, 2, 3]), 99, 0).addr,
            v4([10, 1, 2, 3])
        );
    }

    #[test]
    fn ipv6_masks_across_both_halves() {
        let addr = [0xFF; 16];
        assert_eq!(source_key(&addr, 32, 128).addr, addr);
        assert_eq!(source_key(&addr, 32, 200).addr, addr);
        assert_eq!(source_key(&addr, 32, 0).addr, [0; 16]);
        let mut want = [0u8; 16];
        want[..8].copy_from_slice(&[0xFF; 8]);
        assert_eq!(source_key(&addr, 32, 64).addr, want);
        want[8] = 0xF0;
        assert_eq!(source_key(&addr, 32, 68).addr, want);
        let mut want = [0u8; 16];
        want[0] = 0xFE;
        assert_eq!(source_key(&addr, 32, 7).addr, want);
    }
}

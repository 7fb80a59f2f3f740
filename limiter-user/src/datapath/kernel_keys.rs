//! How the agent names what the kernel keys: addresses as IPv4-mapped IPv6, sources masked to
//! their prefix, and the boot-time clock the programs stamp with. The masking itself is
//! `limiter-common`'s, shared with the kernel, so both sides always agree on a source's key.

use std::net::{IpAddr, Ipv6Addr};

use limiter_common::{Config, SourceKey};

use super::MapsError;

/// An address as the kernel keys it: IPv4 as IPv4-mapped IPv6.
pub fn mapped(addr: IpAddr) -> Ipv6Addr {
    match addr {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

/// The key the kernel charges `addr` to: mapped to IPv6 and masked to the live prefix.
pub fn source_key(addr: IpAddr, config: &Config) -> SourceKey {
    // `::ffff:a.b.c.d` is the IPv4 client it maps, and takes the IPv4 prefix.
    limiter_common::source_key(
        &mapped(addr.to_canonical()).octets(),
        config.ipv4_prefix,
        config.ipv6_prefix,
    )
}

/// A source key as an address, IPv4-mapped keys shown as plain IPv4.
pub fn key_address(key: &SourceKey) -> IpAddr {
    let v6 = Ipv6Addr::from(key.addr);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

/// A source key as operators read it: the address, with its prefix length when the key stands
/// for more than one address (`fd00:77::/64`), so a masked key never reads as one host.
pub fn key_text(key: &SourceKey, config: &Config) -> String {
    let addr = key_address(key);
    let (prefix, full) = match addr {
        IpAddr::V4(_) => (config.ipv4_prefix, 32),
        IpAddr::V6(_) => (config.ipv6_prefix, 128),
    };
    if prefix >= full {
        addr.to_string()
    } else {
        format!("{addr}/{prefix}")
    }
}

/// `CLOCK_BOOTTIME` in nanoseconds, the clock the kernel programs stamp flows and bans with.
pub fn boot_time_ns() -> Result<u64, MapsError> {
    clock_ns(libc::CLOCK_BOOTTIME)
}

/// A fresh secret for [`limiter_common::bucket_place`], never 0 (the mark of a config that
/// has none yet).
pub fn bucket_seed() -> Result<u64, MapsError> {
    let mut seed = [0u8; 8];
    // SAFETY: `seed` is a valid buffer of the length passed for the call's duration.
    let read = unsafe { libc::getrandom(seed.as_mut_ptr().cast(), seed.len(), 0) };
    if read != seed.len() as isize {
        return Err(MapsError::Random(std::io::Error::last_os_error()));
    }
    Ok(u64::from_ne_bytes(seed) | 1)
}

fn clock_ns(clock: libc::clockid_t) -> Result<u64, MapsError> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer for the call's duration.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return Err(MapsError::Clock(std::io::Error::last_os_error()));
    }
    Ok(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_keys_mask_to_the_prefix() {
        let mut config = Config::UNCONFIGURED;
        config.ipv4_prefix = 24;
        config.ipv6_prefix = 64;
        let k = source_key("10.1.2.3".parse().unwrap(), &config);
        assert_eq!(key_address(&k).to_string(), "10.1.2.0");
        let k = source_key("::ffff:10.1.2.3".parse().unwrap(), &config);
        assert_eq!(key_address(&k).to_string(), "10.1.2.0");
        let k = source_key("2001:db8:1:2:3:4:5:6".parse().unwrap(), &config);
        assert_eq!(key_address(&k).to_string(), "2001:db8:1:2::");
        config.ipv6_prefix = 0;
        let k = source_key("2001:db8::1".parse().unwrap(), &config);
        assert_eq!(k.addr, [0; 16]);
    }

    #[test]
    fn a_key_wider_than_one_address_shows_its_prefix() {
        let mut config = Config::UNCONFIGURED;
        config.ipv4_prefix = 32;
        config.ipv6_prefix = 64;
        let k = source_key("fd00:77::5".parse().unwrap(), &config);
        assert_eq!(key_text(&k, &config), "fd00:77::/64");
        let k = source_key("10.1.2.3".parse().unwrap(), &config);
        assert_eq!(key_text(&k, &config), "10.1.2.3");
        config.ipv4_prefix = 24;
        let k = source_key("10.1.2.3".parse().unwrap(), &config);
        assert_eq!(key_text(&k, &config), "10.1.2.0/24");
    }
}

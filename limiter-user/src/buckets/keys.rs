//! Turning a key as the broker sends it into the bytes a bucket is stored under, and back into
//! something an operator can read.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use limiter_client::MAX_KEY_LEN;
use sha2::{Digest, Sha256};

use super::actions::KeyKind;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("the key is empty")]
    Empty,
    #[error("the key is {0} bytes, more than the {MAX_KEY_LEN} allowed")]
    TooLong(usize),
    #[error("the action is keyed by address and {0:?} is not an IP address")]
    NotAnAddress(String),
}

/// A stored key without a heap allocation for the common cases, so a check on a key that is
/// already tracked allocates nothing.
pub enum StoredKey<'a> {
    Inline { bytes: [u8; 32], len: u8 },
    Borrowed(&'a [u8]),
}

impl StoredKey<'_> {
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            StoredKey::Inline { bytes, len } => &bytes[..usize::from(*len)],
            StoredKey::Borrowed(bytes) => bytes,
        }
    }

    /// The address an ip-kind key stands for.
    pub fn address(&self) -> Option<IpAddr> {
        address_of(self.as_bytes())
    }
}

pub fn store(kind: KeyKind, raw: &[u8]) -> Result<StoredKey<'_>, KeyError> {
    if raw.is_empty() {
        return Err(KeyError::Empty);
    }
    if raw.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong(raw.len()));
    }
    match kind {
        KeyKind::Ip => {
            let text = std::str::from_utf8(raw)
                .map_err(|_| KeyError::NotAnAddress(String::from_utf8_lossy(raw).into_owned()))?;
            // No trimming: " 10.0.0.1" is refused rather than silently read as another key.
            let addr: IpAddr = text
                .parse()
                .map_err(|_| KeyError::NotAnAddress(text.to_owned()))?;
            Ok(address_key(addr))
        }
        KeyKind::Session => {
            // Only the digest is kept: a token in memory or in /rate_limits is a credential.
            let mut bytes = [0u8; 32];
            bytes.copy_from_slice(&Sha256::digest(raw));
            Ok(StoredKey::Inline { bytes, len: 32 })
        }
        KeyKind::User | KeyKind::Other => Ok(StoredKey::Borrowed(raw)),
    }
}

/// Canonical form: an IPv4-mapped IPv6 address is the IPv4 address it maps.
pub fn address_key(addr: IpAddr) -> StoredKey<'static> {
    let mut bytes = [0u8; 32];
    match addr.to_canonical() {
        IpAddr::V4(v4) => {
            bytes[..4].copy_from_slice(&v4.octets());
            StoredKey::Inline { bytes, len: 4 }
        }
        IpAddr::V6(v6) => {
            bytes[..16].copy_from_slice(&v6.octets());
            StoredKey::Inline { bytes, len: 16 }
        }
    }
}

fn address_of(bytes: &[u8]) -> Option<IpAddr> {
    match bytes.len() {
        4 => <[u8; 4]>::try_from(bytes)
            .ok()
            .map(|b| IpAddr::V4(Ipv4Addr::from(b))),
        16 => <[u8; 16]>::try_from(bytes)
            .ok()
            .map(|b| IpAddr::V6(Ipv6Addr::from(b))),
        _ => None,
    }
}

/// How a stored key is shown: the address, `sha256:` and the digest in hex, or the text.
pub fn display(kind: KeyKind, stored: &[u8]) -> String {
    match kind {
        KeyKind::Ip => address_of(stored).map_or_else(|| hex(stored), |a| a.to_string()),
        KeyKind::Session => format!("sha256:{}", hex(stored)),
        KeyKind::User | KeyKind::Other => String::from_utf8_lossy(stored).into_owned(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_canonical() {
        let mapped = store(KeyKind::Ip, b"::ffff:10.0.0.1").unwrap();
        let plain = store(KeyKind::Ip, b"10.0.0.1").unwrap();
        assert_eq!(mapped.as_bytes(), plain.as_bytes());
        assert_eq!(display(KeyKind::Ip, plain.as_bytes()), "10.0.0.1");
        let v6 = store(KeyKind::Ip, b"2001:DB8::1").unwrap();
        assert_eq!(display(KeyKind::Ip, v6.as_bytes()), "2001:db8::1");
        assert_eq!(
            store(KeyKind::Ip, b"10.0.0").err(),
            Some(KeyError::NotAnAddress("10.0.0".into()))
        );
        assert_eq!(
            store(KeyKind::Ip, b" 10.0.0.1\n").err(),
            Some(KeyError::NotAnAddress(" 10.0.0.1\n".into()))
        );
    }

    #[test]
    fn session_tokens_are_never_kept_in_clear() {
        let stored = store(KeyKind::Session, b"secret-token").unwrap();
        let shown = display(KeyKind::Session, stored.as_bytes());
        assert!(!shown.contains("secret"));
        assert_eq!(
            shown,
            "sha256:930bbdc51b6aed5c2a5678fd6e28dee7a05e8a4b643cfc0b4427c3efb86c0d94"
        );
        assert_ne!(
            stored.as_bytes(),
            store(KeyKind::Session, b"secret-tokem").unwrap().as_bytes()
        );
    }

    #[test]
    fn empty_and_oversized_keys_are_refused() {
        assert_eq!(store(KeyKind::User, b"").err(), Some(KeyError::Empty));
        let long = vec![b'a'; MAX_KEY_LEN + 1];
        assert_eq!(
            store(KeyKind::User, &long).err(),
            Some(KeyError::TooLong(MAX_KEY_LEN + 1))
        );
    }
}

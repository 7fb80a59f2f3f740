//! What an action's keys identify (`KeyKind`), and turning a key as the broker sends it into
//! the bytes a bucket is stored under, and back into something an operator can read.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use limiter_client::{MAX_KEY_LEN, USER_TOPIC_SEPARATOR};
use serde::{Deserialize, Deserializer, Serialize, de};
use sha2::{Digest, Sha256};

/// What an action's keys identify. It decides how a key is checked and stored: addresses are
/// parsed and stored in canonical form (so `::ffff:10.0.0.1` and `10.0.0.1` share a bucket),
/// session tokens are stored and shown only as a SHA-256 digest, a `user+topic` key by its
/// user and its topic's first levels, anything else as given. Read and shown as its name
/// (`ip`, ..., `user+topic`); a `user+topic` kind's levels come from `topic-levels`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyKind {
    Ip,
    Session,
    User,
    Other,
    /// A connection as the broker names it (an MQTT client id): the key strikes close, and
    /// one the broker releases when the connection is gone (`connection-gone`).
    Connection,
    /// A user and the topic it publishes to (`limiter_client::user_topic_key`), named by the
    /// topic's first `levels` levels: one bucket per user and topic subtree. The levels are
    /// part of the kind, so a reload that changes them starts with empty buckets, as any
    /// change of what a key means does.
    UserTopic {
        levels: u8,
    },
}

/// `topic-levels` when an action keyed by `user+topic` does not say.
pub const DEFAULT_TOPIC_LEVELS: u8 = 1;
/// The most `topic-levels` may be: deeper than any topic tree a limit is set on needs.
pub const MAX_TOPIC_LEVELS: u8 = 32;

impl KeyKind {
    /// The kind as configured and shown (`ip`, `session`, `user`, `other`, `connection`,
    /// `user+topic`).
    pub fn as_str(self) -> &'static str {
        match self {
            KeyKind::Ip => "ip",
            KeyKind::Session => "session",
            KeyKind::User => "user",
            KeyKind::Other => "other",
            KeyKind::Connection => "connection",
            KeyKind::UserTopic { .. } => "user+topic",
        }
    }

    /// The kind named `name` as configured; `user+topic` with [`DEFAULT_TOPIC_LEVELS`].
    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "ip" => KeyKind::Ip,
            "session" => KeyKind::Session,
            "user" => KeyKind::User,
            "other" => KeyKind::Other,
            "connection" => KeyKind::Connection,
            "user+topic" => KeyKind::UserTopic {
                levels: DEFAULT_TOPIC_LEVELS,
            },
            _ => return None,
        })
    }
}

impl Serialize for KeyKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for KeyKind {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        KeyKind::from_name(&name).ok_or_else(|| {
            de::Error::custom(format!(
                "unknown key kind {name:?} (ip, session, user, other, connection, user+topic)"
            ))
        })
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("the key is empty")]
    Empty,
    #[error("the key is {0} bytes, more than the {MAX_KEY_LEN} allowed")]
    TooLong(usize),
    #[error("the action is keyed by address and {0:?} is not an IP address")]
    NotAnAddress(String),
    /// A `user+topic` key that is not a user, a NUL and a concrete topic.
    #[error("the action is keyed by user+topic and the key {0}")]
    NotUserTopic(&'static str),
}

/// A key as a bucket is stored under: fixed-size, so a tracked key costs the same memory
/// however long the broker's key was, and no check allocates. Addresses are kept as their
/// octets, session tokens always as a SHA-256 digest (a token is a credential), other keys as
/// given up to 32 bytes and as a SHA-256 digest beyond (the length byte tells them apart, so
/// a short key never collides with a digest).
///
/// The bytes are held as four little-endian words, built in registers from the broker's key:
/// a check then stores, hashes and compares whole words, never reading back a word it wrote
/// byte by byte (which stalls the CPU's store forwarding, a third of a hot check's time).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct StoredKey {
    /// 0..=32: that many bytes of `words` are the key; [`DIGEST`]: `words` is a SHA-256.
    len: u8,
    /// The bytes, eight to a word in little-endian order; zero past the key.
    words: [u64; 4],
}

/// The length byte of a digested key.
const DIGEST: u8 = u8::MAX;

/// Hashes the length and the words that hold the key, not the padding: a short key (an
/// address, a user name) costs one or two words. Equal keys have equal words, so this
/// agrees with `Eq`.
impl std::hash::Hash for StoredKey {
    #[inline]
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u8(self.len);
        for word in &self.words[..self.used_words()] {
            state.write_u64(*word);
        }
    }
}

/// Up to 8 bytes as a little-endian word, with a fixed number of loads whatever the length.
#[inline(always)]
fn word(b: &[u8]) -> u64 {
    let n = b.len();
    match n {
        0 => 0,
        1..=3 => {
            u64::from(b[0])
                | u64::from(b[n / 2]) << (8 * (n / 2))
                | u64::from(b[n - 1]) << (8 * (n - 1))
        }
        4..=7 => {
            let low = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            let high = u32::from_le_bytes([b[n - 4], b[n - 3], b[n - 2], b[n - 1]]);
            // The two halves overlap on equal bytes, so or-ing them is exact.
            u64::from(low) | u64::from(high) << (8 * (n - 4))
        }
        _ => u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
    }
}

/// A stored key's bytes, for showing it.
pub struct KeyBytes {
    bytes: [u8; 32],
    len: usize,
}

impl std::ops::Deref for KeyBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

impl StoredKey {
    #[inline(always)]
    fn raw(raw: &[u8]) -> Self {
        let n = raw.len();
        let part = |i: usize| word(&raw[(8 * i).min(n)..(8 * i + 8).min(n)]);
        Self {
            len: n as u8,
            words: [part(0), part(1), part(2), part(3)],
        }
    }

    fn digest(raw: &[u8]) -> Self {
        let digest: [u8; 32] = Sha256::digest(raw).into();
        Self {
            len: DIGEST,
            words: std::array::from_fn(|i| word(&digest[8 * i..8 * i + 8])),
        }
    }

    #[inline]
    fn used_words(&self) -> usize {
        match self.len {
            DIGEST => 4,
            len => usize::from(len).div_ceil(8),
        }
    }

    pub fn bytes(&self) -> KeyBytes {
        let mut bytes = [0u8; 32];
        for (chunk, word) in bytes.chunks_exact_mut(8).zip(self.words) {
            chunk.copy_from_slice(&word.to_le_bytes());
        }
        let len = match self.len {
            DIGEST => 32,
            len => usize::from(len),
        };
        KeyBytes { bytes, len }
    }

    pub fn is_digest(&self) -> bool {
        self.len == DIGEST
    }

    /// The address an ip-kind key stands for.
    pub fn address(&self) -> Option<IpAddr> {
        if self.is_digest() {
            return None;
        }
        address_of(&self.bytes())
    }
}

/// Inlined into the check, so the key stays in registers rather than being returned
/// through memory.
#[inline(always)]
pub fn store(kind: KeyKind, raw: &[u8]) -> Result<StoredKey, KeyError> {
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
        // Only the digest is kept: a token in memory or in /rate_limits is a credential.
        KeyKind::Session => Ok(StoredKey::digest(raw)),
        KeyKind::UserTopic { levels } => Ok(as_given(user_topic_prefix(raw, levels)?)),
        KeyKind::User | KeyKind::Other | KeyKind::Connection => Ok(as_given(raw)),
    }
}

/// A key kept as given: itself up to 32 bytes, its digest beyond.
#[inline(always)]
fn as_given(raw: &[u8]) -> StoredKey {
    if raw.len() <= 32 {
        StoredKey::raw(raw)
    } else {
        StoredKey::digest(raw)
    }
}

/// What names a `user+topic` key's bucket: the user, the separator and the topic's first
/// `levels` levels, a prefix of the key (`alice\0a/b/c` with 2 levels: `alice\0a/b`). The key
/// must be a non-empty user, a NUL and a concrete topic (no second NUL, no wildcard), as
/// `limiter_client::user_topic_key` makes it; a topic with fewer levels is kept whole.
pub fn user_topic_prefix(raw: &[u8], levels: u8) -> Result<&[u8], KeyError> {
    let Some(split) = raw.iter().position(|b| *b == USER_TOPIC_SEPARATOR) else {
        return Err(KeyError::NotUserTopic(
            "has no NUL between the user and the topic",
        ));
    };
    if split == 0 {
        return Err(KeyError::NotUserTopic("has an empty user"));
    }
    let topic = &raw[split + 1..];
    if topic.is_empty() {
        return Err(KeyError::NotUserTopic("has an empty topic"));
    }
    if topic.iter().any(|b| matches!(b, b'+' | b'#' | 0)) {
        return Err(KeyError::NotUserTopic(
            "has a wildcard (+ or #) or a second NUL in its topic",
        ));
    }
    let kept = topic
        .iter()
        .enumerate()
        .filter(|(_, b)| **b == b'/')
        .nth(usize::from(levels).saturating_sub(1))
        .map_or(topic.len(), |(at, _)| at);
    Ok(&raw[..split + 1 + kept])
}

/// Canonical form: an IPv4-mapped IPv6 address is the IPv4 address it maps.
pub fn address_key(addr: IpAddr) -> StoredKey {
    match addr.to_canonical() {
        IpAddr::V4(v4) => StoredKey::raw(&v4.octets()),
        IpAddr::V6(v6) => StoredKey::raw(&v6.octets()),
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
pub fn display(kind: KeyKind, stored: &StoredKey) -> String {
    if stored.is_digest() {
        return format!("sha256:{}", hex(&stored.bytes()));
    }
    match kind {
        KeyKind::Ip => stored
            .address()
            .map_or_else(|| hex(&stored.bytes()), |a| a.to_string()),
        // A user+topic key keeps its NUL: JSON shows it as \u0000, as an override's key in
        // the config file is written.
        KeyKind::Session
        | KeyKind::User
        | KeyKind::Other
        | KeyKind::Connection
        | KeyKind::UserTopic { .. } => String::from_utf8_lossy(&stored.bytes()).into_owned(),
    }
}

/// How a stored key is named in the fleet's shared store: the same on every agent (addresses
/// canonical, tokens and long keys as their digest), readable where it can be, and never
/// containing `{` or `}`, which would move the key's hash tag and with it its cluster slot.
/// Other bytes, and text that could pass for an encoded key, go as `hex:` and the hex.
pub fn shared_name(kind: KeyKind, stored: &StoredKey) -> Vec<u8> {
    let bytes = stored.bytes();
    let bytes = &bytes[..];
    let plain = !stored.is_digest()
        && kind != KeyKind::Ip
        && bytes
            .iter()
            .all(|b| b.is_ascii_graphic() && *b != b'{' && *b != b'}')
        && !bytes.starts_with(b"hex:")
        && !bytes.starts_with(b"sha256:");
    if plain {
        return bytes.to_vec();
    }
    if kind == KeyKind::Ip || stored.is_digest() {
        return display(kind, stored).into_bytes();
    }
    format!("hex:{}", hex(bytes)).into_bytes()
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
        assert_eq!(*mapped.bytes(), *plain.bytes());
        assert_eq!(display(KeyKind::Ip, &plain), "10.0.0.1");
        let v6 = store(KeyKind::Ip, b"2001:DB8::1").unwrap();
        assert_eq!(display(KeyKind::Ip, &v6), "2001:db8::1");
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
        let shown = display(KeyKind::Session, &stored);
        assert!(!shown.contains("secret"));
        assert_eq!(
            shown,
            "sha256:930bbdc51b6aed5c2a5678fd6e28dee7a05e8a4b643cfc0b4427c3efb86c0d94"
        );
        assert_ne!(
            *stored.bytes(),
            *store(KeyKind::Session, b"secret-tokem").unwrap().bytes()
        );
    }

    #[test]
    fn every_key_takes_the_same_fixed_memory() {
        assert_eq!(std::mem::size_of::<StoredKey>(), 40);
        let short = store(KeyKind::User, b"alice").unwrap();
        assert_eq!(display(KeyKind::User, &short), "alice");
        let long = vec![b'k'; 1024];
        let digested = store(KeyKind::User, &long).unwrap();
        assert!(display(KeyKind::User, &digested).starts_with("sha256:"));
        // A 32-byte key that happens to equal a digest is still another key.
        let lookalike = store(KeyKind::User, &digested.bytes()).unwrap();
        assert_ne!(lookalike, digested);
    }

    #[test]
    fn every_length_round_trips_and_keys_differing_in_any_byte_differ() {
        for n in 1..=32u8 {
            let key: Vec<u8> = (1..=n).map(|b| b.wrapping_mul(37)).collect();
            let stored = store(KeyKind::Other, &key).unwrap();
            assert_eq!(*stored.bytes(), key[..], "length {n}");
            for at in 0..key.len() {
                let mut other = key.clone();
                other[at] ^= 0x80;
                assert_ne!(
                    store(KeyKind::Other, &other).unwrap(),
                    stored,
                    "{n} at {at}"
                );
            }
            let longer = [&key[..], &[0]].concat();
            if longer.len() <= 32 {
                assert_ne!(store(KeyKind::Other, &longer).unwrap(), stored, "{n} + NUL");
            }
        }
    }

    #[test]
    fn shared_names_are_canonical_and_keep_the_hash_tag_whole() {
        let name = |kind, raw: &[u8]| shared_name(kind, &store(kind, raw).unwrap());
        assert_eq!(name(KeyKind::Ip, b"::ffff:10.0.0.1"), b"10.0.0.1");
        assert_eq!(name(KeyKind::User, b"alice"), b"alice");
        assert_eq!(name(KeyKind::User, b"a}b"), b"hex:617d62");
        assert_eq!(name(KeyKind::User, b"a b"), b"hex:612062");
        assert_eq!(name(KeyKind::User, b"hex:00"), b"hex:6865783a3030");
        assert!(name(KeyKind::Session, b"tok").starts_with(b"sha256:"));
        assert!(name(KeyKind::Other, &[b'k'; 40]).starts_with(b"sha256:"));
    }

    #[test]
    fn a_user_topic_key_is_named_by_the_user_and_the_topics_first_levels() {
        fn prefix(raw: &[u8], levels: u8) -> &[u8] {
            user_topic_prefix(raw, levels).unwrap()
        }
        assert_eq!(prefix(b"alice\0a/b/c", 2), b"alice\0a/b");
        assert_eq!(prefix(b"alice\0a/b/c", 1), b"alice\0a");
        assert_eq!(prefix(b"alice\0a/b/c", 3), b"alice\0a/b/c");
        assert_eq!(prefix(b"alice\0a/b/c", 32), b"alice\0a/b/c");
        assert_eq!(prefix(b"alice\0a", 2), b"alice\0a");
        // Empty levels are levels: `/x` starts with an empty one, `a//b` has one inside.
        assert_eq!(prefix(b"alice\0/x/y", 1), b"alice\0");
        assert_eq!(prefix(b"alice\0/x/y", 2), b"alice\0/x");
        assert_eq!(prefix(b"alice\0a//b", 2), b"alice\0a/");
        assert_eq!(prefix(b"alice\0a/", 2), b"alice\0a/");
        // What the client makes is what the agent reads.
        let made = limiter_client::user_topic_key("bob", "room/a/x").unwrap();
        assert_eq!(prefix(&made, 2), b"bob\0room/a");

        let two = KeyKind::UserTopic { levels: 2 };
        let stored = |raw: &[u8]| store(two, raw).unwrap();
        // Topics under one subtree share a bucket; another subtree, or another user, does not.
        assert_eq!(stored(b"bob\0room/a/x"), stored(b"bob\0room/a/y"));
        assert_ne!(stored(b"bob\0room/a/x"), stored(b"bob\0room/b/x"));
        assert_ne!(stored(b"bob\0room/a/x"), stored(b"carol\0room/a/x"));
        // No user's name can run into a topic: the NUL is kept in the stored key.
        assert_ne!(stored(b"bo\0broom/a"), stored(b"bob\0room/a"));
        assert_eq!(display(two, &stored(b"bob\0room/a/x")), "bob\0room/a");
        assert_eq!(
            shared_name(two, &stored(b"bob\0room/a/x")),
            b"hex:626f6200726f6f6d2f61"
        );
        // Long subtrees are digested like any long key, after the cut.
        let subtree = [b"u\0".as_slice(), &[b'l'; 40], b"/x"].concat();
        let long = [&subtree[..], b"/tail"].concat();
        assert!(stored(&long).is_digest());
        assert_eq!(stored(&long), stored(&subtree));
    }

    #[test]
    fn what_is_not_a_user_and_a_concrete_topic_is_refused() {
        let two = KeyKind::UserTopic { levels: 2 };
        for (raw, why) in [
            (b"alice".as_slice(), "no NUL"),
            (b"\0a/b", "empty user"),
            (b"alice\0", "empty topic"),
            (b"alice\0a/+/c", "wildcard"),
            (b"alice\0a/#", "wildcard"),
            (b"alice\0a\0b", "second NUL"),
        ] {
            let err = store(two, raw).unwrap_err();
            assert!(matches!(err, KeyError::NotUserTopic(_)), "{why}: {err}");
            assert!(err.to_string().contains(why), "{why}: {err}");
        }
        // The wire's bound holds before anything is cut.
        let long = [b"u\0".as_slice(), &[b'a'; MAX_KEY_LEN]].concat();
        assert_eq!(
            store(two, &long).err(),
            Some(KeyError::TooLong(MAX_KEY_LEN + 2))
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

//! Port profiles: groups of protected ports held to limits of their own, each with its own
//! counts, so that a source's connections to one group (a broker's MQTT listeners) never spend
//! its allowance in another (its dashboard). A profile is a slot: 0 is the top level (every
//! protected port no profile names), 1 to [`MAX_PROFILES`] the operator's `[profiles.NAME]`.
//! A port's slot is its `PORTS` byte less one; a connection records the slot it was counted
//! in, and a source's count, its SYN bucket, the global count and the connection rate are kept
//! per slot.

use crate::{Refusal, SourceKey, gcra_terms, stats::Reason};

/// Profile slots, the top level's included: the size of every per-profile array.
pub const PROFILE_SLOTS: u32 = 16;

/// The most `[profiles.NAME]` an operator may define.
pub const MAX_PROFILES: usize = PROFILE_SLOTS as usize - 1;

/// Bytes of a profile's name as `PROFILES` keeps it.
pub const PROFILE_NAME_BYTES: usize = 32;

/// What the connections to a group of ports are held to: the top level's (in `Config`) or a
/// profile's (in `PROFILES`). The agent writes every field resolved, a profile that leaves one
/// out carrying the top level's value, so the programs never merge two.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Concurrent connections per source key; 0 = no limit.
    pub max_conn_per_ip: u32,
    /// Concurrent connections in all; 0 = no limit.
    pub max_conn_total: u32,
    /// New connections per second per source key; 0 = no limit.
    pub syn_rate: u32,
    /// Connections a source may open back to back before the rate applies.
    pub syn_burst: u32,
    /// New connections per second from all sources together (a reconnect storm after an
    /// outage); 0 = no limit. Charged at the proven handshake, so spoofed SYNs spend none.
    pub conn_rate: u32,
    /// Connections admitted back to back before `conn_rate` applies.
    pub conn_burst: u32,
    /// The SYN rate's emission interval in nanoseconds (0: not limited), derived from
    /// `syn_rate` by [`Limits::derive_rate_terms`].
    pub syn_interval_ns: u64,
    /// The SYN rate's burst tolerance in nanoseconds (the interval times `syn_burst`).
    pub syn_tolerance_ns: u64,
    /// The connection rate's emission interval in nanoseconds (0: not limited).
    pub conn_interval_ns: u64,
    /// The connection rate's burst tolerance in nanoseconds.
    pub conn_tolerance_ns: u64,
    /// [`Refusal`] for the connection caps and a full flow table (fail-closed), as `u8` so
    /// that any byte the agent writes is valid.
    pub reject_conn: u8,
    /// [`Refusal`] for the SYN rate and the connection rate.
    pub reject_rate: u8,
    /// Non-zero: monitor mode (`mode = "monitor"`), the dry run. Every packet is judged as in
    /// enforce mode, but what the source and rate policy would refuse (the caps, the rates,
    /// bans, the deny list, a full flow table) passes, counted as
    /// [`Verdict::WouldRefuse`](crate::Verdict::WouldRefuse) with the reason. Frames that
    /// cannot be judged (fragments, cut-short or malformed headers, a bad checksum, a martian
    /// source, a forged cookie) are refused as ever: they are not policy an operator tries
    /// out, and passing them would open what they close.
    pub monitor: u8,
    /// Explicit padding, always zero.
    pub _pad: [u8; 5],
}

const _: () = assert!(core::mem::size_of::<Limits>() == 64);

impl Limits {
    /// No limit at all: what the programs hold ports to before the agent writes a config, and
    /// what a slot no profile holds any more gives its last connections.
    pub const UNLIMITED: Limits = Limits {
        max_conn_per_ip: 0,
        max_conn_total: 0,
        syn_rate: 0,
        syn_burst: 0,
        conn_rate: 0,
        conn_burst: 0,
        syn_interval_ns: 0,
        syn_tolerance_ns: 0,
        conn_interval_ns: 0,
        conn_tolerance_ns: 0,
        reject_conn: Refusal::Rst as u8,
        reject_rate: Refusal::Drop as u8,
        monitor: 0,
        _pad: [0; 5],
    };

    /// Sets the GCRA terms the programs meter SYNs and connections with from the rates and
    /// bursts (at least one of burst), as whoever writes limits must before writing them: the
    /// programs would otherwise divide by a rate on every SYN.
    pub fn derive_rate_terms(&mut self) {
        (self.syn_interval_ns, self.syn_tolerance_ns) = gcra_terms(self.syn_rate, self.syn_burst);
        (self.conn_interval_ns, self.conn_tolerance_ns) =
            gcra_terms(self.conn_rate, self.conn_burst);
    }
}

/// A profile as `PROFILES` holds it: its limits, and the name the agent gave it, so that an
/// agent starting on pinned maps finds each profile in the slot its connections count in.
/// An all-zero name marks a slot no profile holds.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Profile {
    /// What the profile's ports are held to.
    pub limits: Limits,
    /// UTF-8, zero-padded.
    pub name: [u8; PROFILE_NAME_BYTES],
}

const _: () = assert!(core::mem::size_of::<Profile>() == 96);

impl Profile {
    /// The slot no profile holds.
    pub const EMPTY: Profile = Profile {
        limits: Limits::UNLIMITED,
        name: [0; PROFILE_NAME_BYTES],
    };
}

/// A source's connections in one profile: the key its count is kept under in
/// `SOURCE_CONNS`, and what its SYN bucket's place is a hash of. Eight-byte aligned, its two
/// half-words first: the programs build it on the stack, alone and inside a [`crate::Flow`]
/// or [`crate::HalfOpen`], where LLVM joins neighbouring stores into words, and every
/// verifier refuses a misaligned stack access.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProfileSource {
    /// The profile slot. First, with the padding: a word at an eight-byte offset of every
    /// struct that holds the key, so the stores LLVM joins stay aligned.
    pub profile: u32,
    /// Explicit padding, always zero: a key's every byte is hashed.
    pub _pad: u32,
    /// The source key, masked as every key is.
    pub source: SourceKey,
}

const _: () = assert!(core::mem::size_of::<ProfileSource>() == 24);

impl ProfileSource {
    /// `source` counted in `profile`.
    #[inline(always)]
    pub const fn new(source: SourceKey, profile: u32) -> Self {
        Self {
            source,
            profile,
            _pad: 0,
        }
    }
}

/// Slots of `REFUSED_CONNS`: per profile, the refused connection attempts by refusal reason,
/// then the packets monitor mode would have refused by the same reasons.
pub const REFUSAL_SLOTS: u32 = PROFILE_SLOTS * 2 * Reason::REFUSAL_COUNT as u32;

/// The `REFUSED_CONNS` slot of a refusal `reason` in `profile`: refused connection attempts,
/// or with `would` the packets monitor mode let through. `None` for a reason that is no
/// refusal of a source or for a slot past the profiles.
#[inline(always)]
pub fn refusal_slot(profile: u32, would: bool, reason: Reason) -> Option<u32> {
    let index = reason.blocked_slot()? as u32;
    (profile < PROFILE_SLOTS)
        .then(|| (profile * 2 + u32::from(would)) * Reason::REFUSAL_COUNT as u32 + index)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_slots_are_distinct_and_in_range() {
        let mut seen = [false; REFUSAL_SLOTS as usize];
        for profile in 0..PROFILE_SLOTS {
            for would in [false, true] {
                for reason in Reason::ALL {
                    if let Some(slot) = refusal_slot(profile, would, reason) {
                        assert!(!seen[slot as usize], "slot {slot} twice");
                        seen[slot as usize] = true;
                    }
                }
            }
        }
        assert!(seen.iter().all(|s| *s));
        assert_eq!(refusal_slot(PROFILE_SLOTS, false, Reason::ConnPerIp), None);
        assert_eq!(refusal_slot(0, false, Reason::Admitted), None);
    }
}

//! What to do with a packet: allow and deny lists, bans, the SYN-rate bucket, the connection
//! caps, and flow tracking from SYN to close.
//!
//! Counters are exact under concurrency: a slot is taken with an atomic add, checked against
//! the cap, and rolled back if over, so racing CPUs can never admit past a cap; a slot is given
//! back only by whoever succeeded in deleting the flow from `FLOWS`, so it is released once.

use aya_ebpf::maps::lpm_trie::Key;
use limiter_common::{
    Blocked, Config, Direction, Event, Flow, FlowKey, LAST_SEEN_GRANULARITY_NS, Reason, Refusal,
    SourceKey, SynBucket, Verdict, flow_state, stats::stat_slot,
};

use crate::{
    atomics,
    maps::{self, BANS, BLOCKED, EVENTS, FLOWS, GLOBAL_CONNS, SOURCE_CONNS, STATS, SYN_BUCKETS},
    parsing::{Segment, TCP_ACK, TCP_FIN, TCP_RST},
};

/// What the entry point does with the packet.
pub enum Action {
    Pass,
    Drop,
    /// Answer the SYN with RST|ACK.
    Rst(Segment),
}

#[inline(always)]
fn count(direction: Direction, verdict: Verdict, reason: Reason) {
    maps::bump(&STATS, stat_slot(direction, verdict, reason));
}

#[inline(always)]
fn event(event: Event) {
    maps::bump(&EVENTS, event as u32);
}

/// Counts a packet passed for `reason` (parse failures, unprotected ports and the like).
#[inline(always)]
pub fn pass(direction: Direction, reason: Reason) -> Action {
    count(direction, Verdict::Pass, reason);
    Action::Pass
}

/// Refuses an ingress packet. Only a SYN gets an RST: a reset in the middle of a flow would
/// need the flow's sequence numbers, so other refused packets are dropped.
#[inline(always)]
fn refuse(seg: &Segment, source: &SourceKey, reason: Reason, mode: u8) -> Action {
    if let (Some(slot), Some(blocked)) = (
        reason.blocked_slot(),
        maps::lru_get_or_insert(&BLOCKED, source, &Blocked::default()),
    ) {
        // SAFETY: pointer from a successful lookup; the slot index is below REFUSAL_COUNT.
        atomics::fetch_add(unsafe { &mut (*blocked).counts[slot] }, 1);
    }
    if Refusal::from_u8(mode) == Refusal::Rst && seg.is_syn() {
        count(Direction::Ingress, Verdict::Rst, reason);
        Action::Rst(*seg)
    } else {
        count(Direction::Ingress, Verdict::Drop, reason);
        Action::Drop
    }
}

/// Policy for a packet arriving at the host (XDP).
#[inline(always)]
pub fn ingress(seg: &Segment, now: u64) -> Action {
    let config = maps::config();
    if !protected(&config, seg.dport) {
        return pass(Direction::Ingress, Reason::UnprotectedPort);
    }
    if config.has_allow != 0 && listed(seg, true) {
        return pass(Direction::Ingress, Reason::Allowlisted);
    }
    let source = source_key(&seg.src, &config);
    if config.has_deny != 0 && listed(seg, false) {
        return refuse(seg, &source, Reason::Denylisted, config.reject_deny);
    }
    if banned(&source, now) {
        return refuse(seg, &source, Reason::Banned, config.reject_ban);
    }
    let key = FlowKey {
        remote: seg.src,
        local: seg.dst,
        remote_port: seg.sport,
        local_port: seg.dport,
        _pad: 0,
    };
    if seg.is_syn() {
        return admit(seg, &key, &source, &config, now);
    }
    track(seg, &key, Direction::Ingress, now)
}

/// Policy for a packet leaving the host (TC): only close tracking and activity.
#[inline(always)]
pub fn egress(seg: &Segment, now: u64) -> Action {
    let config = maps::config();
    if !protected(&config, seg.sport) {
        return pass(Direction::Egress, Reason::UnprotectedPort);
    }
    let key = FlowKey {
        remote: seg.dst,
        local: seg.src,
        remote_port: seg.dport,
        local_port: seg.sport,
        _pad: 0,
    };
    track(seg, &key, Direction::Egress, now)
}

#[inline(always)]
fn protected(config: &Config, port: u16) -> bool {
    config.all_ports != 0 || maps::PORTS.get(port as u32).is_some_and(|p| *p != 0)
}

/// Whether the source address is in the allow list (`allow`) or the deny list.
#[inline(always)]
fn listed(seg: &Segment, allow: bool) -> bool {
    if seg.ipv6 {
        let key = Key::new(128, seg.src);
        let trie = if allow {
            &maps::ALLOW_V6
        } else {
            &maps::DENY_V6
        };
        trie.get(&key).is_some()
    } else {
        let key = Key::new(32, [seg.src[12], seg.src[13], seg.src[14], seg.src[15]]);
        let trie = if allow {
            &maps::ALLOW_V4
        } else {
            &maps::DENY_V4
        };
        trie.get(&key).is_some()
    }
}

/// The source address masked to the configured prefix (IPv4 as mapped, so its prefix counts
/// from bit 96).
#[inline(always)]
pub fn source_key(addr: &[u8; 16], config: &Config) -> SourceKey {
    let v4 = addr[..12] == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF];
    let prefix = if v4 {
        96 + config.ipv4_prefix.min(32) as u32
    } else {
        config.ipv6_prefix.min(128) as u32
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

#[inline(always)]
fn banned(source: &SourceKey, now: u64) -> bool {
    // SAFETY: a read of a value the agent writes whole; a torn read only delays a ban by a packet.
    unsafe { BANS.get(source) }.is_some_and(|ban| ban.expires_ns > now)
}

/// Admits a SYN or refuses it. The order is cheap-to-dear: a retransmission of a tracked flow
/// passes at once; then the rate bucket, then the caps, then the flow insert.
#[inline(always)]
fn admit(seg: &Segment, key: &FlowKey, source: &SourceKey, config: &Config, now: u64) -> Action {
    if let Some(flow) = FLOWS.get_ptr_mut(key) {
        // SAFETY: pointer from a successful lookup.
        let state = unsafe { &mut (*flow).state };
        if *state & flow_state::FIN_BOTH != 0 {
            // A new connection on the 4-tuple of a closing one: it inherits the slot the old
            // one held, so nothing is released or taken twice.
            atomics::fetch_and(state, 0);
            // SAFETY: as above.
            unsafe { (*flow).first_seen_ns = now };
        }
        // SAFETY: as above.
        unsafe { (*flow).last_seen_ns = now };
        return pass(Direction::Ingress, Reason::Retransmit);
    }
    if config.syn_rate != 0 && !take_syn_token(source, config, now) {
        return refuse(seg, source, Reason::SynRate, config.reject_rate);
    }
    let Some(per_source) = maps::get_or_insert(&SOURCE_CONNS, source, &0) else {
        return table_full(seg, source, config);
    };
    let before = atomics::fetch_add(per_source, 1);
    if config.max_conn_per_ip != 0 && before >= config.max_conn_per_ip as u64 {
        atomics::decrement(per_source);
        return refuse(seg, source, Reason::ConnPerIp, config.reject_conn);
    }
    let Some(global) = GLOBAL_CONNS.get_ptr_mut(0) else {
        atomics::decrement(per_source);
        return pass(Direction::Ingress, Reason::Malformed);
    };
    let before = atomics::fetch_add(global, 1);
    if config.max_conn_total != 0 && before >= config.max_conn_total as u64 {
        atomics::decrement(global);
        atomics::decrement(per_source);
        return refuse(seg, source, Reason::ConnTotal, config.reject_conn);
    }
    let flow = Flow {
        first_seen_ns: now,
        last_seen_ns: now,
        source: *source,
        state: 0,
        _pad: 0,
    };
    match FLOWS.insert(key, flow, aya_ebpf::bindings::BPF_NOEXIST.into()) {
        Ok(()) => {
            event(Event::Opened);
            pass(Direction::Ingress, Reason::Admitted)
        }
        Err(error) => {
            atomics::decrement(global);
            atomics::decrement(per_source);
            if error == -EEXIST {
                // The same SYN on another CPU won the insert: this copy is a retransmission.
                pass(Direction::Ingress, Reason::Retransmit)
            } else {
                table_full(seg, source, config)
            }
        }
    }
}

const EEXIST: i32 = 17;

#[inline(always)]
fn table_full(seg: &Segment, source: &SourceKey, config: &Config) -> Action {
    if config.fail_closed != 0 {
        refuse(seg, source, Reason::FlowTableFull, config.reject_conn)
    } else {
        pass(Direction::Ingress, Reason::FlowTableFull)
    }
}

/// GCRA: the bucket is the theoretical arrival time of the next SYN. A SYN is allowed while
/// that time is no further ahead of now than the burst; taking a token moves it one emission
/// interval on, by compare-and-swap so racing CPUs each pay for their own token.
#[inline(always)]
fn take_syn_token(source: &SourceKey, config: &Config, now: u64) -> bool {
    let interval = 1_000_000_000 / config.syn_rate as u64;
    let tolerance = interval * config.syn_burst.max(1) as u64;
    let Some(bucket) = maps::lru_get_or_insert(&SYN_BUCKETS, source, &SynBucket { tat_ns: now })
    else {
        return true;
    };
    // SAFETY: pointer from a successful lookup.
    let tat = unsafe { &mut (*bucket).tat_ns };
    for _ in 0..8 {
        let current = atomics::load(tat);
        let next = current.max(now) + interval;
        if next - now > tolerance {
            return false;
        }
        if atomics::compare_exchange(tat, current, next) {
            return true;
        }
    }
    // Eight CPUs beat us to the same source's bucket: it is being flooded.
    false
}

/// Follows a packet of a (possibly) tracked flow: activity, the handshake's end, and close.
#[inline(always)]
fn track(seg: &Segment, key: &FlowKey, direction: Direction, now: u64) -> Action {
    let Some(flow) = FLOWS.get_ptr_mut(key) else {
        return pass(direction, Reason::Untracked);
    };
    if seg.has(TCP_RST) {
        close(key, flow, Event::ClosedRst);
        return pass(direction, Reason::Tracked);
    }
    // SAFETY: pointer from a successful lookup; the fields are plain words.
    unsafe {
        if now.saturating_sub((*flow).last_seen_ns) >= LAST_SEEN_GRANULARITY_NS {
            (*flow).last_seen_ns = now;
        }
    }
    // SAFETY: as above.
    let state = unsafe { &mut (*flow).state };
    if direction == Direction::Ingress && seg.has(TCP_ACK) && *state & flow_state::ESTABLISHED == 0
    {
        atomics::fetch_or(state, flow_state::ESTABLISHED);
    }
    if seg.has(TCP_FIN) {
        let mine = match direction {
            Direction::Ingress => flow_state::FIN_IN,
            Direction::Egress => flow_state::FIN_OUT,
        };
        let before = atomics::fetch_or(state, mine);
        // Exactly one side sees the other's FIN already there and its own not yet: it closes.
        if before & mine == 0 && (before | mine) & flow_state::FIN_BOTH == flow_state::FIN_BOTH {
            close(key, flow, Event::ClosedFin);
        }
    }
    pass(direction, Reason::Tracked)
}

/// Removes the flow and, if this call is the one whose delete succeeded, releases its slots.
#[inline(always)]
pub fn close(key: &FlowKey, flow: *mut Flow, why: Event) -> bool {
    // Read before the delete: a deleted element's memory can be reused at once.
    // SAFETY: pointer from a successful lookup.
    let source = unsafe { (*flow).source };
    if FLOWS.remove(key).is_err() {
        return false;
    }
    if let Some(per_source) = SOURCE_CONNS.get_ptr_mut(source) {
        atomics::decrement(per_source);
    }
    if let Some(global) = GLOBAL_CONNS.get_ptr_mut(0) {
        atomics::decrement(global);
    }
    event(why);
    true
}

//! What to do with a packet: the allow and deny lists, bans, the SYN-rate bucket, the
//! connection caps, and connection tracking from SYN through handshake to close.
//!
//! A SYN takes no slot and writes no hash table. It is checked (lists, bans, rate, and the
//! caps as they stand) against its source's slot of the `SYN_BUCKETS` array; the server's
//! SYN-ACK leaving the host records the connection, with its ISN, in the LRU `HALF_OPEN`;
//! the client's ACK of that ISN proves the source real, and only then are the slots taken and
//! the connection entered in `FLOWS`. A spoofed source never sees the SYN-ACK, so a flood of
//! them holds no slot and creates no per-source counter. A handshake whose half-open record is
//! gone before its ACK (evicted, or swept after `syn-timeout`) passes here uncounted: the
//! kernel cannot tell its ACK from any other segment. The agent finds the connection in the
//! host's socket table and enters it through [`adopt`].
//!
//! Counters are exact under concurrency: a slot is taken with an atomic add, checked against
//! the cap, and rolled back if over, so racing CPUs can never admit past a cap; a slot is given
//! back only by whoever succeeded in deleting the flow from `FLOWS`, so it is released once.
//!
//! The established fast path (a data or ACK segment) reads a few array slots: no hash lookup,
//! no map write (it counts nothing), no clock (see [`hinted`]).

use aya_ebpf::{
    helpers::{bpf_ktime_get_boot_ns, bpf_ktime_get_coarse_ns},
    maps::lpm_trie::Key,
};
use limiter_common::{
    BUCKET_TAG_MASK, Blocked, Config, Direction, Event, Flow, FlowKey, HalfOpen, Limits, Offense,
    ProfileSource, Reason, Refusal, SEEN_ATTEMPTS, SeenAttempts, SourceKey, SourceLimits,
    SynBucket, Verdict, attempt_signature, bucket_place, flow_state, helper,
    map_catalogue::ACK_HINT_BITS, profile::refusal_slot, seen_slot, source::V4_MAPPED, source_key,
    stats::stat_slot, syn_cookies,
};

use crate::{
    atomics,
    map_access::{
        self, ACK_HINTS, BANS, BLOCKED, CONN_RATE, EVENTS, FLOWS, GLOBAL_CONNS, HALF_OPEN,
        OFFENDERS, PORTS, REFUSED_CONNS, STATS, SYN_BUCKETS,
    },
    overrides,
    parsing::{Common, Segment, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
    source_counts::{self, Taken},
};

/// What the entry point does with the packet.
#[derive(Clone, Copy)]
pub enum Action {
    Pass,
    Drop,
    /// Answer the SYN with RST|ACK: by `XDP_TX` when `xdp_tx`, else through TC ingress.
    Rst {
        xdp_tx: bool,
    },
    /// Turn this handshake-completing ACK into a RST to the host and pass it, so the host
    /// drops the embryonic connection the caps refused.
    ResetHost,
    /// Answer the SYN with a SYN cookie's SYN-ACK (see `cookie`): by `XDP_TX` when `xdp_tx`,
    /// else through TC ingress; if no cookie can be made, pass it (see [`cookie_sent`]).
    Cookie {
        xdp_tx: bool,
    },
    /// An ACK no half-open handshake expects, while cookies are checked: if it carries a
    /// valid cookie, [`cookie_ack`] admits it; if a listener's cookie is wrong, drop it
    /// ([`bad_cookie`]); else pass it.
    CheckCookie,
    /// An ACK that may complete a handshake the host answered: [`handshake`] judges it.
    Handshake,
}

#[inline(always)]
fn count(direction: Direction, verdict: Verdict, reason: Reason) {
    map_access::bump(&STATS, stat_slot(direction, verdict, reason));
}

#[inline(always)]
fn event(event: Event) {
    map_access::bump(&EVENTS, event as u32);
}

/// Counts a packet passed for `reason`.
#[inline(always)]
pub fn pass(direction: Direction, reason: Reason) -> Action {
    count(direction, Verdict::Pass, reason);
    Action::Pass
}

/// A packet the parser could not read. On ingress, anything that could be TCP to a protected
/// port (a fragment, a cut-short or malformed header, an over-long IPv6 header chain) is
/// dropped: passing it would let the host reassemble or walk it into a connection nothing
/// judged. A tunnel is dropped too unless the configuration lets tunnels pass (the host
/// would decapsulate it into a connection nothing judged). Non-IP and non-TCP traffic
/// passes. On egress everything passes.
#[inline(always)]
pub fn unparsed(direction: Direction, reason: Reason) -> Action {
    let passes = match reason {
        Reason::NonIp | Reason::NonTcp => true,
        Reason::Tunnel => map_access::config().tunnels_pass != 0,
        _ => false,
    };
    if direction == Direction::Ingress && !passes {
        count(direction, Verdict::Drop, reason);
        return Action::Drop;
    }
    pass(direction, reason)
}

/// Who a refused connection attempt is counted against, for the top-blocked lists.
#[derive(Clone, Copy)]
enum Blame<'a> {
    /// Its source, in `BLOCKED`.
    Source(&'a SourceKey),
    /// Its source's SYN bucket, already looked up (refused for the SYN rate).
    Bucket(*mut SynBucket),
}

/// Refuses an ingress packet. Only a SYN gets an RST: a reset in the middle of a flow would
/// need the flow's sequence numbers, so other refused packets are dropped. Every packet
/// counts in `STATS`; a SYN that is not a retransmission of one its source had refused also
/// counts as a refused connection attempt, in `REFUSED_CONNS` and against its source.
///
/// In monitor mode (the profile's) it only counts the packet as [`Verdict::WouldRefuse`], in
/// all and in its profile, and passes it: a SYN then goes to the host, and its handshake
/// completes at its ACK, by [`admit`].
#[inline(always)]
fn refuse(seg: &Segment, blame: Blame, reason: Reason, mode: u8, scope: Scope) -> Action {
    if scope.limits.monitor != 0 {
        would_refuse(reason, scope.profile);
        return Action::Pass;
    }
    if seg.is_syn() {
        refused_attempt(blame, reason, Some(seg), scope.profile);
    }
    if Refusal::from_u8(mode) == Refusal::Rst && seg.is_syn() {
        count(Direction::Ingress, Verdict::Rst, reason);
        Action::Rst {
            xdp_tx: scope.config.rst_xdp_tx != 0,
        }
    } else {
        count(Direction::Ingress, Verdict::Drop, reason);
        Action::Drop
    }
}

/// Counts a packet monitor mode let through that enforce mode would have refused for
/// `reason`, in all and in `profile`.
#[inline(always)]
fn would_refuse(reason: Reason, profile: u32) {
    count(Direction::Ingress, Verdict::WouldRefuse, reason);
    if let Some(slot) = refusal_slot(profile, true, reason) {
        map_access::bump(&REFUSED_CONNS, slot);
    }
}

/// Counts a refused connection attempt, by profile and reason and against its source, unless
/// `syn` is a retransmission of one of the source's last refused SYNs (`None`: a handshake
/// refused at its ACK, always a new attempt).
#[inline(always)]
fn refused_attempt(blame: Blame, reason: Reason, syn: Option<&Segment>, profile: u32) {
    let (Some(slot), Some(counted)) = (reason.blocked_slot(), refusal_slot(profile, false, reason))
    else {
        return;
    };
    let (counter, seen) = match blame {
        Blame::Source(source) => match map_access::get_or_insert(&BLOCKED, source, &NO_REFUSALS) {
            // SAFETY: a pointer from a successful lookup; the slot is below REFUSAL_COUNT.
            Some(blocked) => unsafe {
                (&raw mut (*blocked).counts[slot], &raw mut (*blocked).seen)
            },
            None => {
                map_access::bump(&REFUSED_CONNS, counted);
                return;
            }
        },
        // SAFETY: a pointer from a successful lookup.
        Blame::Bucket(bucket) => unsafe { (&raw mut (*bucket).refused, &raw mut (*bucket).seen) },
    };
    if let Some(syn) = syn
        && !new_attempt(seen, syn)
    {
        return;
    }
    map_access::bump(&REFUSED_CONNS, counted);
    atomics::fetch_add(counter, 1);
}

/// A source's counts before its first refusal. A static, not a local: a zeroed local of this
/// size compiles to a byte-by-byte call of `memset`, a subprogram of its own, and older
/// verifiers (Debian's 6.1) round every frame on a call chain up to 32 bytes, which took the
/// deepest chain (`limiter_xdp` → `ingress`, with `syn` inlined, → `complete` → `memset`)
/// past BPF's 512 bytes of stack.
static NO_REFUSALS: Blocked = Blocked {
    counts: [0; Reason::REFUSAL_COUNT],
    seen: [0; SEEN_ATTEMPTS],
};

/// Whether this refused SYN starts a new connection attempt rather than retransmitting one of
/// those its source's record remembers (see [`limiter_common::SeenAttempts`]); remembers it.
/// Plain reads and writes: a race between two CPUs can at worst count one attempt twice.
#[inline(always)]
fn new_attempt(seen: *mut SeenAttempts, seg: &Segment) -> bool {
    let signature = attempt_signature(&seg.src, &seg.dst, seg.sport, seg.dport, seg.seq);
    let slot = seen_slot(signature);
    // SAFETY: `seen` points into a map value from a successful lookup; the slot is in range.
    unsafe {
        let remembered = &raw mut (*seen)[slot];
        if *remembered == signature {
            return false;
        }
        *remembered = signature;
    }
    true
}

#[inline(always)]
fn source_of(seg: &Segment, config: &Config) -> SourceKey {
    source_key(&seg.src, config.ipv4_prefix, config.ipv6_prefix)
}

/// The connection an ingress segment belongs to.
#[inline(always)]
fn inbound(seg: &Segment) -> FlowKey {
    FlowKey {
        remote: seg.src,
        local: seg.dst,
        remote_port: seg.sport,
        local_port: seg.dport,
        _pad: 0,
    }
}

/// The connection an egress segment belongs to, in the same orientation.
#[inline(always)]
fn outbound(seg: &Segment) -> FlowKey {
    FlowKey {
        remote: seg.dst,
        local: seg.src,
        remote_port: seg.dport,
        local_port: seg.sport,
        _pad: 0,
    }
}

/// `CLOCK_BOOTTIME`: keeps counting through suspend, so bans and timeouts never stretch. Read
/// only on the paths that need it: the established fast path reads no clock, and the SYN
/// rate reads [`rate_now`].
#[inline(always)]
fn now() -> u64 {
    // SAFETY: the helper has no preconditions.
    unsafe { bpf_ktime_get_boot_ns() }
}

/// The SYN rate's clock, `CLOCK_MONOTONIC_COARSE`: the time of the last tick, read from
/// memory. A flood's refusals are judged on it alone, and reading the fine clock (the TSC,
/// through the timekeeper) was a quarter of a refusal's cost. The rate is then exact at the
/// tick (1 to 4 ms): within one tick no token comes back. It stops in suspend, which only
/// leaves a bucket as it was.
#[inline(always)]
fn rate_now() -> u64 {
    // SAFETY: the helper has no preconditions.
    unsafe { bpf_ktime_get_coarse_ns() }
}

/// The established fast path, judged on a common frame's port, flags and acknowledgment
/// alone, before any [`Segment`] is built or [`ingress`] called: a segment with none of SYN,
/// RST and FIN to a protected port, while no list or ban is in force, whose acknowledgment
/// [`hinted`] says completes no handshake. True when it passed it; false sends the packet
/// down the whole path.
///
/// It counts nothing: these segments are the bulk of a broker's traffic, and a per-packet
/// counter was the only map write left on their path (about a third of its cost over the
/// anchor under test-run). Their volume is the interface's own counters'; [`ingress`] leaves
/// plain segments uncounted too, so a count never depends on which path a frame's shape sent
/// it down. The frame's fields are read only where a check needs them: read up front, they
/// stayed live across the map reads and were spilled to the stack.
#[inline(always)]
pub fn established(frame: &Common) -> bool {
    let config = map_access::config();
    let flags = frame.flags();
    if config.has_allow | config.has_deny | config.has_bans != 0
        || flags & (TCP_SYN | TCP_RST | TCP_FIN) != 0
        || !protected(config, frame.dport())
        || (flags & TCP_ACK != 0 && hinted(frame.ack()))
    {
        return false;
    }
    true
}

/// Policy for a packet arriving at the host (XDP).
#[inline(never)]
pub fn ingress(seg: &Segment) -> Action {
    let config = map_access::config();
    let Some(profile) = profile_of(config, seg.dport) else {
        return pass(Direction::Ingress, Reason::UnprotectedPort);
    };
    let scope = Scope::of(config, profile);
    if seg.fragment() {
        // The first fragment of TCP to a protected port: its flags may lie in a later one.
        count(Direction::Ingress, Verdict::Drop, Reason::Fragment);
        return Action::Drop;
    }
    if config.has_allow != 0 && listed(seg, true) {
        return pass(Direction::Ingress, Reason::Allowlisted);
    }
    if config.has_deny | config.has_bans != 0 {
        let source = source_of(seg, config);
        let barred = if config.has_deny != 0 && listed(seg, false) {
            Some((Reason::Denylisted, config.reject_deny))
        } else if config.has_bans != 0 && banned(&source, now()) {
            Some((Reason::Banned, config.reject_ban))
        } else {
            None
        };
        // In monitor mode a barred source's SYN counts as the attempt enforce mode would
        // refuse, and its other packets go on to be judged as anyone's (its handshake
        // completes and is tracked, its close releases), uncounted: they would not exist.
        if let Some((reason, mode)) = barred
            && (scope.limits.monitor == 0 || seg.is_syn())
        {
            return refuse(seg, Blame::Source(&source), reason, mode, scope);
        }
    }
    if seg.is_syn() {
        return syn(seg, scope);
    }
    if seg.has(TCP_RST) {
        return reset(seg, Direction::Ingress);
    }
    if seg.has(TCP_ACK) && !seg.has(TCP_SYN) && hinted(seg.ack) {
        return Action::Handshake;
    }
    if seg.has(TCP_FIN) {
        return fin(&inbound(seg), Direction::Ingress);
    }
    // A plain segment passes uncounted, as on the fast path (see `established`).
    Action::Pass
}

/// The rest of [`ingress`] for an ACK that may complete a handshake ([`Action::Handshake`]):
/// it takes its slots, or is refused, or is looked at as a cookie's; its FIN, if it carries
/// one, marks its flow closing. Called by the entry point rather than from [`ingress`], so
/// that the deepest chain of frames is two calls, not three: a completing handshake holds
/// the most on the stack.
#[inline(never)]
pub fn handshake(seg: &Segment) -> Action {
    let admitted = match complete(seg, map_access::config(), now()) {
        Completion::Admitted => true,
        Completion::Refused(action) => return action,
        Completion::NotAHandshake => false,
        Completion::MaybeCookie => return Action::CheckCookie,
    };
    if seg.has(TCP_FIN) {
        return fin(&inbound(seg), Direction::Ingress);
    }
    if admitted {
        return pass(Direction::Ingress, Reason::Admitted);
    }
    Action::Pass
}

/// Policy for a packet leaving the host (TC): the server's ISN, and close tracking.
#[inline(never)]
pub fn egress(seg: &Segment) -> Action {
    let config = map_access::config();
    let Some(profile) = profile_of(config, seg.sport) else {
        return pass(Direction::Egress, Reason::UnprotectedPort);
    };
    if seg.flags() & (TCP_SYN | TCP_ACK | TCP_RST) == TCP_SYN | TCP_ACK {
        return syn_ack(seg, config, profile, now());
    }
    if seg.has(TCP_RST) {
        return reset(seg, Direction::Egress);
    }
    if seg.has(TCP_FIN) {
        return fin(&outbound(seg), Direction::Egress);
    }
    pass(Direction::Egress, Reason::Segment)
}

/// Whether a local port is protected, for the fast path, which needs no more.
#[inline(always)]
fn protected(config: &Config, port: u16) -> bool {
    config.all_ports != 0 || PORTS.get(u32::from(port)).is_some_and(|p| *p != 0)
}

/// The profile slot of a local port, if it is protected: its `PORTS` byte less one, or the
/// top level's (0) for any other port while every port is protected.
#[inline(always)]
fn profile_of(config: &Config, port: u16) -> Option<u32> {
    if config.all_ports != 0 && config.has_profiles == 0 {
        return Some(0);
    }
    match PORTS.get(u32::from(port)).map_or(0, |p| u32::from(*p)) {
        0 if config.all_ports != 0 => Some(0),
        0 => None,
        byte => Some(byte - 1),
    }
}

/// What a packet to a protected port is judged by: the config, and the limits of the port's
/// profile (the top level's, in the config, for slot 0), read once per packet.
#[derive(Clone, Copy)]
struct Scope {
    config: &'static Config,
    limits: &'static Limits,
    /// The profile slot, whose counts the packet's connection is charged to.
    profile: u32,
}

impl Scope {
    #[inline(always)]
    fn of(config: &'static Config, profile: u32) -> Scope {
        Scope {
            config,
            limits: map_access::limits(config, profile),
            profile,
        }
    }
}

/// Whether the source address is in the allow list (`allow`) or the deny list.
#[inline(always)]
fn listed(seg: &Segment, allow: bool) -> bool {
    listed_address(&seg.src, seg.ipv6(), allow)
}

/// [`listed`] for an address (IPv4 as `::ffff:a.b.c.d`).
#[inline(always)]
fn listed_address(src: &[u8; 16], ipv6: bool, allow: bool) -> bool {
    if ipv6 {
        let key = Key::new(128, *src);
        let trie = if allow {
            &map_access::ALLOW_V6
        } else {
            &map_access::DENY_V6
        };
        trie.get(&key).is_some()
    } else {
        let key = Key::new(32, [src[12], src[13], src[14], src[15]]);
        let trie = if allow {
            &map_access::ALLOW_V4
        } else {
            &map_access::DENY_V4
        };
        trie.get(&key).is_some()
    }
}

#[inline(always)]
fn banned(source: &SourceKey, now: u64) -> bool {
    // SAFETY: a read of a value the agent writes whole; a torn read only delays a ban by a packet.
    unsafe { BANS.get(source) }.is_some_and(|ban| ban.expires_ns > now)
}

/// A SYN: refused if its source's proven handshakes have left it no SYN token, or if a cap
/// is reached as the counts stand; else passed. It takes no token and no slot, and writes
/// nothing: the token is taken when its handshake completes ([`complete`]), once the client's
/// ACK of the server's ISN has proven the source. A sender forging a victim's address can
/// then neither spend the victim's allowance nor lock it out, and a retransmitted SYN costs
/// nothing as a matter of course.
///
/// It writes no hash table: the source's SYN bucket is a slot of an array
/// ([`limiter_common::bucket_place`]), and the half-open record is written when the host's
/// SYN-ACK leaves ([`syn_ack`]). A new source's SYN costs that slot's read and nothing more
/// unless a source mapping to the slot holds connections (`holders`), when its count is
/// looked up. The 4-tuple is not looked up in `FLOWS`: a SYN on a tracked 4-tuple (a
/// connection reusing a closing one's, or a stray SYN the host answers with a challenge ACK)
/// passes like any other, and if its handshake completes, [`complete`] finds the 4-tuple
/// tracked and the new connection takes over the old one's slot.
///
/// Inlined into [`ingress`]: a subprogram's call and return (the return through the CPU's
/// return thunk, on hosts mitigated against return-stack attacks) cost every SYN.
#[inline(always)]
fn syn(seg: &Segment, scope: Scope) -> Action {
    let config = scope.config;
    let counted = ProfileSource::new(source_of(seg, config), scope.profile);
    let source = &counted.source;
    let place = bucket_place(&counted, config.bucket_seed, config.bucket_mask);
    let Some(bucket) = SYN_BUCKETS.get_ptr_mut(place.slot) else {
        // Only before the agent sized the array into the config: nothing to meter with.
        return pass(Direction::Ingress, Reason::HalfOpen);
    };
    // SAFETY: pointer from a successful lookup.
    let word = atomics::load(unsafe { &(*bucket).tat_tag });
    let tagged = word & BUCKET_TAG_MASK == place.tag;
    // A source whose slot is another's (or nobody's) and holds no connections meets neither
    // its rate nor its cap below, so only others pay the override lookup: a flood's new
    // sources do not.
    // SAFETY: pointer from a successful lookup.
    let own = if tagged || atomics::load(unsafe { &(*bucket).holders }) != 0 {
        PerSource::of(source, scope)
    } else {
        PerSource::top(scope)
    };
    let rate = own.rate;
    // Kernel escalation: a SYN over its source's own cap or rate goes on to the host, and is
    // refused at its handshake's ACK, which proves the source (see `offense`).
    let defer = config.offense_gap_ns != 0 && scope.limits.monitor == 0;
    // The rate first: a SYN over it is refused on its bucket alone. Another source's slot
    // (or one never claimed) is a full bucket, and its SYN reads no clock.
    if !defer
        && rate.limited()
        && tagged
        && rate.next(word & !BUCKET_TAG_MASK, rate_now()).is_none()
    {
        return refuse_rate(seg, bucket, scope);
    }
    let cap = if defer { 0 } else { own.cap };
    if let Some(reason) = at_cap(&counted, bucket, cap, scope) {
        return refuse(
            seg,
            Blame::Source(source),
            reason,
            scope.limits.reject_conn,
            scope,
        );
    }
    if conn_rate_spent(scope) {
        return refuse(
            seg,
            Blame::Source(source),
            Reason::ConnRate,
            scope.limits.reject_rate,
            scope,
        );
    }
    if config.syn_cookies & syn_cookies::ANSWER != 0 && !proven(&counted, bucket) {
        return Action::Cookie {
            xdp_tx: config.rst_xdp_tx != 0,
        };
    }
    pass(Direction::Ingress, Reason::HalfOpen)
}

/// Whether `source` holds a connection now: its handshakes reach the host, which gives them
/// every TCP option; an unproven source's SYN gets a cookie. Looked up only if a source of
/// its bucket slot holds one (a flood's new sources pay no lookup).
#[inline(always)]
fn proven(counted: &ProfileSource, bucket: *mut SynBucket) -> bool {
    // SAFETY: pointer from a successful lookup.
    atomics::load(unsafe { &(*bucket).holders }) != 0 && source_counts::current(counted) != 0
}

/// Counts a SYN [`Action::Cookie`] answered (with the cookie `isn`) or had to pass on to the
/// host (no cookie could be made). A cookie's ACK acknowledges it plus one, as a SYN-ACK's
/// does: its hint is stamped so that the ACK is looked at ([`hinted`]).
#[inline(always)]
pub fn cookie_sent(answered: bool, isn: u32) {
    if answered {
        stamp_hint(isn, now());
        count(Direction::Ingress, Verdict::Cookie, Reason::Unproven);
    } else {
        count(Direction::Ingress, Verdict::Pass, Reason::HalfOpen);
    }
}

/// An ACK whose cookie the host did not make: nothing is charged, and it goes no further.
#[inline(always)]
pub fn bad_cookie() -> Action {
    count(Direction::Ingress, Verdict::Drop, Reason::BadCookie);
    Action::Drop
}

/// The ACK of a valid cookie: the source is proven, and the connection takes its slots and
/// its SYN token exactly as a handshake the host answered ([`admit`]). The host holds no
/// state for it yet, so a refusal answers the client with a RST (or drops the ACK), rather
/// than resetting the host.
#[inline(never)]
pub fn cookie_ack(seg: &Segment) -> Action {
    let config = map_access::config();
    let Some(profile) = profile_of(config, seg.dport) else {
        // Only a protected port's ACK is checked for a cookie.
        return Action::Pass;
    };
    let scope = Scope::of(config, profile);
    let now = now();
    let flow = Flow {
        first_seen_ns: now,
        last_seen_ns: now,
        counted: ProfileSource::new(source_of(seg, config), profile),
        state: flow_state::ESTABLISHED,
        _pad: 0,
    };
    match admit(&inbound(seg), &flow, scope) {
        Completion::Admitted => pass(Direction::Ingress, Reason::Admitted),
        Completion::Refused(Action::ResetHost) => {
            if Refusal::from_u8(scope.limits.reject_conn) == Refusal::Rst {
                Action::Rst {
                    xdp_tx: config.rst_xdp_tx != 0,
                }
            } else {
                Action::Drop
            }
        }
        Completion::Refused(action) => action,
        Completion::NotAHandshake | Completion::MaybeCookie => Action::Pass,
    }
}

/// An ACK the cookie check found to be no listener's (an established connection's, whose
/// acknowledgement still matches a fresh hint): the rest of [`ingress`] for it, so that a
/// client's FIN still marks its flow closing.
#[inline(always)]
pub fn not_a_cookie(seg: &Segment) -> Action {
    if seg.has(TCP_FIN) {
        return fin(&inbound(seg), Direction::Ingress);
    }
    Action::Pass
}

/// The `SYN_BUCKETS` slot of a source key in a profile.
#[inline(always)]
fn bucket_of(counted: &ProfileSource, config: &Config) -> Option<*mut SynBucket> {
    SYN_BUCKETS.get_ptr_mut(bucket_place(counted, config.bucket_seed, config.bucket_mask).slot)
}

/// Adds `delta` to the connections held through a source's bucket slot (see
/// [`SynBucket::holders`]), as its count in `SOURCE_CONNS` moves by the same.
#[inline(always)]
fn hold(counted: &ProfileSource, config: &Config, delta: u64) {
    if let Some(bucket) = bucket_of(counted, config) {
        // SAFETY: pointer from a successful lookup.
        atomics::fetch_add(unsafe { &raw mut (*bucket).holders }, delta);
    }
}

#[inline(always)]
fn refuse_rate(seg: &Segment, bucket: *mut SynBucket, scope: Scope) -> Action {
    refuse(
        seg,
        Blame::Bucket(bucket),
        Reason::SynRate,
        scope.limits.reject_rate,
        scope,
    )
}

const EEXIST: i32 = 17;

/// The cap a new connection of `source` would exceed right now, if any. Only a precheck:
/// the slots are taken, exactly, when the handshake completes. The source's count is looked
/// up only if some source of its bucket slot holds connections: a new source's SYN, the one a
/// flood is made of, then pays no hash lookup.
#[inline(always)]
fn at_cap(
    counted: &ProfileSource,
    bucket: *mut SynBucket,
    cap: u32,
    scope: Scope,
) -> Option<Reason> {
    if cap != 0
        // SAFETY: pointer from a successful lookup.
        && atomics::load(unsafe { &(*bucket).holders }) != 0
        && source_counts::current(counted) >= u64::from(cap)
    {
        return Some(Reason::ConnPerIp);
    }
    let total = scope.limits.max_conn_total;
    if total != 0
        && let Some(global) = GLOBAL_CONNS.get_ptr(scope.profile)
        && atomics::load(global) >= u64::from(total)
    {
        return Some(Reason::ConnTotal);
    }
    None
}

/// The per-source limits a source is held to: its override's if an override covers it, else
/// its profile's. Read once per packet: the config and the tries may be rewritten meanwhile.
#[derive(Clone, Copy)]
struct PerSource {
    /// Its concurrent connections; 0 = no limit.
    cap: u32,
    /// Its SYN rate.
    rate: Gcra,
}

impl PerSource {
    #[inline(always)]
    fn of(source: &SourceKey, scope: Scope) -> PerSource {
        let own = if scope.config.has_overrides != 0 {
            overrides::lookup(source)
        } else {
            None
        };
        let Some(own) = own else {
            return PerSource::top(scope);
        };
        let profile = scope.limits;
        let cap = if own.max_conn_per_ip == SourceLimits::INHERIT {
            profile.max_conn_per_ip
        } else {
            own.max_conn_per_ip
        };
        let rate = if own.syn_rate != SourceLimits::INHERIT {
            Gcra {
                interval: own.syn_interval_ns,
                tolerance: own.syn_tolerance_ns,
            }
        } else if own.syn_burst != SourceLimits::INHERIT {
            // A burst of its own at the profile's rate.
            Gcra {
                interval: profile.syn_interval_ns,
                tolerance: profile.syn_interval_ns * u64::from(own.syn_burst.max(1)),
            }
        } else {
            Gcra::of(profile)
        };
        PerSource { cap, rate }
    }

    /// The profile's limits, whatever the overrides.
    #[inline(always)]
    fn top(scope: Scope) -> PerSource {
        PerSource {
            cap: scope.limits.max_conn_per_ip,
            rate: Gcra::of(scope.limits),
        }
    }
}

/// The SYN rate as GCRA: a source's bucket is the theoretical arrival time (TAT) of its next
/// SYN, and a SYN is allowed while that time is no further ahead of now than the burst. Holds
/// the emission interval and burst tolerance, in nanoseconds, as the agent derived them
/// ([`Limits::derive_rate_terms`]); an interval of 0 when the rate is not limited. (Not an
/// `Option`: LLVM spills the fields of a `None` it never initialised, and the verifier
/// rejects reads of uninitialised registers.)
#[derive(Clone, Copy)]
struct Gcra {
    interval: u64,
    tolerance: u64,
}

impl Gcra {
    #[inline(always)]
    fn of(limits: &Limits) -> Gcra {
        Gcra {
            interval: limits.syn_interval_ns,
            tolerance: limits.syn_tolerance_ns,
        }
    }

    /// The connection rate's terms.
    #[inline(always)]
    fn connections(limits: &Limits) -> Gcra {
        Gcra {
            interval: limits.conn_interval_ns,
            tolerance: limits.conn_tolerance_ns,
        }
    }

    #[inline(always)]
    fn limited(self) -> bool {
        self.interval != 0
    }

    /// The TAT a SYN arriving at `now` would leave, if it is allowed.
    #[inline(always)]
    fn next(self, tat: u64, now: u64) -> Option<u64> {
        let next = tat.max(now) + self.interval;
        (next - now <= self.tolerance).then_some(next)
    }

    /// Takes a token from the bucket of the source tagged `tag`, whose word read `word`,
    /// claiming the slot if another source's tag is there: a claimed slot starts full, the
    /// other source's state gone. Who owns the slot and its TAT are one word, moved by
    /// compare-and-swap, so racing CPUs each pay for their own token, and of two claiming the
    /// slot for one source at once only one starts it full: the other's swap fails and it
    /// takes its token from the bucket the first made. `Err` if the bucket ran dry.
    #[inline(always)]
    fn take(
        self,
        bucket: *mut SynBucket,
        source: &SourceKey,
        tag: u64,
        word: u64,
        now: u64,
    ) -> Result<(), ()> {
        // SAFETY: pointer from a successful lookup.
        let tat_tag = unsafe { &raw mut (*bucket).tat_tag };
        let mut current = word;
        for _ in 0..8 {
            let claim = current & BUCKET_TAG_MASK != tag;
            if !claim && !self.limited() {
                return Ok(());
            }
            let tat = if claim { 0 } else { current & !BUCKET_TAG_MASK };
            let Some(next) = self.next(tat, now) else {
                return Err(());
            };
            match atomics::compare_exchange(tat_tag, current, (next & !BUCKET_TAG_MASK) | tag) {
                Ok(()) => {
                    if claim {
                        // SAFETY: pointer from a successful lookup; besides the word, plain
                        // fields racing CPUs may overwrite, which only the top-blocked counts
                        // would feel.
                        // Volatile: LLVM would join the zeroing into a call of `memset`, whose
                        // frame of its own took the deepest chain past 512 bytes on 6.1.
                        unsafe {
                            (*bucket).source = *source;
                            core::ptr::write_volatile(&raw mut (*bucket).refused, 0);
                            for i in 0..SEEN_ATTEMPTS {
                                core::ptr::write_volatile(&raw mut (*bucket).seen[i], 0);
                            }
                        }
                    }
                    return Ok(());
                }
                Err(found) => current = found,
            }
        }
        // Eight CPUs beat us to the same slot: it is being flooded.
        Err(())
    }

    /// Takes a token from a TAT every source shares (the connection rate's), by
    /// compare-and-swap so that racing CPUs each pay for their own. `Err` if it ran dry, or
    /// if eight other CPUs won the word in turn: refusing then keeps the rate exact.
    #[inline(always)]
    fn take_shared(self, tat: *mut u64, now: u64) -> Result<(), ()> {
        let mut current = atomics::load(tat);
        for _ in 0..8 {
            let next = self.next(current, now).ok_or(())?;
            match atomics::compare_exchange(tat, current, next) {
                Ok(()) => return Ok(()),
                Err(found) => current = found,
            }
        }
        Err(())
    }
}

/// Whether the connection rate is spent right now: a precheck at the SYN, so that a
/// reconnect storm's excess is refused before the host answers it. Only a peek; the token
/// is taken at the proven handshake ([`admit`]).
#[inline(always)]
fn conn_rate_spent(scope: Scope) -> bool {
    let rate = Gcra::connections(scope.limits);
    rate.limited()
        && CONN_RATE
            .get_ptr(scope.profile)
            .is_some_and(|tat| rate.next(atomics::load(tat), rate_now()).is_none())
}

/// How long after the last SYN-ACK carrying an ISN an ACK of it is still looked for, in units
/// of 2^30 ns (about 1.07 s): a host accepts the ACK of a SYN cookie for up to about three
/// minutes (the cookie's 64-second clock may advance twice), and a request socket's
/// retransmitted SYN-ACKs renew the hint. Later, the host itself no longer completes it.
const HINT_WINDOW: u32 = 200;

/// The coarse clock of `ACK_HINTS`; never 0, which marks a slot never written.
#[inline(always)]
fn hint_now(now: u64) -> u32 {
    ((now >> 30) as u32).wrapping_add(1)
}

/// The slot of `ACK_HINTS` that holds the coarse time of the last SYN-ACK: the clock the
/// ingress filter compares stamps against, so that it reads no clock of its own.
const HINT_CLOCK: u32 = 1 << ACK_HINT_BITS;

#[inline(always)]
fn hint_slot(expected_ack: u32) -> u32 {
    // Fibonacci hashing: ISNs are spread already, but a multiply costs nothing.
    expected_ack.wrapping_mul(0x9E37_79B1) >> (32 - ACK_HINT_BITS)
}

/// The pre-filter that spares every ACK a `HALF_OPEN` lookup: an array slot per hash of an
/// expected acknowledgment number (server ISN + 1), stamped with the coarse time of the last
/// SYN-ACK that carried it. A segment whose ack hashes to a slot stamped within
/// [`HINT_WINDOW`] of the last SYN-ACK's time may complete a handshake and is looked up; any
/// other is not.
///
/// There are no false negatives: a slot is only ever restamped forward, never cleared, so
/// the ACK of any SYN-ACK sent within the window finds its slot fresh; and the clock it is
/// compared with is the last SYN-ACK's, never later than the true time, so it can only make a
/// stamp look fresher. A false positive (a data or ACK segment whose ack collides with a
/// recent ISN's slot, or a stale stamp while no SYN-ACK has moved the clock) costs one
/// `HALF_OPEN` lookup that finds nothing or an ISN that does not match, and no write. Under a
/// SYN flood every slot is fresh, and every ACK pays that lookup until the flood is a window
/// old.
///
/// Data segments are filtered too, not only pure ACKs: a client may carry its first bytes on
/// the handshake's last segment, and skipping those would let it connect uncounted.
///
/// A slot never stamped answers without the clock's read.
#[inline(always)]
fn hinted(ack: u32) -> bool {
    let stamp = match ACK_HINTS.get(hint_slot(ack)) {
        Some(stamp) if *stamp != 0 => *stamp,
        _ => return false,
    };
    // Signed: a stamp written a moment after the clock (racing CPUs) reads as fresh.
    ACK_HINTS
        .get(HINT_CLOCK)
        .is_some_and(|clock| (clock.wrapping_sub(stamp) as i32) <= HINT_WINDOW as i32)
}

/// The server's SYN-ACK: the connection is half-open, and its record (source and ISN) is
/// written now rather than at the SYN, so that admitting a SYN writes no hash table. Only
/// SYNs the ingress policy admitted get here, besides those of allowlisted sources, which are
/// left untracked. A retransmitted SYN-ACK finds its record; one with another ISN (a new
/// handshake on the 4-tuple) replaces it. Stamps the ACK hint either way.
#[inline(always)]
fn syn_ack(seg: &Segment, config: &Config, profile: u32, now: u64) -> Action {
    if config.has_allow != 0 && listed_address(&seg.dst, seg.ipv6(), true) {
        return pass(Direction::Egress, Reason::Untracked);
    }
    let key = outbound(seg);
    // SAFETY: pointer from a successful lookup; a plain word.
    let recorded = HALF_OPEN
        .get_ptr(key)
        .is_some_and(|entry| unsafe { (*entry).server_isn } == seg.seq);
    if !recorded {
        let half_open = HalfOpen {
            counted: ProfileSource::new(
                source_key(&seg.dst, config.ipv4_prefix, config.ipv6_prefix),
                profile,
            ),
            first_seen_ns: now,
            server_isn: seg.seq,
            _pad: 0,
        };
        if HALF_OPEN.insert(key, half_open, 0).is_err() {
            return pass(Direction::Egress, Reason::Untracked);
        }
    }
    stamp_hint(seg.seq, now);
    pass(Direction::Egress, Reason::Tracked)
}

/// Stamps the ACK hint of a SYN-ACK carrying `isn` (see [`hinted`]).
#[inline(always)]
fn stamp_hint(isn: u32, now: u64) {
    let stamp = hint_now(now);
    for slot in [hint_slot(isn.wrapping_add(1)), HINT_CLOCK] {
        if let Some(ptr) = ACK_HINTS.get_ptr_mut(slot) {
            // SAFETY: pointer from a successful array lookup. Racing CPUs write times a moment
            // apart: either is fine (see `hinted`).
            unsafe {
                if *ptr != stamp {
                    *ptr = stamp;
                }
            }
        }
    }
}

enum Completion {
    /// The handshake completed and its connection took its slots.
    Admitted,
    /// The handshake completed over a cap (or into a full table, fail-closed).
    Refused(Action),
    /// No half-open connection this segment completes.
    NotAHandshake,
    /// None the host answered, but cookies are checked: it may complete one of those.
    MaybeCookie,
}

/// An ACK that may complete a half-open connection: if it acknowledges the server's ISN, the
/// source is real, and the connection takes its slots, exactly, or is refused.
#[inline(always)]
fn complete(seg: &Segment, config: &'static Config, now: u64) -> Completion {
    let key = inbound(seg);
    let Some(entry) = HALF_OPEN.get_ptr(key) else {
        if config.syn_cookies & syn_cookies::CHECK != 0 {
            return Completion::MaybeCookie;
        }
        return Completion::NotAHandshake;
    };
    // SAFETY: pointer from a successful lookup; what the connection needs of it is copied
    // into its flow before the delete below, after which the element's memory may be reused.
    let flow = unsafe {
        if (*entry).server_isn.wrapping_add(1) != seg.ack {
            return Completion::NotAHandshake;
        }
        Flow {
            first_seen_ns: (*entry).first_seen_ns,
            last_seen_ns: now,
            counted: (*entry).counted,
            state: flow_state::ESTABLISHED,
            _pad: 0,
        }
    };
    // Whoever deletes the entry completes the handshake: a copy of the ACK on another CPU
    // finds nothing, so the slots are taken once.
    if HALF_OPEN.remove(key).is_err() {
        return Completion::NotAHandshake;
    }
    admit(&key, &flow, Scope::of(config, flow.counted.profile))
}

/// A proven handshake: the connection `flow` (its source in a profile) takes its slots in the
/// profile and the SYN rate's token, exactly, or is refused. The flow is built before, so that
/// its count key is the one the count table is handed, not a second copy on the stack.
///
/// In monitor mode a handshake over a cap or a rate is admitted all the same, its slots
/// taken past the cap (its connection exists, and its close gives them back) and no token
/// where none is left. It is not counted as [`Verdict::WouldRefuse`] here: its SYN, judged
/// against the same counts, was, and an attempt counts once, as enforce mode's refusal of it
/// at its SYN does. (Enforce mode refuses at the ACK only a handshake that lost a race to
/// another between its SYN and its ACK; monitor mode lets those pass uncounted.)
#[inline(always)]
fn admit(key: &FlowKey, flow: &Flow, scope: Scope) -> Completion {
    let counted = &flow.counted;
    let source = &counted.source;
    let own = PerSource::of(source, scope);
    let enforce = scope.limits.monitor == 0;
    let (per_source, before) = match source_counts::take(counted, 1) {
        Taken::Slots { counter, before } => (counter, before),
        Taken::Full => return full_at_ack(source, scope),
        // Refused, never let in uncounted: see `source_counts`.
        Taken::Busy => return refuse_at_ack(Blame::Source(source), Reason::FlowTableFull, scope),
    };
    if own.cap != 0 && before >= u64::from(own.cap) {
        offense(source, flow.last_seen_ns, scope.config, !enforce);
        if enforce {
            source_counts::give_back(counted, per_source, 1);
            return refuse_at_ack(Blame::Source(source), Reason::ConnPerIp, scope);
        }
    }
    let Some(global) = GLOBAL_CONNS.get_ptr_mut(scope.profile) else {
        source_counts::give_back(counted, per_source, 1);
        return Completion::NotAHandshake;
    };
    let before = atomics::fetch_add(global, 1);
    let total = scope.limits.max_conn_total;
    if enforce && total != 0 && before >= u64::from(total) {
        atomics::decrement(global);
        source_counts::give_back(counted, per_source, 1);
        return refuse_at_ack(Blame::Source(source), Reason::ConnTotal, scope);
    }
    // The SYN rate's token last, once the slots are sure: a handshake the caps refuse spends
    // none, and the token, unlike a slot, cannot be given back.
    if let Err(bucket) = take_token(counted, own.rate, scope.config) {
        offense(source, flow.last_seen_ns, scope.config, !enforce);
        if enforce {
            atomics::decrement(global);
            source_counts::give_back(counted, per_source, 1);
            return refuse_at_ack(Blame::Bucket(bucket), Reason::SynRate, scope);
        }
    }
    // The connection rate after the source's own token: a source past its SYN rate spends
    // nobody else's connections (and if the rate refuses it, only its own token is lost).
    let rate = Gcra::connections(scope.limits);
    if rate.limited()
        && let Some(tat) = CONN_RATE.get_ptr_mut(scope.profile)
        && rate.take_shared(tat, rate_now()).is_err()
        && enforce
    {
        atomics::decrement(global);
        source_counts::give_back(counted, per_source, 1);
        return refuse_at_ack(Blame::Source(source), Reason::ConnRate, scope);
    }
    match FLOWS.insert(key, flow, aya_ebpf::bindings::BPF_NOEXIST.into()) {
        Ok(()) => {
            hold(counted, scope.config, 1);
            event(Event::Opened);
            Completion::Admitted
        }
        Err(error) => {
            atomics::decrement(global);
            source_counts::give_back(counted, per_source, 1);
            if error == -EEXIST {
                // The 4-tuple is tracked already: a new connection reusing a closing one's.
                // It takes over the old one's slot, open again.
                if let Some(tracked) = FLOWS.get_ptr_mut(key) {
                    // SAFETY: pointer from a successful lookup; plain words besides the state.
                    unsafe {
                        atomics::fetch_and(
                            &mut (*tracked).state,
                            !(flow_state::FIN_BOTH | flow_state::RST_IN),
                        );
                        (*tracked).first_seen_ns = flow.first_seen_ns;
                    }
                }
                Completion::NotAHandshake
            } else {
                full_at_ack(source, scope)
            }
        }
    }
}

/// A proven handshake of `source` refused (or, `monitored`, judged refusable) over its own
/// cap or SYN rate, at `now`: for kernel escalation, its streak of such refusals in
/// `OFFENDERS` grows, or starts again after a pause longer than the config's gap; a streak
/// with a monitored refusal in it is marked, so that it bans nobody. Only a completed
/// handshake gets here, so no forged frame can make a source an offender. Plain writes:
/// racing CPUs can lose a count, which only delays a ban.
#[inline(always)]
fn offense(source: &SourceKey, now: u64, config: &Config, monitored: bool) {
    let gap = config.offense_gap_ns;
    if gap == 0 {
        return;
    }
    let Some(entry) = map_access::get_or_insert(&OFFENDERS, source, &NO_OFFENSE) else {
        return;
    };
    // SAFETY: a pointer from a successful lookup; plain words.
    unsafe {
        if (*entry).refusals == 0 || now.saturating_sub((*entry).last_ns) > gap {
            (*entry).first_ns = now;
            (*entry).refusals = 0;
            (*entry).monitored = 0;
        }
        (*entry).last_ns = now;
        (*entry).refusals += 1;
        if monitored {
            (*entry).monitored = 1;
        }
    }
}

/// A source's streak before its first refusal (a static, as [`NO_REFUSALS`] is).
static NO_OFFENSE: Offense = Offense {
    first_ns: 0,
    last_ns: 0,
    refusals: 0,
    monitored: 0,
};

/// Takes the SYN rate's token for a proven handshake of `counted`; `Err` with its bucket if
/// the bucket ran dry (other handshakes of the source completed since its SYN was let
/// through).
#[inline(always)]
fn take_token(counted: &ProfileSource, rate: Gcra, config: &Config) -> Result<(), *mut SynBucket> {
    if !rate.limited() {
        return Ok(());
    }
    let place = bucket_place(counted, config.bucket_seed, config.bucket_mask);
    let Some(bucket) = SYN_BUCKETS.get_ptr_mut(place.slot) else {
        return Ok(());
    };
    // SAFETY: pointer from a successful lookup.
    let word = atomics::load(unsafe { &(*bucket).tat_tag });
    rate.take(bucket, &counted.source, place.tag, word, rate_now())
        .map_err(|()| bucket)
}

/// A completed handshake over a cap: another connection of the source (or of the host) took
/// the last slot between this one's SYN and its ACK. The ACK becomes a RST to the host. In
/// monitor mode (only a flow table too busy or full gets here then) it passes untracked.
#[inline(always)]
fn refuse_at_ack(blame: Blame, reason: Reason, scope: Scope) -> Completion {
    if scope.limits.monitor != 0 {
        would_refuse(reason, scope.profile);
        return Completion::Refused(Action::Pass);
    }
    // Always a new attempt: only the ACK that deleted the half-open entry gets here.
    refused_attempt(blame, reason, None, scope.profile);
    count(Direction::Ingress, Verdict::Rst, reason);
    event(Event::RefusedAtAck);
    Completion::Refused(Action::ResetHost)
}

/// A completed handshake that finds a per-source or flow table full.
#[inline(always)]
fn full_at_ack(source: &SourceKey, scope: Scope) -> Completion {
    if scope.config.fail_closed != 0 {
        refuse_at_ack(Blame::Source(source), Reason::FlowTableFull, scope)
    } else {
        count(Direction::Ingress, Verdict::Pass, Reason::FlowTableFull);
        Completion::Refused(Action::Pass)
    }
}

/// Enters a connection the host has established but the flow table lacks, and takes its
/// slots, for the agent (`limiter_adopt`): the host's socket table is the truth, and a
/// connection nothing counted would let its source past its cap. It got there unjudged at its
/// ACK: it was open before the programs were attached, its half-open record was evicted by a
/// flood or swept after `syn-timeout` while the client held its ACK back, or its source was
/// allowlisted when it connected. The slots are taken, in its port's profile, even past a cap
/// (the connection exists); [`helper::OVER_CAP`] tells the agent so. A 4-tuple tracked
/// already, a port not protected or an allowlisted source is left alone.
#[inline(always)]
pub fn adopt(key: &FlowKey) -> u32 {
    let config = map_access::config();
    let ipv6 = key.remote[..12] != V4_MAPPED;
    let Some(profile) = profile_of(config, key.local_port) else {
        return helper::ABSENT;
    };
    if config.has_allow != 0 && listed_address(&key.remote, ipv6, true) {
        return helper::ABSENT;
    }
    let scope = Scope::of(config, profile);
    let now = now();
    let flow = Flow {
        first_seen_ns: now,
        last_seen_ns: now,
        counted: ProfileSource::new(
            source_key(&key.remote, config.ipv4_prefix, config.ipv6_prefix),
            profile,
        ),
        state: flow_state::ESTABLISHED,
        _pad: 0,
    };
    let counted = &flow.counted;
    let Some(global) = GLOBAL_CONNS.get_ptr_mut(profile) else {
        return helper::ABSENT;
    };
    // The slots first, as at a handshake's ACK: a flow is never in the table without them, so
    // a RST closing it at once cannot release slots not yet taken. Whoever inserts the flow
    // keeps them: a racing handshake or a second adoption of the 4-tuple finds it there.
    let Taken::Slots {
        counter: per_source,
        before: per_source_before,
    } = source_counts::take(counted, 1)
    else {
        return helper::ABSENT;
    };
    let global_before = atomics::fetch_add(global, 1);
    if FLOWS
        .insert(key, flow, aya_ebpf::bindings::BPF_NOEXIST.into())
        .is_err()
    {
        atomics::decrement(global);
        source_counts::give_back(counted, per_source, 1);
        return helper::ABSENT;
    }
    hold(counted, config, 1);
    event(Event::Opened);
    let over = |before: u64, cap: u32| cap != 0 && before >= u64::from(cap);
    if over(per_source_before, PerSource::of(&counted.source, scope).cap)
        || over(global_before, scope.limits.max_conn_total)
    {
        helper::OVER_CAP
    } else {
        helper::DONE
    }
}

/// The host's RST (egress) closes a tracked flow. A RST from outside (ingress) only marks it
/// ([`flow_state::RST_IN`]): XDP cannot tell whether the host will accept it (a forged RST
/// outside the window, or one with a bad checksum, the host discards), so releasing on it
/// would let anyone who guesses a 4-tuple discount another client's connection, or a client
/// its own. The sweeper releases the flow once the host's socket is gone.
#[inline(never)]
fn reset(seg: &Segment, direction: Direction) -> Action {
    let key = match direction {
        Direction::Ingress => inbound(seg),
        Direction::Egress => outbound(seg),
    };
    let Some(flow) = FLOWS.get_ptr_mut(key) else {
        return pass(direction, Reason::Untracked);
    };
    match direction {
        Direction::Ingress => {
            // SAFETY: pointer from a successful lookup; the field is a plain word.
            atomics::fetch_or(unsafe { &mut (*flow).state }, flow_state::RST_IN);
        }
        Direction::Egress => {
            close(&key, flow, Event::ClosedRst);
        }
    }
    pass(direction, Reason::Tracked)
}

/// A FIN sets its direction's bit; the host's FIN that completes both closes the flow. A
/// client's FIN never closes it, for the reason a client's RST does not (see [`reset`]): the
/// sweeper releases a flow whose FINs the host answered first once its socket is gone.
#[inline(never)]
fn fin(key: &FlowKey, direction: Direction) -> Action {
    let Some(flow) = FLOWS.get_ptr_mut(key) else {
        return pass(direction, Reason::Untracked);
    };
    // SAFETY: pointer from a successful lookup; the field is a plain word.
    let state = unsafe { &mut (*flow).state };
    let mine = match direction {
        Direction::Ingress => flow_state::FIN_IN,
        Direction::Egress => flow_state::FIN_OUT,
    };
    let before = atomics::fetch_or(state, mine);
    // Only the host's FIN closes, and only the first that finds the client's already there.
    if direction == Direction::Egress && before & mine == 0 && before & flow_state::FIN_IN != 0 {
        close(key, flow, Event::ClosedFin);
    }
    pass(direction, Reason::Tracked)
}

/// Removes the flow and, if this call is the one whose delete succeeded, releases its slots
/// in the profile it was counted in.
#[inline(always)]
pub fn close(key: &FlowKey, flow: *mut Flow, why: Event) -> bool {
    // Read before the delete: a deleted element's memory can be reused at once.
    // SAFETY: pointer from a successful lookup.
    let counted = unsafe { (*flow).counted };
    if FLOWS.remove(key).is_err() {
        return false;
    }
    if source_counts::release(&counted, 1) {
        hold(&counted, map_access::config(), u64::MAX);
    }
    if let Some(global) = GLOBAL_CONNS.get_ptr_mut(counted.profile) {
        atomics::decrement(global);
    }
    event(why);
    true
}

/// Repairs a drifted counter by `delta` (two's complement), for the agent
/// (`limiter_adjust`): a profile's global count, or a source's in a profile and with it its
/// bucket slot's holders.
#[inline(always)]
pub fn adjust(counted: &ProfileSource, global: bool, delta: u64) -> u32 {
    if global {
        let Some(counter) = GLOBAL_CONNS.get_ptr_mut(counted.profile) else {
            return helper::ABSENT;
        };
        atomics::fetch_add(counter, delta);
        return helper::DONE;
    }
    // Zero removes the entry if it holds zero (the sweeper's idle sources, exactly).
    if delta == 0 {
        return if source_counts::retire_idle(counted) {
            helper::DONE
        } else {
            helper::ABSENT
        };
    }
    // Two's complement: a "negative" delta gives slots back, and may remove the entry.
    let adjusted = if (delta as i64) < 0 {
        source_counts::release(counted, delta.wrapping_neg())
    } else {
        matches!(source_counts::take(counted, delta), Taken::Slots { .. })
    };
    if !adjusted {
        return helper::ABSENT;
    }
    hold(counted, map_access::config(), delta);
    helper::DONE
}

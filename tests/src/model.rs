//! A plain-Rust reference model of the kernel policy (limiter-ebpf's `decide.rs`), written
//! from the code as it stands, for the differential test: the same frames go through the real
//! programs and through this model, and every verdict and counter must agree.
//!
//! Parsing is not modelled here: each frame's generator knows what it built, so it hands the
//! model either the segment or the reason the parser must refuse it with ([`Input`]). The
//! SYN rate's clock is the test's to set ([`Model::rate_now`]): it reads the same coarse
//! clock the program does around each frame. Bans are the test's to set and lift, as the
//! agent does ([`Model::ban`]); their expiry is on the boot clock, so a ban is either in force
//! for the whole run or expired when set. The ACK hint pre-filter is taken as exact (a false
//! positive only costs the kernel a lookup, so the verdict must not depend on it).
//! `HALF_OPEN` is an LRU; runs stay far below its size, so it behaves as a plain map here, and
//! so does `BLOCKED`. The SYN buckets are modelled whole: which source claimed a slot last
//! (at a completed handshake: a SYN only reads its bucket), its theoretical arrival time,
//! whether a slot's sources hold connections (the per-source precheck is skipped when none
//! do), and its source's refusals for the rate with the last refused SYNs that tell a
//! retransmission from a new attempt. The refused connection attempts are modelled too: by
//! profile and reason, and by source for the top-blocked lists. Port profiles are modelled in
//! the slots the maps gave them: each profile's limits, per-source counts, global count,
//! connection rate and SYN buckets apart.

use std::{
    collections::{HashMap, HashSet},
    net::{IpAddr, Ipv6Addr},
};

use limiter::datapath::Policy;
use limiter_common::{
    BUCKET_TAG_MASK, Blocked, BucketPlace, Config, Direction, Event, FlowKey, Limits,
    ProfileSource, Reason, Refusal, SEEN_ATTEMPTS, SeenAttempts, SourceKey, SourceLimits, Verdict,
    attempt_signature, bucket_place, flow_state, seen_slot, source_key, stats::stat_slot,
};

use crate::kernel::{XDP_DROP, XDP_PASS, XDP_TX};

const FIN: u8 = 0x01;
const SYN: u8 = 0x02;
const RST: u8 = 0x04;
const ACK: u8 = 0x10;

/// A TCP segment as the parser would read it.
#[derive(Clone, Copy, Debug)]
pub struct Segment {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
    pub seq: u32,
    pub ack: u32,
    /// The whole TCP flag byte.
    pub flags: u8,
    /// The first fragment of a fragmented datagram.
    pub fragment: bool,
}

/// What the parser makes of a frame.
#[derive(Clone, Copy, Debug)]
pub enum Input {
    Segment(Segment),
    Unparsed(Reason),
}

/// A half-open connection, recorded when the host's SYN-ACK left: its source key in its
/// port's profile, and the server's ISN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HalfOpen {
    pub counted: ProfileSource,
    pub isn: u32,
}

/// A SYN bucket slot.
#[derive(Clone, Copy, Debug, Default)]
pub struct Bucket {
    /// The tag of the source that claimed the slot last (0: none).
    pub tag: u64,
    /// That source's key.
    pub source: Option<SourceKey>,
    /// The theoretical arrival time of its next SYN, when a rate is set (rate clock ns).
    pub tat: u64,
    /// Refused for its rate since its last admission (not kernel state: the test counts the
    /// admissions after such a refusal, tokens that came back with time).
    pub ran_dry: bool,
    /// Connection attempts of that source refused for its rate.
    pub refused: u64,
    /// That source's last SYNs refused for its rate.
    pub seen: SeenAttempts,
    /// Connections held by the sources mapping to the slot.
    pub holders: u64,
}

/// A tracked connection: the source and profile charged, and its `flow_state` bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flow {
    pub counted: ProfileSource,
    pub state: u32,
}

/// The kernel's state as the policy leaves it; see the module doc for what is left out.
#[derive(Clone)]
pub struct Model {
    config: Config,
    policy: Policy,
    /// Each profile's slot, as the maps gave it, in the policy's order.
    slots: Vec<u32>,
    /// The SYN rate's clock (`CLOCK_MONOTONIC_COARSE` ns) at the next frame.
    pub rate_now: u64,
    /// The connection rate's TAT, every source's, by profile slot.
    pub conn_tat: HashMap<u32, u64>,
    /// Handshakes whose token came from a bucket that had refused its source for the rate
    /// before.
    pub refills: u64,
    /// Refused SYNs that repeated one of their record's last refused SYNs, so counted no
    /// new attempt (not kernel state: the test checks that the run had some).
    pub repeats: u64,
    /// Packets by `stat_slot(direction, verdict, reason)`.
    pub stats: HashMap<u32, u64>,
    /// Events by `Event as usize`.
    pub events: [u64; Event::COUNT],
    pub half_open: HashMap<FlowKey, HalfOpen>,
    /// By slot, only those a SYN or a connection touched.
    pub buckets: HashMap<u32, Bucket>,
    pub flows: HashMap<FlowKey, Flow>,
    /// Entries are created at a handshake's completion and removed when their count returns
    /// to zero, as in the kernel.
    pub source_conns: HashMap<ProfileSource, u64>,
    /// Open connections by profile slot.
    pub global: HashMap<u32, u64>,
    /// Refused connection attempts by `Reason::blocked_slot`, every profile's.
    pub refused_conns: [u64; Reason::REFUSAL_COUNT],
    /// By (profile slot, would): refused connection attempts, or with `would` the packets
    /// monitor mode let through, by `Reason::blocked_slot`.
    pub refusals: HashMap<(u32, bool), [u64; Reason::REFUSAL_COUNT]>,
    /// Refused connection attempts by source, but for the SYN rate's (counted in the buckets).
    pub blocked: HashMap<SourceKey, Blocked>,
    /// Kernel escalation: each source's refusals at its proven handshakes, over its cap or its
    /// SYN rate (the differential test sets no gap that would start a streak again), and
    /// whether one was only judged, in monitor mode.
    pub offenders: HashMap<SourceKey, (u64, bool)>,
    /// Source keys under a ban in force.
    bans: HashSet<SourceKey>,
}

/// What a packet to a protected port is judged by: its profile's slot and limits.
#[derive(Clone, Copy)]
struct Scope {
    profile: u32,
    limits: Limits,
}

/// Who a refused connection attempt is counted against.
#[derive(Clone, Copy)]
enum Blame {
    /// Its source, in `BLOCKED`.
    Source(SourceKey),
    /// The SYN bucket slot its source claimed (refused for the rate).
    Bucket(u32),
}

/// What the XDP program returns for a policy decision.
enum Action {
    Pass,
    Drop,
    Rst,
    ResetHost,
}

/// IPv4 as `::ffff:a.b.c.d`, as the parser keys everything.
pub fn mapped(addr: IpAddr) -> [u8; 16] {
    match addr {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// The connection a segment belongs to: `inbound` for the client's segments, else the host's.
pub fn flow_key(seg: &Segment, inbound: bool) -> FlowKey {
    let (remote, local, remote_port, local_port) = if inbound {
        (seg.src, seg.dst, seg.sport, seg.dport)
    } else {
        (seg.dst, seg.src, seg.dport, seg.sport)
    };
    FlowKey {
        remote: mapped(remote),
        local: mapped(local),
        remote_port,
        local_port,
        _pad: 0,
    }
}

impl Model {
    /// The model of `policy`, hashing sources to bucket slots as the `live` config does, its
    /// profiles in the slots the maps gave them (`held`: slot and name).
    pub fn new(policy: &Policy, live: &Config, held: &[(u32, String)]) -> Self {
        let slots = policy
            .profiles
            .iter()
            .map(|p| {
                held.iter()
                    .find(|(_, name)| *name == p.name)
                    .map(|(slot, _)| *slot)
                    .expect("every profile in a slot")
            })
            .collect();
        Self {
            config: Config {
                bucket_mask: live.bucket_mask,
                bucket_seed: live.bucket_seed,
                ..policy.config()
            },
            policy: policy.clone(),
            slots,
            rate_now: 0,
            conn_tat: HashMap::new(),
            refills: 0,
            repeats: 0,
            stats: HashMap::new(),
            events: [0; Event::COUNT],
            half_open: HashMap::new(),
            buckets: HashMap::new(),
            flows: HashMap::new(),
            source_conns: HashMap::new(),
            global: HashMap::new(),
            refused_conns: [0; Reason::REFUSAL_COUNT],
            refusals: HashMap::new(),
            blocked: HashMap::new(),
            offenders: HashMap::new(),
            bans: HashSet::new(),
        }
    }

    /// The source key of `addr` under the configured prefixes.
    pub fn source(&self, addr: IpAddr) -> SourceKey {
        source_key(
            &mapped(addr),
            self.config.ipv4_prefix,
            self.config.ipv6_prefix,
        )
    }

    /// Bans `addr`'s source: `in_force` for longer than the run, else already expired, which
    /// replaces a ban in force and refuses nothing.
    pub fn ban(&mut self, addr: IpAddr, in_force: bool) {
        let source = self.source(addr);
        if in_force {
            self.bans.insert(source);
        } else {
            self.bans.remove(&source);
        }
    }

    /// Lifts the ban on `addr`'s source, if any.
    pub fn unban(&mut self, addr: IpAddr) {
        let source = self.source(addr);
        self.bans.remove(&source);
    }

    /// A frame arriving: returns the XDP action the program must give it.
    pub fn xdp(&mut self, input: &Input) -> u32 {
        let action = match input {
            Input::Unparsed(reason) => self.unparsed(Direction::Ingress, *reason),
            Input::Segment(seg) => self.ingress(seg),
        };
        match action {
            Action::Pass | Action::ResetHost => XDP_PASS,
            Action::Drop => XDP_DROP,
            // Marked for TC ingress, which answers it, unless answered by XDP_TX.
            Action::Rst if self.config.rst_xdp_tx == 0 => XDP_PASS,
            Action::Rst => XDP_TX,
        }
    }

    /// A frame leaving through TC egress (whose action is always `TC_ACT_OK`).
    pub fn tc(&mut self, input: &Input) {
        match input {
            Input::Unparsed(reason) => {
                self.unparsed(Direction::Egress, *reason);
            }
            Input::Segment(seg) => self.egress(seg),
        }
    }

    fn count(&mut self, direction: Direction, verdict: Verdict, reason: Reason) {
        *self
            .stats
            .entry(stat_slot(direction, verdict, reason))
            .or_default() += 1;
    }

    fn event(&mut self, event: Event) {
        self.events[event as usize] += 1;
    }

    fn pass(&mut self, direction: Direction, reason: Reason) -> Action {
        self.count(direction, Verdict::Pass, reason);
        Action::Pass
    }

    fn unparsed(&mut self, direction: Direction, reason: Reason) -> Action {
        let passes = match reason {
            Reason::NonIp | Reason::NonTcp => true,
            Reason::Tunnel => self.config.tunnels_pass != 0,
            _ => false,
        };
        if direction == Direction::Ingress && !passes {
            self.count(direction, Verdict::Drop, reason);
            return Action::Drop;
        }
        self.pass(direction, reason)
    }

    /// The profile a local port belongs to, if it is protected: its slot and limits.
    fn scope_of(&self, port: u16) -> Option<Scope> {
        let profile = self.policy.profile_of(port)?;
        Some(match profile {
            None => Scope {
                profile: 0,
                limits: self.config.limits,
            },
            Some(p) => {
                let index = self.policy.profiles.iter().position(|q| q.name == p.name);
                Scope {
                    profile: self.slots[index.expect("a profile of the policy")],
                    limits: p.limits,
                }
            }
        })
    }

    /// Only a SYN counts as a refused connection attempt; a copy of one of the blamed
    /// record's last refused SYNs is a retransmission and counts nothing.
    /// In monitor mode (the profile's) the packet is only counted as `would_refuse`, and
    /// passes.
    fn refuse(
        &mut self,
        seg: &Segment,
        blame: Blame,
        reason: Reason,
        mode: u8,
        scope: Scope,
    ) -> Action {
        if scope.limits.monitor != 0 {
            self.would_refuse(reason, scope.profile);
            return Action::Pass;
        }
        if is_syn(seg.flags) {
            self.refused_attempt(blame, reason, Some(signature(seg)), scope.profile);
        }
        if Refusal::from_u8(mode) == Refusal::Rst && is_syn(seg.flags) {
            self.count(Direction::Ingress, Verdict::Rst, reason);
            Action::Rst
        } else {
            self.count(Direction::Ingress, Verdict::Drop, reason);
            Action::Drop
        }
    }

    fn would_refuse(&mut self, reason: Reason, profile: u32) {
        self.count(Direction::Ingress, Verdict::WouldRefuse, reason);
        if let Some(slot) = reason.blocked_slot() {
            self.refusals
                .entry((profile, true))
                .or_insert([0; Reason::REFUSAL_COUNT])[slot] += 1;
        }
    }

    /// A refused connection attempt: `syn` is the refused SYN's signature, `None` for a
    /// handshake refused at its ACK (always a new attempt).
    fn refused_attempt(&mut self, blame: Blame, reason: Reason, syn: Option<u32>, profile: u32) {
        let Some(slot) = reason.blocked_slot() else {
            return;
        };
        let (counter, seen) = match blame {
            Blame::Source(source) => {
                let blocked = self.blocked.entry(source).or_default();
                (&mut blocked.counts[slot], &mut blocked.seen)
            }
            Blame::Bucket(place) => {
                let bucket = self.buckets.entry(place).or_default();
                (&mut bucket.refused, &mut bucket.seen)
            }
        };
        if let Some(signature) = syn {
            let remembered = &mut seen[seen_slot(signature)];
            if *remembered == signature {
                self.repeats += 1;
                return;
            }
            *remembered = signature;
        }
        *counter += 1;
        self.refused_conns[slot] += 1;
        self.refusals
            .entry((profile, false))
            .or_insert([0; Reason::REFUSAL_COUNT])[slot] += 1;
    }

    fn ingress(&mut self, seg: &Segment) -> Action {
        let Some(scope) = self.scope_of(seg.dport) else {
            return self.pass(Direction::Ingress, Reason::UnprotectedPort);
        };
        if seg.fragment {
            self.count(Direction::Ingress, Verdict::Drop, Reason::Fragment);
            return Action::Drop;
        }
        if self.policy.allow.iter().any(|net| net.contains(&seg.src)) {
            return self.pass(Direction::Ingress, Reason::Allowlisted);
        }
        let source = self.source(seg.src);
        // Monitor mode judges a barred source's SYN; its other packets go on as anyone's.
        let barred_judged = scope.limits.monitor == 0 || is_syn(seg.flags);
        if barred_judged && self.policy.deny.iter().any(|net| net.contains(&seg.src)) {
            let blame = Blame::Source(source);
            let mode = self.config.reject_deny;
            return self.refuse(seg, blame, Reason::Denylisted, mode, scope);
        }
        if barred_judged && self.bans.contains(&source) {
            let mode = self.config.reject_ban;
            return self.refuse(seg, Blame::Source(source), Reason::Banned, mode, scope);
        }
        if is_syn(seg.flags) {
            return self.syn(seg, scope);
        }
        if seg.flags & RST != 0 {
            return self.reset(&flow_key(seg, true), Direction::Ingress);
        }
        let mut admitted = false;
        if seg.flags & ACK != 0 && seg.flags & SYN == 0 {
            match self.complete(seg) {
                Some(Completion::Admitted) => admitted = true,
                Some(Completion::Refused) => return Action::ResetHost,
                None => {}
            }
        }
        if seg.flags & FIN != 0 {
            return self.fin(&flow_key(seg, true), Direction::Ingress);
        }
        if admitted {
            return self.pass(Direction::Ingress, Reason::Admitted);
        }
        // Plain segments of connections pass uncounted.
        Action::Pass
    }

    fn egress(&mut self, seg: &Segment) {
        let Some(scope) = self.scope_of(seg.sport) else {
            self.pass(Direction::Egress, Reason::UnprotectedPort);
            return;
        };
        let key = flow_key(seg, false);
        if seg.flags & (SYN | ACK | RST) == SYN | ACK {
            // Only admitted SYNs get a SYN-ACK, besides allowlisted sources' (untracked).
            if self.policy.allow.iter().any(|net| net.contains(&seg.dst)) {
                self.pass(Direction::Egress, Reason::Untracked);
                return;
            }
            let half_open = HalfOpen {
                counted: ProfileSource::new(self.source(seg.dst), scope.profile),
                isn: seg.seq,
            };
            self.half_open.insert(key, half_open);
            self.pass(Direction::Egress, Reason::Tracked);
        } else if seg.flags & RST != 0 {
            self.reset(&key, Direction::Egress);
        } else if seg.flags & FIN != 0 {
            self.fin(&key, Direction::Egress);
        } else {
            self.pass(Direction::Egress, Reason::Segment);
        }
    }

    /// The per-source cap and SYN rate `source` is held to: those of the most specific
    /// override covering its key, else its profile's.
    fn own(&self, source: &SourceKey, limits: &Limits) -> (u64, Option<Rate>) {
        let ip = Ipv6Addr::from(source.addr);
        let addr = ip.to_ipv4_mapped().map_or(IpAddr::V6(ip), IpAddr::V4);
        let covering = self
            .policy
            .overrides
            .iter()
            .filter(|o| o.net.contains(&addr))
            .max_by_key(|o| o.net.prefix_len());
        let profile = (limits.max_conn_per_ip, limits.syn_rate, limits.syn_burst);
        // A field the override leaves out is the profile's; a burst without a rate of its own
        // is the burst of the profile's rate.
        let (cap, rate, burst) = match covering {
            Some(o) => {
                let own = |field: u32, profile: u32| SourceLimits::own(field).unwrap_or(profile);
                let rate = own(o.limits.syn_rate, profile.1);
                let burst = match SourceLimits::own(o.limits.syn_rate) {
                    Some(_) => o.limits.syn_burst,
                    None => own(o.limits.syn_burst, profile.2),
                };
                (own(o.limits.max_conn_per_ip, profile.0), rate, burst)
            }
            None => profile,
        };
        (u64::from(cap), Rate::new(rate, burst))
    }

    /// The limits of a profile slot (the top level's for 0).
    fn limits_of(&self, profile: u32) -> Limits {
        match self.slots.iter().position(|slot| *slot == profile) {
            Some(index) => self.policy.profiles[index].limits,
            None => self.config.limits,
        }
    }

    fn place(&self, counted: &ProfileSource) -> BucketPlace {
        bucket_place(counted, self.config.bucket_seed, self.config.bucket_mask)
    }

    fn syn(&mut self, seg: &Segment, scope: Scope) -> Action {
        // The rate first, on the source's own bucket alone, read and never written: the token
        // is taken when the handshake completes; then the caps as they stand (the source's
        // count only if its slot's sources hold connections). A tracked 4-tuple is not looked
        // at (see `complete`).
        let source = self.source(seg.src);
        let counted = ProfileSource::new(source, scope.profile);
        let place = self.place(&counted);
        let bucket = self.buckets.get(&place.slot).copied().unwrap_or_default();
        // The slot is the source's while its tag is there; sources sharing slot and tag share
        // the bucket. Another source's slot is a full bucket.
        let (per_ip, rate) = self.own(&source, &scope.limits);
        // Kernel escalation: over its own cap or rate, the SYN goes on, to be refused at its
        // proven handshake.
        let defer = self.config.offense_gap_ns != 0 && scope.limits.monitor == 0;
        let per_ip = if defer { 0 } else { per_ip };
        if let Some(rate) = rate
            && !defer
            && bucket.tag == place.tag
            && rate.admit(bucket.tat, self.rate_now).is_none()
        {
            self.buckets.entry(place.slot).or_default().ran_dry = true;
            let blame = Blame::Bucket(place.slot);
            let mode = scope.limits.reject_rate;
            return self.refuse(seg, blame, Reason::SynRate, mode, scope);
        }
        let total = u64::from(scope.limits.max_conn_total);
        let global = self.global.get(&scope.profile).copied().unwrap_or(0);
        if per_ip != 0
            && bucket.holders != 0
            && self
                .source_conns
                .get(&counted)
                .is_some_and(|n| *n >= per_ip)
        {
            let blame = Blame::Source(source);
            let mode = scope.limits.reject_conn;
            return self.refuse(seg, blame, Reason::ConnPerIp, mode, scope);
        }
        if total != 0 && global >= total {
            let blame = Blame::Source(source);
            let mode = scope.limits.reject_conn;
            return self.refuse(seg, blame, Reason::ConnTotal, mode, scope);
        }
        // The connection rate, peeked at: spent, the SYN is refused at once.
        let tat = self.conn_tat.get(&scope.profile).copied().unwrap_or(0);
        if let Some(rate) = Rate::connections(&scope.limits)
            && rate.admit(tat, self.rate_now).is_none()
        {
            let blame = Blame::Source(source);
            let mode = scope.limits.reject_rate;
            return self.refuse(seg, blame, Reason::ConnRate, mode, scope);
        }
        self.pass(Direction::Ingress, Reason::HalfOpen)
    }

    /// Takes a proven handshake's token from `counted`'s bucket, claiming the slot (a full
    /// bucket) if another source's tag is there; `Err` with the slot if it ran dry.
    fn take_token(&mut self, counted: ProfileSource, limits: &Limits) -> Result<(), u32> {
        let Some(rate) = self.own(&counted.source, limits).1 else {
            return Ok(());
        };
        let place = self.place(&counted);
        let now = self.rate_now;
        let entry = self.buckets.entry(place.slot).or_default();
        if entry.tag != place.tag {
            entry.tag = place.tag;
            entry.source = Some(counted.source);
            entry.tat = 0;
            entry.ran_dry = false;
            entry.refused = 0;
            entry.seen = [0; SEEN_ATTEMPTS];
        }
        entry.tat = rate.admit(entry.tat, now).ok_or(place.slot)? & !BUCKET_TAG_MASK;
        if entry.ran_dry {
            entry.ran_dry = false;
            self.refills += 1;
        }
        Ok(())
    }

    /// Takes a profile's connection rate's token; `Err` if it ran dry.
    fn take_connection(&mut self, profile: u32, limits: &Limits) -> Result<(), ()> {
        if let Some(rate) = Rate::connections(limits) {
            let tat = self.conn_tat.entry(profile).or_default();
            *tat = rate.admit(*tat, self.rate_now).ok_or(())?;
        }
        Ok(())
    }

    /// An ACK that may complete a handshake; `None` if it completes none.
    fn complete(&mut self, seg: &Segment) -> Option<Completion> {
        let key = flow_key(seg, true);
        let entry = *self.half_open.get(&key)?;
        if entry.isn.wrapping_add(1) != seg.ack {
            return None;
        }
        self.half_open.remove(&key);
        let counted = entry.counted;
        let profile = counted.profile;
        let limits = self.limits_of(profile);
        let per_source = *self.source_conns.entry(counted).or_default();
        let per_ip = self.own(&counted.source, &limits).0;
        let total = u64::from(limits.max_conn_total);
        let global = self.global.get(&profile).copied().unwrap_or(0);
        // Monitor mode admits past the caps and the rates, taking what tokens there are (its
        // SYN counted the refusal enforce mode would have made).
        let enforce = limits.monitor == 0;
        let over_cap = per_ip != 0 && per_source >= per_ip;
        if over_cap {
            self.offense(counted.source, !enforce);
        }
        let refused = if !enforce {
            None
        } else if over_cap {
            Some(Reason::ConnPerIp)
        } else if total != 0 && global >= total {
            Some(Reason::ConnTotal)
        } else {
            None
        };
        let refused = match refused {
            Some(reason) => Some((Blame::Source(counted.source), reason)),
            // The tokens last, once the slots are sure: the source's, then every source's.
            None => match self.take_token(counted, &limits) {
                Err(slot) if enforce => {
                    self.offense(counted.source, false);
                    Some((Blame::Bucket(slot), Reason::SynRate))
                }
                result => {
                    if result.is_err() {
                        self.offense(counted.source, true);
                    }
                    self.take_connection(profile, &limits)
                        .err()
                        .filter(|()| enforce)
                        .map(|()| (Blame::Source(counted.source), Reason::ConnRate))
                }
            },
        };
        if let Some((blame, reason)) = refused {
            self.refused_attempt(blame, reason, None, profile);
            self.count(Direction::Ingress, Verdict::Rst, reason);
            self.event(Event::RefusedAtAck);
            return Some(Completion::Refused);
        }
        if let Some(flow) = self.flows.get_mut(&key) {
            // The 4-tuple is tracked already: a new connection reusing a closing one's takes
            // over its slot, open again.
            flow.state &= !(flow_state::FIN_BOTH | flow_state::RST_IN);
            return None;
        }
        *self.source_conns.entry(counted).or_default() += 1;
        *self.global.entry(profile).or_default() += 1;
        let slot = self.place(&counted).slot;
        self.buckets.entry(slot).or_default().holders += 1;
        let flow = Flow {
            counted,
            state: flow_state::ESTABLISHED,
        };
        self.flows.insert(key, flow);
        self.event(Event::Opened);
        Some(Completion::Admitted)
    }

    /// A proven handshake refused (or, `monitored`, judged refusable) over its source's own
    /// cap or rate: with kernel escalation on, the source's streak grows.
    fn offense(&mut self, source: SourceKey, monitored: bool) {
        if self.config.offense_gap_ns != 0 {
            let streak = self.offenders.entry(source).or_default();
            streak.0 += 1;
            streak.1 |= monitored;
        }
    }

    /// The host's RST closes a flow; a client's only marks it (the host may discard it).
    fn reset(&mut self, key: &FlowKey, direction: Direction) -> Action {
        let Some(flow) = self.flows.get_mut(key) else {
            return self.pass(direction, Reason::Untracked);
        };
        match direction {
            Direction::Ingress => flow.state |= flow_state::RST_IN,
            Direction::Egress => self.close(key, Event::ClosedRst),
        }
        self.pass(direction, Reason::Tracked)
    }

    fn fin(&mut self, key: &FlowKey, direction: Direction) -> Action {
        let Some(flow) = self.flows.get_mut(key) else {
            return self.pass(direction, Reason::Untracked);
        };
        let mine = match direction {
            Direction::Ingress => flow_state::FIN_IN,
            Direction::Egress => flow_state::FIN_OUT,
        };
        let before = flow.state;
        flow.state |= mine;
        // Only the host's FIN closes, once the client's is there.
        if direction == Direction::Egress && before & mine == 0 && before & flow_state::FIN_IN != 0
        {
            self.close(key, Event::ClosedFin);
        }
        self.pass(direction, Reason::Tracked)
    }

    /// Removes the flow and releases its slots in its profile, once.
    fn close(&mut self, key: &FlowKey, why: Event) {
        let Some(flow) = self.flows.remove(key) else {
            return;
        };
        if let Some(n) = self.source_conns.get_mut(&flow.counted) {
            *n -= 1;
            if *n == 0 {
                self.source_conns.remove(&flow.counted);
            }
            let slot = self.place(&flow.counted).slot;
            self.buckets.entry(slot).or_default().holders -= 1;
        }
        *self.global.entry(flow.counted.profile).or_default() -= 1;
        self.event(why);
    }

    /// Whether a SYN or connection rate is set anywhere: the TATs mean something only then.
    pub fn rated(&self) -> bool {
        let rated = |l: &Limits| l.syn_rate != 0 || l.conn_rate != 0;
        rated(&self.config.limits)
            || self.policy.profiles.iter().any(|p| rated(&p.limits))
            || self
                .policy
                .overrides
                .iter()
                .any(|o| SourceLimits::own(o.limits.syn_rate).is_some_and(|rate| rate != 0))
    }

    /// The top-blocked counts as the agent reads them: `BLOCKED`, with each claimed bucket's
    /// refusals added to its source's `syn_rate` count.
    pub fn top_blocked(&self) -> HashMap<SourceKey, Blocked> {
        let mut all = self.blocked.clone();
        let rate = Reason::SynRate
            .blocked_slot()
            .expect("the SYN rate is a refusal");
        for bucket in self.buckets.values() {
            if let Some(source) = bucket.source
                && bucket.refused > 0
            {
                all.entry(source).or_default().counts[rate] += bucket.refused;
            }
        }
        all
    }

    /// Open connections charged to `addr`'s source in profile slot `profile` (0 if it never
    /// had one).
    pub fn source_connections(&self, addr: IpAddr, profile: u32) -> u64 {
        self.source_conns
            .get(&ProfileSource::new(self.source(addr), profile))
            .copied()
            .unwrap_or(0)
    }

    /// Open connections of profile slot `profile`.
    pub fn connections(&self, profile: u32) -> u64 {
        self.global.get(&profile).copied().unwrap_or(0)
    }
}

enum Completion {
    Admitted,
    Refused,
}

/// The SYN rate as README states it: `syn_rate` SYNs a second per source after a burst of
/// `syn_burst`, as GCRA over the theoretical arrival time (TAT) of the source's next SYN, which
/// the slot keeps to 256 ns, rounded down (its low bits hold the claiming source's tag). The
/// connection rate likewise, over all sources, its TAT kept whole.
#[derive(Clone, Copy)]
struct Rate {
    interval: u64,
    burst: u64,
}

impl Rate {
    fn new(rate: u32, burst: u32) -> Option<Rate> {
        (rate != 0).then(|| Rate {
            interval: 1_000_000_000 / u64::from(rate),
            burst: u64::from(burst.max(1)),
        })
    }

    fn connections(limits: &Limits) -> Option<Rate> {
        Rate::new(limits.conn_rate, limits.conn_burst)
    }

    /// The TAT a SYN at `now` leaves if the bucket holds a token for it: one whose TAT, one
    /// interval on, is at most the burst's worth of intervals ahead of now.
    fn admit(self, tat: u64, now: u64) -> Option<u64> {
        let next = tat.max(now) + self.interval;
        (next - now <= self.burst * self.interval).then_some(next)
    }
}

/// What tells a SYN from another connection attempt: its 4-tuple and sequence number.
fn signature(seg: &Segment) -> u32 {
    attempt_signature(
        &mapped(seg.src),
        &mapped(seg.dst),
        seg.sport,
        seg.dport,
        seg.seq,
    )
}

/// A connection request: SYN without ACK or RST.
fn is_syn(flags: u8) -> bool {
    flags & (SYN | ACK | RST) == SYN
}

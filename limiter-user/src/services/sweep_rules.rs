//! The sweeper's decisions, apart from the maps, socket dumps and clocks they are made from:
//! which flows to release, which established connections to adopt and which of those to
//! close, and which counters to repair. Kept pure so each rule can be tested without root,
//! and so the I/O shell in `sweeper` cannot bend a rule by the order it reads things in.

use std::{collections::HashMap, net::Ipv6Addr, time::Duration};

use ipnet::IpNet;
use limiter_common::{AdjustRequest, FlowKey, ProfileSource};

use crate::{
    datapath::{Adoption, local_routes::LocalAddresses},
    duration_units::duration_ns,
};

/// How long a new flow may go without a socket: the programs insert the flow as the
/// handshake's last ACK passes, a moment before the host makes the socket.
pub const SOCKET_GRACE: Duration = Duration::from_secs(1);

/// What the host's socket table says of a flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketView {
    /// The table speaks for the flow (its port is served here) and holds its socket.
    Open,
    /// The table speaks for the flow and holds no socket for it.
    Missing,
    /// The table cannot speak for it: unreadable, or the port is served elsewhere (a broker
    /// in another namespace behind the protected interface).
    Silent,
}

/// Why a flow is released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    Closed,
    Idle,
}

/// Whether to release a flow last seen at `last_seen_ns`, at boot time `now` (ns). The socket
/// table is the truth where it speaks: a flow whose socket exists is kept however idle, since
/// an idle connection still holds its slot on the host. `idle_timeout` is the only evidence
/// left where it is silent.
pub fn judge_flow(
    socket: SocketView,
    now: u64,
    last_seen_ns: u64,
    idle_timeout: Option<Duration>,
) -> Option<Release> {
    match socket {
        SocketView::Open => None,
        SocketView::Missing => {
            older_than(now, last_seen_ns, SOCKET_GRACE).then_some(Release::Closed)
        }
        SocketView::Silent => idle_timeout
            .is_some_and(|idle| older_than(now, last_seen_ns, idle))
            .then_some(Release::Idle),
    }
}

fn older_than(now: u64, then: u64, age: Duration) -> bool {
    now.saturating_sub(then) > duration_ns(age)
}

/// Whether an established connection is worth a run of the adoption helper. The kernel
/// checks the port and the allowlist again; checked here too (`protects`: whether a local
/// port is protected), so that a busy unprotected service or many allowlisted clients cost no
/// helper run per pass. `came_in` is asked last, and only of a connection that passed every
/// other test, since it may cost a route lookup.
pub fn adoption_candidate(
    flow: &FlowKey,
    known: bool,
    protects: impl FnOnce(u16) -> bool,
    allow: &[IpNet],
    came_in: impl FnOnce(&FlowKey) -> bool,
) -> bool {
    let remote = Ipv6Addr::from(flow.remote).to_canonical();
    let counted =
        !known && protects(flow.local_port) && !allow.iter().any(|net| net.contains(&remote));
    counted && came_in(flow)
}

/// Whether a connection came in through the programs from another host. One between two of
/// the host's own addresses never left it, and the programs never saw it: counting it would
/// let a local user fill the global cap. From a peer elsewhere to any local address it did
/// when the host's way back to the peer (`route_out`, an ifindex) leaves through one of the
/// `protected` interfaces, since XDP judges what arrives there for any local address, whatever
/// interface or alias holds it. `route_out` is asked only of such a peer.
pub fn came_in(
    flow: &FlowKey,
    local: &LocalAddresses,
    protected: &[u32],
    route_out: impl FnOnce(&[u8; 16]) -> Option<u32>,
) -> bool {
    local.contains(&flow.local)
        && !local.contains(&flow.remote)
        && route_out(&flow.remote).is_some_and(|out| protected.contains(&out))
}

/// Whether an adopted connection is closed. Before the sweeper's first pass has run
/// (`settled`), a connection past a cap was open before the agent started and the programs
/// never had the chance to refuse it: closing it would punish clients for a restart. After
/// it, such a connection got past the programs unjudged, which they would have refused. In
/// monitor mode (`monitoring`) nothing is refused, so nothing is closed either.
pub fn destroys(adoption: Adoption, settled: bool, monitoring: bool) -> bool {
    adoption == Adoption::OverCap && settled && !monitoring
}

/// What kernel escalation makes of a source's streak of refusals at its proven handshakes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Streak {
    /// Refused for this long, past `refused_for`: ban it.
    Escalate(Duration),
    /// Paused past the gap that ends a streak short of it: forget it.
    Over,
    /// Still short of it, and going on.
    Going,
}

/// Judges a streak (`first_ns` to `last_ns`, boot time) at `now` against `refused_for`.
pub fn judge_streak(first_ns: u64, last_ns: u64, now: u64, refused_for: Duration) -> Streak {
    let span = last_ns.saturating_sub(first_ns);
    if span >= duration_ns(refused_for) {
        Streak::Escalate(Duration::from_nanos(span))
    } else if older_than(now, last_ns, crate::settings::defaults::OFFENSE_GAP) {
        Streak::Over
    } else {
        Streak::Going
    }
}

/// A connection counter: a source's in a profile, or a profile's global one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Counter {
    Source(ProfileSource),
    /// The profile slot's.
    Global(u32),
}

/// A counter that disagreed with the flow table: (counter read, flows counted).
pub type Mismatch = (u64, u64);

/// What a finished cycle over the flow table calls for.
#[derive(Debug, Default, PartialEq)]
pub struct Reconciliation {
    /// Every mismatch seen this cycle: the next cycle's suspects.
    pub seen: HashMap<Counter, Mismatch>,
    /// Counters to set to what the flow table holds.
    pub repairs: Vec<Repair>,
    /// Sources whose counter reads 0: their entries hold nothing and can go.
    pub idle_sources: Vec<ProfileSource>,
}

/// One counter to repair.
#[derive(Debug, PartialEq)]
pub struct Repair {
    pub who: Counter,
    pub count: u64,
    pub counted: u64,
    pub request: AdjustRequest,
}

/// Compares every counter with the flows counted over the cycle just ended (`tally`), in time
/// linear in the entries. A counter is judged only if it read the same at the cycle's `start`
/// and `end`: one that moved had connections open or close while the tally ran, so the two
/// need not agree. One is repaired only if the same mismatch was among the `suspects` of the
/// cycle before, so a connection opening or closing between two reads is never "repaired"
/// into a real drift.
pub fn reconcile(
    start: &HashMap<Counter, u64>,
    end: &HashMap<Counter, u64>,
    tally: &HashMap<ProfileSource, u64>,
    suspects: &HashMap<Counter, Mismatch>,
) -> Reconciliation {
    let mut totals: HashMap<u32, u64> = HashMap::new();
    for (counted, n) in tally {
        *totals.entry(counted.profile).or_default() += n;
    }
    let mut seen: HashMap<Counter, Mismatch> = HashMap::new();
    let mut judge = |who: Counter, count: u64, counted: u64| {
        let stable = start.get(&who).copied().unwrap_or(0) == count;
        if stable && count != counted {
            seen.insert(who, (count, counted));
        }
    };
    for (who, count) in end {
        let counted = match who {
            Counter::Source(source) => tally.get(source).copied().unwrap_or(0),
            Counter::Global(profile) => totals.get(profile).copied().unwrap_or(0),
        };
        judge(*who, *count, counted);
    }
    // A source with flows and no counter entry reads 0.
    for (source, counted) in tally {
        if !end.contains_key(&Counter::Source(*source)) {
            judge(Counter::Source(*source), 0, *counted);
        }
    }
    let idle_sources = end
        .iter()
        .filter_map(|(who, count)| match who {
            Counter::Source(source) if *count == 0 => Some(*source),
            _ => None,
        })
        .collect();
    let repairs = seen
        .iter()
        .filter(|(who, mismatch)| suspects.get(who) == Some(mismatch))
        .map(|(who, &(count, counted))| Repair {
            who: *who,
            count,
            counted,
            request: match who {
                Counter::Source(source) => {
                    AdjustRequest::source(source, counted as i64 - count as i64)
                }
                Counter::Global(profile) => {
                    AdjustRequest::global(*profile, counted as i64 - count as i64)
                }
            },
        })
        .collect();
    Reconciliation {
        seen,
        repairs,
        idle_sources,
    }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use super::*;
    use crate::datapath::kernel_keys::mapped;

    const SECOND: u64 = 1_000_000_000;

    #[test]
    fn a_flow_without_a_socket_is_released_as_closed_only_past_the_grace_period() {
        let now = 100 * SECOND;
        let within = now - SECOND / 2;
        let past = now - 2 * SECOND;
        assert_eq!(judge_flow(SocketView::Missing, now, within, None), None);
        assert_eq!(
            judge_flow(SocketView::Missing, now, past, None),
            Some(Release::Closed)
        );
        // The idle timeout has no say where the table speaks.
        let idle = Some(Duration::from_millis(1));
        assert_eq!(judge_flow(SocketView::Missing, now, within, idle), None);
        assert_eq!(
            judge_flow(SocketView::Missing, now, past, idle),
            Some(Release::Closed)
        );
    }

    #[test]
    fn a_flow_with_a_socket_is_kept_however_idle() {
        let idle = Some(Duration::from_secs(1));
        assert_eq!(judge_flow(SocketView::Open, 1000 * SECOND, 0, idle), None);
    }

    #[test]
    fn where_the_table_is_silent_only_the_idle_timeout_releases() {
        let now = 100 * SECOND;
        let old = now - 50 * SECOND;
        assert_eq!(judge_flow(SocketView::Silent, now, old, None), None);
        let idle = Some(Duration::from_secs(10));
        assert_eq!(
            judge_flow(SocketView::Silent, now, old, idle),
            Some(Release::Idle)
        );
        assert_eq!(
            judge_flow(SocketView::Silent, now, now - 5 * SECOND, idle),
            None
        );
    }

    #[test]
    fn a_flow_stamped_after_the_clock_was_read_is_not_old() {
        // The programs may stamp a flow between the sweeper's clock read and its map read.
        assert_eq!(
            judge_flow(
                SocketView::Missing,
                SECOND,
                5 * SECOND,
                Some(Duration::ZERO)
            ),
            None
        );
    }

    fn flow(remote: Ipv4Addr, local_port: u16) -> FlowKey {
        FlowKey {
            remote: mapped(IpAddr::V4(remote)).octets(),
            local: mapped(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))).octets(),
            remote_port: 40_000,
            local_port,
            _pad: 0,
        }
    }

    #[test]
    fn candidates_are_unknown_protected_not_allowlisted_and_came_in() {
        let client = Ipv4Addr::new(192, 0, 2, 7);
        let allow: Vec<IpNet> = vec!["192.0.2.0/28".parse().unwrap()];
        let ports = [5672];
        let yes = |_: &FlowKey| true;
        let no = |_: &FlowKey| false;
        let other = Ipv4Addr::new(198, 51, 100, 7);
        assert!(adoption_candidate(
            &flow(other, 5672),
            false,
            |p| ports.contains(&p),
            &allow,
            yes
        ));
        let protects = |p| ports.contains(&p);
        assert!(
            !adoption_candidate(&flow(other, 5672), true, protects, &allow, yes),
            "known"
        );
        assert!(
            !adoption_candidate(&flow(other, 80), false, protects, &allow, yes),
            "port"
        );
        assert!(
            !adoption_candidate(&flow(client, 5672), false, protects, &allow, yes),
            "allowed"
        );
        assert!(
            !adoption_candidate(&flow(other, 5672), false, protects, &allow, no),
            "local"
        );
    }

    #[test]
    fn whether_a_connection_came_in_is_asked_only_of_an_otherwise_candidate() {
        let other = Ipv4Addr::new(198, 51, 100, 7);
        let asked = std::cell::Cell::new(0);
        let came_in = |_: &FlowKey| {
            asked.set(asked.get() + 1);
            true
        };
        assert!(!adoption_candidate(
            &flow(other, 5672),
            true,
            |_| true,
            &[],
            came_in
        ));
        assert!(!adoption_candidate(
            &flow(other, 80),
            false,
            |p| p == 5672,
            &[],
            came_in
        ));
        assert_eq!(asked.get(), 0);
        assert!(adoption_candidate(
            &flow(other, 5672),
            false,
            |p| p == 5672,
            &[],
            came_in
        ));
        assert_eq!(asked.get(), 1);
    }

    fn host() -> LocalAddresses {
        LocalAddresses::new(
            ["127.0.0.0/8", "10.0.0.1/32", "10.9.0.1/32", "::1/128"].map(|p| p.parse().unwrap()),
        )
    }

    fn between(remote: &str, local: &str) -> FlowKey {
        FlowKey {
            remote: mapped(remote.parse().unwrap()).octets(),
            local: mapped(local.parse().unwrap()).octets(),
            remote_port: 40_000,
            local_port: 5672,
            _pad: 0,
        }
    }

    const PROTECTED: u32 = 7;

    #[test]
    fn a_peer_routed_through_a_protected_interface_came_in_to_any_local_address() {
        let via_protected = |_: &[u8; 16]| Some(PROTECTED);
        let host = host();
        assert!(came_in(
            &between("192.0.2.7", "10.0.0.1"),
            &host,
            &[PROTECTED],
            via_protected
        ));
        // Another interface's address, or an alias: the address's interface has no say.
        assert!(came_in(
            &between("192.0.2.7", "10.9.0.1"),
            &host,
            &[PROTECTED],
            via_protected
        ));
        let elsewhere = |_: &[u8; 16]| Some(PROTECTED + 1);
        assert!(!came_in(
            &between("192.0.2.7", "10.0.0.1"),
            &host,
            &[PROTECTED],
            elsewhere
        ));
        let unreachable = |_: &[u8; 16]| None;
        assert!(!came_in(
            &between("192.0.2.7", "10.0.0.1"),
            &host,
            &[PROTECTED],
            unreachable
        ));
    }

    #[test]
    fn a_connection_between_local_addresses_never_came_in() {
        let asked = std::cell::Cell::new(false);
        let route_out = |_: &[u8; 16]| {
            asked.set(true);
            Some(PROTECTED)
        };
        let host = host();
        // All of 127.0.0.0/8 is local, not only the 127.0.0.1 an interface lists.
        assert!(!came_in(
            &between("127.0.0.2", "10.0.0.1"),
            &host,
            &[PROTECTED],
            route_out
        ));
        assert!(!came_in(
            &between("10.9.0.1", "10.0.0.1"),
            &host,
            &[PROTECTED],
            route_out
        ));
        assert!(!came_in(
            &between("::1", "::1"),
            &host,
            &[PROTECTED],
            route_out
        ));
        assert!(!asked.get(), "no route lookup for a local peer");
        // Nor one to an address the host does not own (a transparent proxy's).
        assert!(!came_in(
            &between("192.0.2.7", "10.0.0.2"),
            &host,
            &[PROTECTED],
            route_out
        ));
    }

    #[test]
    fn only_an_over_cap_adoption_after_the_first_pass_and_while_enforcing_is_destroyed() {
        assert!(destroys(Adoption::OverCap, true, false));
        assert!(
            !destroys(Adoption::OverCap, false, false),
            "open before the agent"
        );
        assert!(!destroys(Adoption::Adopted, true, false));
        assert!(!destroys(Adoption::Skipped, true, false));
        assert!(!destroys(Adoption::OverCap, true, true), "monitor mode");
    }

    fn source(last: u8) -> ProfileSource {
        in_profile(last, 0)
    }

    fn in_profile(last: u8, profile: u32) -> ProfileSource {
        let addr = mapped(IpAddr::V4(Ipv4Addr::new(192, 0, 2, last))).octets();
        ProfileSource::new(limiter_common::SourceKey { addr }, profile)
    }

    fn counters(entries: &[(Counter, u64)]) -> HashMap<Counter, u64> {
        entries.iter().copied().collect()
    }

    #[test]
    fn a_mismatch_seen_once_is_a_suspect_and_seen_twice_is_repaired() {
        let (a, b) = (source(1), source(2));
        // `a` reads 5 for 3 flows, the global 9 for 4 flows.
        let read = counters(&[
            (Counter::Source(a), 5),
            (Counter::Source(b), 1),
            (Counter::Global(0), 9),
        ]);
        let tally = HashMap::from([(a, 3), (b, 1)]);
        let first = reconcile(&read, &read, &tally, &HashMap::new());
        assert_eq!(first.repairs, vec![]);
        assert_eq!(
            first.seen,
            HashMap::from([(Counter::Source(a), (5, 3)), (Counter::Global(0), (9, 4))])
        );
        let second = reconcile(&read, &read, &tally, &first.seen);
        let mut repairs: Vec<_> = second
            .repairs
            .iter()
            .map(|r| (r.who, r.request.delta, r.request.global))
            .collect();
        repairs.sort_by_key(|(who, ..)| matches!(who, Counter::Global(_)));
        assert_eq!(
            repairs,
            vec![(Counter::Source(a), -2, 0), (Counter::Global(0), -5, 1)]
        );
        let of_a = second
            .repairs
            .iter()
            .find(|r| r.who == Counter::Source(a))
            .unwrap();
        assert_eq!((of_a.request.source, of_a.request.profile), (a.source, 0));
    }

    #[test]
    fn a_different_mismatch_the_cycle_before_is_not_repaired() {
        let a = source(1);
        let read = counters(&[(Counter::Source(a), 5), (Counter::Global(0), 3)]);
        let tally = HashMap::from([(a, 3)]);
        let suspects = HashMap::from([(Counter::Source(a), (4, 3))]);
        let result = reconcile(&read, &read, &tally, &suspects);
        assert_eq!(result.repairs, vec![]);
        assert_eq!(result.seen, HashMap::from([(Counter::Source(a), (5, 3))]));
    }

    #[test]
    fn a_counter_that_moved_during_the_cycle_is_not_judged() {
        let a = source(1);
        let start = counters(&[(Counter::Source(a), 4), (Counter::Global(0), 4)]);
        let end = counters(&[(Counter::Source(a), 5), (Counter::Global(0), 5)]);
        let tally = HashMap::from([(a, 3)]);
        let suspects = HashMap::from([(Counter::Source(a), (5, 3)), (Counter::Global(0), (5, 3))]);
        let result = reconcile(&start, &end, &tally, &suspects);
        assert_eq!(result, Reconciliation::default());
    }

    #[test]
    fn flows_of_a_source_without_a_counter_are_a_mismatch_against_zero() {
        let a = source(1);
        let read = counters(&[(Counter::Global(0), 2)]);
        let tally = HashMap::from([(a, 2)]);
        let first = reconcile(&read, &read, &tally, &HashMap::new());
        assert_eq!(first.seen, HashMap::from([(Counter::Source(a), (0, 2))]));
        let second = reconcile(&read, &read, &tally, &first.seen);
        assert_eq!(second.repairs.len(), 1);
        assert_eq!(second.repairs[0].request.delta, 2);
    }

    #[test]
    fn a_counter_that_agrees_is_left_alone_and_a_zero_one_is_idle() {
        let (a, b) = (source(1), source(2));
        let read = counters(&[
            (Counter::Source(a), 2),
            (Counter::Source(b), 0),
            (Counter::Global(0), 2),
        ]);
        let tally = HashMap::from([(a, 2)]);
        let result = reconcile(&read, &read, &tally, &HashMap::new());
        assert_eq!(result.seen, HashMap::new());
        assert_eq!(result.idle_sources, vec![b]);
    }

    #[test]
    fn each_profile_is_reconciled_with_its_own_flows() {
        // The same address in two profiles: two counters, and each profile's global count is
        // its own flows'.
        let (a, a2) = (in_profile(1, 0), in_profile(1, 2));
        let read = counters(&[
            (Counter::Source(a), 1),
            (Counter::Source(a2), 3),
            (Counter::Global(0), 1),
            (Counter::Global(2), 2),
        ]);
        let tally = HashMap::from([(a, 1), (a2, 2)]);
        let first = reconcile(&read, &read, &tally, &HashMap::new());
        assert_eq!(
            first.seen,
            HashMap::from([(Counter::Source(a2), (3, 2))]),
            "profile 2's global count agrees with its two flows"
        );
        let second = reconcile(&read, &read, &tally, &first.seen);
        let repair = &second.repairs[0].request;
        assert_eq!((repair.profile, repair.delta, repair.global), (2, -1, 0));
    }

    #[test]
    fn a_streak_escalates_once_it_lasts_and_is_forgotten_once_it_pauses() {
        let after = Duration::from_secs(30);
        let now = 1000 * SECOND;
        assert_eq!(
            judge_streak(now - 40 * SECOND, now - SECOND, now, after),
            Streak::Escalate(Duration::from_secs(39))
        );
        assert_eq!(
            judge_streak(now - 20 * SECOND, now - SECOND, now, after),
            Streak::Going
        );
        assert_eq!(
            judge_streak(now - 20 * SECOND, now - 11 * SECOND, now, after),
            Streak::Over,
            "paused past the gap"
        );
        // Long enough, however long ago: the ban is still owed.
        assert_eq!(
            judge_streak(now - 100 * SECOND, now - 60 * SECOND, now, after),
            Streak::Escalate(Duration::from_secs(40))
        );
    }
}

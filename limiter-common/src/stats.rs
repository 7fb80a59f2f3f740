//! What the programs count: every packet by direction, verdict and reason, and flow events.

/// Which program saw the packet.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// XDP, on packets arriving: where connections are admitted or refused.
    Ingress = 0,
    /// TC, on packets leaving: records the server's ISN and tracks its FINs and RSTs.
    Egress = 1,
}

/// What happened to the packet.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Let through to the stack (or out of the host).
    Pass = 0,
    /// Dropped without an answer.
    Drop = 1,
    /// Refused with a reset: a RST|ACK to a refused SYN's client, or a RST to the host for a
    /// handshake refused at its completing ACK.
    Rst = 2,
    /// Answered by limiter itself with a SYN cookie's SYN-ACK: the SYN never reaches the host.
    Cookie = 3,
    /// Passed in monitor mode, where enforce mode would have dropped or reset it for the
    /// reason (see `Config::monitor`).
    WouldRefuse = 4,
}

/// Why. The reasons a *source* is refused for come first, so that [`Reason::blocked_slot`] is
/// a plain index; then the refusals of packets that cannot be judged; then the passes.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The source already holds its maximum of concurrent connections.
    ConnPerIp = 0,
    /// The host already holds its maximum of concurrent connections.
    ConnTotal = 1,
    /// The source sent SYNs faster than its rate and burst allow.
    SynRate = 2,
    /// The source is banned.
    Banned = 3,
    /// The source is in a deny prefix.
    Denylisted = 4,
    /// The flow table was full: refused when fail-closed, passed untracked when fail-open.
    FlowTableFull = 5,
    /// The protected ports admitted their connection rate's worth of new connections from all
    /// sources together (`conn-rate`): refused at the SYN while it is spent, or at a proven
    /// handshake that finds it spent.
    ConnRate = 6,
    /// An IPv4 or IPv6 fragment of TCP that could reach a protected port: its ports and flags
    /// cannot all be read in XDP, and the host would reassemble it out of sight. Refused.
    Fragment = 7,
    /// An IP or TCP header cut short (by the frame or by the IP length). Refused: the host
    /// would discard it anyway, and nothing in it can be judged.
    Truncated = 8,
    /// An IPv6 header chain longer than the parser follows. Refused: TCP may hide behind it.
    HeaderChain = 9,
    /// Headers that are not what their type says (IP version, header lengths, VLAN nesting).
    /// Refused on ingress, passed on egress.
    Malformed = 10,
    /// An IPv4 header whose checksum is wrong. The host discards it, so nothing it says may
    /// change limiter's state (a forged RST or SYN the host never sees): dropped on ingress.
    Checksum = 11,
    /// An IPv6 source the host refuses (IPv4-mapped, multicast): the host drops the packet,
    /// and limiter would key an IPv4-mapped one exactly like the IPv4 source it names, so it
    /// is dropped on ingress before anything is judged.
    Martian = 12,
    /// An ACK that could only complete a SYN cookie's handshake, with a cookie the host's
    /// secret did not make (forged, or expired): dropped, and nothing is charged.
    BadCookie = 13,
    /// A SYN admitted: it passes, and holds no slot and spends no token until its handshake
    /// completes.
    HalfOpen = 14,
    /// A SYN from a source with no connection open, answered with a SYN cookie (verdict
    /// `cookie`) while cookies are on: its source is charged only once its ACK proves it.
    Unproven = 15,
    /// A handshake-completing ACK that took its connection's slots: the connection is tracked.
    Admitted = 16,
    /// A SYN-ACK, FIN or RST of a half-open or tracked connection.
    Tracked = 17,
    /// A SYN-ACK, FIN or RST to or from a protected port that belongs to no known connection.
    Untracked = 18,
    /// A data or ACK segment, passed without a lookup (the established fast path).
    Segment = 19,
    /// The source is in an allow prefix: passed without counting towards any limit.
    Allowlisted = 20,
    /// TCP to (or, on egress, from) a port that is not protected.
    UnprotectedPort = 21,
    /// Not TCP (non-TCP fragments included).
    NonTcp = 22,
    /// Neither IPv4 nor IPv6.
    NonIp = 23,
    /// IP in IP (4), IPv6 in IP (41) or GRE (47), over IPv4 or IPv6: the host would take
    /// the inner packet off its tunnel device, so a SYN inside would never be judged here.
    /// Dropped on ingress unless `Config::tunnels_pass` lets tunnels through.
    Tunnel = 24,
}

impl Reason {
    /// Number of reasons; sizes the `STATS` array.
    pub const COUNT: usize = 25;
    /// Reasons a source is refused for, each with a slot in [`crate::Blocked`]: the first seven.
    pub const REFUSAL_COUNT: usize = 7;
    /// Every reason in wire order, for code that reads every counter.
    pub const ALL: [Reason; Reason::COUNT] = [
        Reason::ConnPerIp,
        Reason::ConnTotal,
        Reason::SynRate,
        Reason::Banned,
        Reason::Denylisted,
        Reason::FlowTableFull,
        Reason::ConnRate,
        Reason::Fragment,
        Reason::Truncated,
        Reason::HeaderChain,
        Reason::Malformed,
        Reason::Checksum,
        Reason::Martian,
        Reason::BadCookie,
        Reason::HalfOpen,
        Reason::Unproven,
        Reason::Admitted,
        Reason::Tracked,
        Reason::Untracked,
        Reason::Segment,
        Reason::Allowlisted,
        Reason::UnprotectedPort,
        Reason::NonTcp,
        Reason::NonIp,
        Reason::Tunnel,
    ];

    /// The reason as a metric label.
    pub const fn label(self) -> &'static str {
        match self {
            Reason::ConnPerIp => "conn_per_ip",
            Reason::ConnTotal => "conn_total",
            Reason::SynRate => "syn_rate",
            Reason::Banned => "banned",
            Reason::Denylisted => "denylisted",
            Reason::FlowTableFull => "flow_table_full",
            Reason::ConnRate => "conn_rate",
            Reason::Fragment => "fragment",
            Reason::Truncated => "truncated",
            Reason::HeaderChain => "header_chain",
            Reason::Malformed => "malformed",
            Reason::Checksum => "checksum",
            Reason::Martian => "martian_source",
            Reason::BadCookie => "bad_cookie",
            Reason::HalfOpen => "half_open",
            Reason::Unproven => "unproven",
            Reason::Admitted => "admitted",
            Reason::Tracked => "tracked",
            Reason::Untracked => "untracked",
            Reason::Segment => "segment",
            Reason::Allowlisted => "allowlisted",
            Reason::UnprotectedPort => "unprotected_port",
            Reason::NonTcp => "non_tcp",
            Reason::NonIp => "non_ip",
            Reason::Tunnel => "tunnel",
        }
    }

    /// The slot of this reason in [`crate::Blocked`], for the reasons a source is refused for.
    pub const fn blocked_slot(self) -> Option<usize> {
        let index = self as usize;
        if index < Reason::REFUSAL_COUNT {
            Some(index)
        } else {
            None
        }
    }
}

impl Verdict {
    /// Number of verdicts; sizes the `STATS` array.
    pub const COUNT: usize = 5;
    /// Every verdict in wire order.
    pub const ALL: [Verdict; Verdict::COUNT] = [
        Verdict::Pass,
        Verdict::Drop,
        Verdict::Rst,
        Verdict::Cookie,
        Verdict::WouldRefuse,
    ];

    /// The verdict as a metric label.
    pub const fn label(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Drop => "drop",
            Verdict::Rst => "rst",
            Verdict::Cookie => "cookie",
            Verdict::WouldRefuse => "would_refuse",
        }
    }
}

impl Direction {
    /// Number of directions; sizes the `STATS` array.
    pub const COUNT: usize = 2;
    /// Both directions in wire order.
    pub const ALL: [Direction; Direction::COUNT] = [Direction::Ingress, Direction::Egress];

    /// The direction as a metric label.
    pub const fn label(self) -> &'static str {
        match self {
            Direction::Ingress => "ingress",
            Direction::Egress => "egress",
        }
    }
}

/// Slots of the per-CPU `STATS` array: one per (direction, verdict, reason).
pub const STATS_SLOTS: u32 = (Direction::COUNT * Verdict::COUNT * Reason::COUNT) as u32;

/// The `STATS` slot that counts packets of this direction, verdict and reason.
pub const fn stat_slot(direction: Direction, verdict: Verdict, reason: Reason) -> u32 {
    ((direction as u32 * Verdict::COUNT as u32) + verdict as u32) * Reason::COUNT as u32
        + reason as u32
}

/// Flow events, in the per-CPU `EVENTS` array.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// A flow entered the table and took its slots: its handshake completed, or the agent
    /// adopted an established connection the table lacked (`limiter_adopt`).
    Opened = 0,
    /// A RST (either way) removed the flow and released its slots.
    ClosedRst = 1,
    /// FINs both ways removed the flow and released its slots.
    ClosedFin = 2,
    /// The agent released the flow (`limiter_release`).
    Released = 3,
    /// A handshake-completing ACK found a cap full (another connection of its source or of the
    /// host completed first): it was turned into a RST to the host, which drops the embryonic
    /// connection. Counted in `STATS` too, as `rst` for `conn_per_ip` / `conn_total`.
    RefusedAtAck = 4,
}

impl Event {
    /// Number of events; sizes the `EVENTS` array.
    pub const COUNT: usize = 5;
    /// Every event in wire order.
    pub const ALL: [Event; Event::COUNT] = [
        Event::Opened,
        Event::ClosedRst,
        Event::ClosedFin,
        Event::Released,
        Event::RefusedAtAck,
    ];

    /// The event as a metric label.
    pub const fn label(self) -> &'static str {
        match self {
            Event::Opened => "opened",
            Event::ClosedRst => "closed_rst",
            Event::ClosedFin => "closed_fin",
            Event::Released => "released",
            Event::RefusedAtAck => "refused_at_ack",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_slots_are_distinct_and_in_range() {
        let mut seen = [false; STATS_SLOTS as usize];
        for d in Direction::ALL {
            for v in Verdict::ALL {
                for r in Reason::ALL {
                    let slot = stat_slot(d, v, r) as usize;
                    assert!(!seen[slot], "slot {slot} used twice");
                    seen[slot] = true;
                }
            }
        }
        assert!(seen.iter().all(|s| *s));
    }

    #[test]
    fn only_refusals_have_blocked_slots() {
        for (i, r) in Reason::ALL.iter().enumerate() {
            assert_eq!(r.blocked_slot().is_some(), i < Reason::REFUSAL_COUNT);
            assert_eq!(*r as usize, i);
        }
    }
}

//! What the programs count: every packet by direction, verdict and reason, and flow events.

/// Which program saw the packet.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// XDP, on packets arriving: where SYNs are admitted or refused.
    Ingress = 0,
    /// TC, on packets leaving: tracks the server's side of each flow (FINs, RSTs).
    Egress = 1,
}

/// What happened to the packet.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Let through to the stack.
    Pass = 0,
    /// Dropped without an answer.
    Drop = 1,
    /// Refused with a RST|ACK sent back from XDP.
    Rst = 2,
}

/// Why. The refusal reasons come first so that [`Reason::blocked_slot`] is a plain index.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The source already holds its maximum of concurrent connections.
    ConnPerIp = 0,
    /// The host already holds its maximum of concurrent connections.
    ConnTotal = 1,
    /// The source sent SYNs faster than its rate and burst allow.
    SynRate = 2,
    /// The source is banned (by an operator or by escalation).
    Banned = 3,
    /// The source is in a deny prefix.
    Denylisted = 4,
    /// The flow table was full: refused when fail-closed, passed untracked when fail-open.
    FlowTableFull = 5,
    /// A SYN admitted and tracked.
    Admitted = 6,
    /// A SYN of a flow already tracked (a retransmission, or a reuse of a closing 4-tuple).
    Retransmit = 7,
    /// A packet of a tracked flow.
    Tracked = 8,
    /// A TCP packet to a protected port that belongs to no tracked flow.
    Untracked = 9,
    /// The source is in an allow prefix: passed without counting towards any limit.
    Allowlisted = 10,
    /// TCP to a port that is not protected.
    UnprotectedPort = 11,
    /// IP, but not TCP.
    NonTcp = 12,
    /// Neither IPv4 nor IPv6.
    NonIp = 13,
    /// An IPv4 or IPv6 fragment other than the first: no TCP header to read.
    Fragment = 14,
    /// Truncated or unparseable headers (or more extension headers / VLAN tags than we follow).
    Malformed = 15,
}

impl Reason {
    /// Number of reasons; sizes the `STATS` array.
    pub const COUNT: usize = 16;
    /// Reasons a SYN can be refused for: the first six.
    pub const REFUSAL_COUNT: usize = 6;
    /// Every reason in wire order, for code that reads every counter.
    pub const ALL: [Reason; Reason::COUNT] = [
        Reason::ConnPerIp,
        Reason::ConnTotal,
        Reason::SynRate,
        Reason::Banned,
        Reason::Denylisted,
        Reason::FlowTableFull,
        Reason::Admitted,
        Reason::Retransmit,
        Reason::Tracked,
        Reason::Untracked,
        Reason::Allowlisted,
        Reason::UnprotectedPort,
        Reason::NonTcp,
        Reason::NonIp,
        Reason::Fragment,
        Reason::Malformed,
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
            Reason::Admitted => "admitted",
            Reason::Retransmit => "retransmit",
            Reason::Tracked => "tracked",
            Reason::Untracked => "untracked",
            Reason::Allowlisted => "allowlisted",
            Reason::UnprotectedPort => "unprotected_port",
            Reason::NonTcp => "non_tcp",
            Reason::NonIp => "non_ip",
            Reason::Fragment => "fragment",
            Reason::Malformed => "malformed",
        }
    }

    /// The slot of this reason in [`crate::Blocked`], for refusal reasons.
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
    pub const COUNT: usize = 3;
    /// Every verdict in wire order.
    pub const ALL: [Verdict; Verdict::COUNT] = [Verdict::Pass, Verdict::Drop, Verdict::Rst];

    /// The verdict as a metric label.
    pub const fn label(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Drop => "drop",
            Verdict::Rst => "rst",
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
    /// A flow entered the table (its slots were taken).
    Opened = 0,
    /// A RST (either way) removed the flow and released its slots.
    ClosedRst = 1,
    /// FINs both ways removed the flow and released its slots.
    ClosedFin = 2,
    /// The agent released the flow (eviction of half-open or idle flows).
    Released = 3,
}

impl Event {
    /// Number of events; sizes the `EVENTS` array.
    pub const COUNT: usize = 4;
    /// Every event in wire order.
    pub const ALL: [Event; Event::COUNT] = [
        Event::Opened,
        Event::ClosedRst,
        Event::ClosedFin,
        Event::Released,
    ];

    /// The event as a metric label.
    pub const fn label(self) -> &'static str {
        match self {
            Event::Opened => "opened",
            Event::ClosedRst => "closed_rst",
            Event::ClosedFin => "closed_fin",
            Event::Released => "released",
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

//! What the programs count: every packet by direction, verdict and reason, and flow events.

/// An enum whose values index a counter array: its variants with their wire numbers (0 up, in
/// order) and metric labels, and from those its `COUNT`, `ALL` in wire order and `label`, so
/// no variant can be added to one and left out of another. A number out of order does not
/// compile.
macro_rules! counted_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $($(#[$vmeta:meta])* $variant:ident = $value:literal => $label:literal,)+
        }
    ) => {
        $(#[$meta])*
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum $name {
            $($(#[$vmeta])* $variant = $value,)+
        }

        impl $name {
            /// Number of variants; sizes the arrays they index.
            pub const COUNT: usize = [$($name::$variant),+].len();
            /// Every variant in wire order, for code that reads every counter.
            pub const ALL: [$name; $name::COUNT] = [$($name::$variant),+];

            /// The variant as a metric label.
            pub const fn label(self) -> &'static str {
                match self {
                    $($name::$variant => $label,)+
                }
            }
        }

        const _: () = {
            let mut i = 0;
            while i < $name::COUNT {
                assert!($name::ALL[i] as usize == i, "wire numbers 0 up, in order");
                i += 1;
            }
        };
    };
}

counted_enum! {
    /// Which program saw the packet.
    pub enum Direction {
        /// XDP, on packets arriving: where connections are admitted or refused.
        Ingress = 0 => "ingress",
        /// TC, on packets leaving: records the server's ISN and tracks its FINs and RSTs.
        Egress = 1 => "egress",
    }
}

counted_enum! {
    /// What happened to the packet.
    pub enum Verdict {
        /// Let through to the stack (or out of the host).
        Pass = 0 => "pass",
        /// Dropped without an answer.
        Drop = 1 => "drop",
        /// Refused with a reset: a RST|ACK to a refused SYN's client, or a RST to the host for a
        /// handshake refused at its completing ACK.
        Rst = 2 => "rst",
        /// Answered by limiter itself with a SYN cookie's SYN-ACK: the SYN never reaches the host.
        Cookie = 3 => "cookie",
        /// Passed in monitor mode, where enforce mode would have dropped or reset it for the
        /// reason (see `Config::monitor`).
        WouldRefuse = 4 => "would_refuse",
    }
}

counted_enum! {
    /// Why. The reasons a *source* is refused for come first, so that [`Reason::blocked_slot`] is
    /// a plain index; then the refusals of packets that cannot be judged; then the passes.
    pub enum Reason {
        /// The source already holds its maximum of concurrent connections.
        ConnPerIp = 0 => "conn_per_ip",
        /// The host already holds its maximum of concurrent connections.
        ConnTotal = 1 => "conn_total",
        /// The source sent SYNs faster than its rate and burst allow.
        SynRate = 2 => "syn_rate",
        /// The source is banned.
        Banned = 3 => "banned",
        /// The source is in a deny prefix.
        Denylisted = 4 => "denylisted",
        /// The flow table was full: refused when fail-closed, passed untracked when fail-open.
        FlowTableFull = 5 => "flow_table_full",
        /// The protected ports admitted their connection rate's worth of new connections from all
        /// sources together (`conn-rate`): refused at the SYN while it is spent, or at a proven
        /// handshake that finds it spent.
        ConnRate = 6 => "conn_rate",
        /// An IPv4 or IPv6 fragment of TCP that could reach a protected port: its ports and flags
        /// cannot all be read in XDP, and the host would reassemble it out of sight. Refused.
        Fragment = 7 => "fragment",
        /// An IP or TCP header cut short (by the frame or by the IP length). Refused: the host
        /// would discard it anyway, and nothing in it can be judged.
        Truncated = 8 => "truncated",
        /// An IPv6 header chain longer than the parser follows. Refused: TCP may hide behind it.
        HeaderChain = 9 => "header_chain",
        /// Headers that are not what their type says (IP version, header lengths, VLAN nesting).
        /// Refused on ingress, passed on egress.
        Malformed = 10 => "malformed",
        /// An IPv4 header whose checksum is wrong. The host discards it, so nothing it says may
        /// change limiter's state (a forged RST or SYN the host never sees): dropped on ingress.
        Checksum = 11 => "checksum",
        /// An IPv6 source the host refuses (IPv4-mapped, multicast): the host drops the packet,
        /// and limiter would key an IPv4-mapped one exactly like the IPv4 source it names, so it
        /// is dropped on ingress before anything is judged.
        Martian = 12 => "martian_source",
        /// An ACK that could only complete a SYN cookie's handshake, with a cookie the host's
        /// secret did not make (forged, or expired): dropped, and nothing is charged.
        BadCookie = 13 => "bad_cookie",
        /// A SYN admitted: it passes, and holds no slot and spends no token until its handshake
        /// completes.
        HalfOpen = 14 => "half_open",
        /// A SYN from a source with no connection open, answered with a SYN cookie (verdict
        /// `cookie`) while cookies are on: its source is charged only once its ACK proves it.
        Unproven = 15 => "unproven",
        /// A handshake-completing ACK that took its connection's slots: the connection is tracked.
        Admitted = 16 => "admitted",
        /// A SYN-ACK, FIN or RST of a half-open or tracked connection.
        Tracked = 17 => "tracked",
        /// A SYN-ACK, FIN or RST to or from a protected port that belongs to no known connection.
        Untracked = 18 => "untracked",
        /// A data or ACK segment, passed without a lookup (the established fast path).
        Segment = 19 => "segment",
        /// The source is in an allow prefix: passed without counting towards any limit.
        Allowlisted = 20 => "allowlisted",
        /// TCP to (or, on egress, from) a port that is not protected.
        UnprotectedPort = 21 => "unprotected_port",
        /// Not TCP (non-TCP fragments included).
        NonTcp = 22 => "non_tcp",
        /// Neither IPv4 nor IPv6.
        NonIp = 23 => "non_ip",
        /// IP in IP (4), IPv6 in IP (41) or GRE (47), over IPv4 or IPv6: the host would take
        /// the inner packet off its tunnel device, so a SYN inside would never be judged here.
        /// Dropped on ingress unless `Config::tunnels_pass` lets tunnels through.
        Tunnel = 24 => "tunnel",
    }
}

impl Reason {
    /// Reasons a source is refused for, each with a slot in [`crate::Blocked`]: the first seven.
    pub const REFUSAL_COUNT: usize = 7;
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

/// Slots of the per-CPU `STATS` array: one per (direction, verdict, reason).
pub const STATS_SLOTS: u32 = (Direction::COUNT * Verdict::COUNT * Reason::COUNT) as u32;

/// The `STATS` slot that counts packets of this direction, verdict and reason.
pub const fn stat_slot(direction: Direction, verdict: Verdict, reason: Reason) -> u32 {
    ((direction as u32 * Verdict::COUNT as u32) + verdict as u32) * Reason::COUNT as u32
        + reason as u32
}

counted_enum! {
    /// Flow events, in the per-CPU `EVENTS` array.
    pub enum Event {
        /// A flow entered the table and took its slots: its handshake completed, or the agent
        /// adopted an established connection the table lacked (`limiter_adopt`).
        Opened = 0 => "opened",
        /// A RST (either way) removed the flow and released its slots.
        ClosedRst = 1 => "closed_rst",
        /// FINs both ways removed the flow and released its slots.
        ClosedFin = 2 => "closed_fin",
        /// The agent released the flow (`limiter_release`).
        Released = 3 => "released",
        /// A handshake-completing ACK found a cap full (another connection of its source or of the
        /// host completed first): it was turned into a RST to the host, which drops the embryonic
        /// connection. Counted in `STATS` too, as `rst` for `conn_per_ip` / `conn_total`.
        RefusedAtAck = 4 => "refused_at_ack",
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

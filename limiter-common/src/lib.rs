//! Map keys and values shared by the kernel programs and the agent.
//!
//! Every type here crosses the kernel/user boundary byte for byte, so each is `#[repr(C)]`
//! with explicit padding, and the agent sees exactly what the programs wrote.
#![no_std]

/// Indices into the per-CPU `STATS` array: what the programs saw.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stat {
    /// Packets seen by the XDP program on ingress.
    XdpPackets = 0,
    /// Packets seen by the TC program on egress.
    TcPackets = 1,
}

impl Stat {
    pub const COUNT: u32 = 2;
}

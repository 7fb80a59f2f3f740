//! The kernel side as the agent holds it: loading the embedded programs, attaching and pinning
//! them, typed map access, the helper programs, and the [`Enforcer`] the services share.
//! Nothing here knows about settings files, HTTP or the broker limiter.

mod enforcer;
mod helpers;
mod host_tcp;
pub mod kernel_floor;
pub mod kernel_keys;
mod kernel_policy;
mod loader;
pub mod local_routes;
mod map_handles;
mod mmap_array;
mod netlink;
pub mod pins;
mod programs;
mod route;
pub mod sockets;
mod tc_legacy;
mod walk;

pub use enforcer::{CookieStatus, EnforceError, Enforcer, Lists};
pub use helpers::Adoption;
pub use host_tcp::{CookieTerms, HostTcp, HostTcpError};
pub use kernel_policy::{CookieMode, Policy, PortProfile, SourceOverride, TOP_LEVEL_PROFILE};
pub use loader::{
    Attachment, Datapath, EBPF_OBJECT, KernelLogger, LoadError, LoadOptions, TcPath, XdpAttachMode,
};
pub use map_handles::{Maps, MapsError, PacketCount};
pub use pins::detach;
pub use programs::{ADJUST_PROGRAM, RELEASE_PROGRAM, TC_PROGRAM, XDP_PROGRAM};
pub use route::default_route_interface;
pub use tc_legacy::TcLegacyError;
pub use walk::{FlowBatch, SweepCursor};

//! The limiter agent as a library: the binary in `main.rs` is a thin shell over it, and the
//! privileged tests drive the same code.
//!
//! Layers, each importing only from those below it:
//! - `errors`, `api`, `events` and `secret`: shared error types, the HTTP API's documents
//!   (server and CLI), the event log's vocabulary, and the one constant-time token comparison.
//! - `datapath`, `buckets`, `fleet` and `admission`, side by side: the kernel programs and
//!   maps, the broker's token buckets, the fleet's Redis (which implements the buckets'
//!   `SharedBuckets` contract, the one link between them), and the listeners' connection
//!   slots.
//! - `settings`: flags, file and defaults, resolved into what the two layers below take.
//! - `protocol` and `services`: the broker socket, HTTP, metrics and the sweeper, each given
//!   the narrow handles it uses.
//! - `ops`: the operator commands, clients of the HTTP API (or readers of pinned maps).
//! - `run` and `cli`: the wiring of `limiter run`, and the command line.

// The kernel object is built for bpfel (little-endian) and its maps are shared byte for byte
// with the agent, so a big-endian agent would misread every key and counter.
#[cfg(target_endian = "big")]
compile_error!(
    "limiter runs only on little-endian hosts (x86_64, arm64): its eBPF object is bpfel and \
     shares its maps byte for byte with the agent"
);

pub mod admission;
pub mod api;
pub mod buckets;
pub mod cli;
pub mod command_runtime;
pub mod datapath;
pub mod duration_units;
pub mod errors;
pub mod events;
pub mod fleet;
pub mod ops;
pub mod protocol;
pub mod run;
pub mod secret;
pub mod services;
pub mod settings;

//! The limiter agent as a library: the binary in `main.rs` is a thin shell over it, and the
//! privileged tests drive the same code.

pub mod agent;
pub mod buckets;
pub mod cli;
pub mod client;
pub mod config;
pub mod http;
pub mod loader;
pub mod maps;
pub mod metrics;
pub mod ops;
pub mod protocol;
pub mod sweeper;

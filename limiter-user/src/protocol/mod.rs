//! The broker protocol: binary, length-prefixed, pipelined request/response frames over a
//! Unix socket (and optionally TCP). docs/protocol.md is the byte-level specification.
//!
//! The messages, the codecs and the client live in the `limiter-client` crate, so that brokers
//! can depend on them without the agent; this module serves them.

pub mod check_command;
pub mod server;

pub use server::{ServeControl, ServeError, Server, serve};

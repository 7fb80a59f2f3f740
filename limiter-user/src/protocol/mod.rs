//! The broker protocol: binary, length-prefixed, pipelined request/response frames over a
//! Unix socket (and optionally TCP). docs/protocol.md is the byte-level specification.

pub mod check_command;
pub mod codec;
pub mod frame;
pub mod server;

pub use codec::{ClientCodec, CodecError, DEFAULT_MAX_FRAME, Received, ServerCodec};
pub use frame::{ErrorCode, ParseError, Request, Response};
pub use server::{ServeError, Server, serve};

//! Ask the limiter agent whether a request may go ahead.
//!
//! The agent keeps a token bucket per action and key (`auth` per address, `publish` per user,
//! …) and answers over a local socket in a small binary protocol, specified byte by byte in
//! `docs/protocol.md`. This crate is that protocol for Rust: the message types, the
//! length-prefixed codecs for both ends, and an async [`Client`]. It is a separate crate so a
//! broker can depend on it without pulling in the agent (aya, an HTTP server, serde); the
//! agent itself serves with the same types, so the two cannot drift apart.
//!
//! # Usage
//!
//! ```no_run
//! use limiter_client::Client;
//!
//! # async fn login(addr: std::net::IpAddr, password_ok: bool) -> Result<bool, limiter_client::ClientError> {
//! let limiter = Client::connect_unix("/run/limiter/limiter.sock").await?;
//! let verdict = limiter.check("auth", addr.to_string(), 1).await?;
//! if !verdict.allowed {
//!     // Refuse without checking the password; over HTTP: 429, `Retry-After: {secs}`.
//!     let _secs = verdict.retry_after_secs();
//!     return Ok(false);
//! }
//! if !password_ok {
//!     // Repeated failures from one address escalate to a ban in the kernel.
//!     limiter.report_auth_failure(addr).await?;
//! }
//! Ok(password_ok)
//! # }
//! ```
//!
//! # What to know
//!
//! - A refused check is `Ok`: look at [`Verdict::allowed`]. `Err` ([`ClientError`]) means
//!   there is no answer (agent down, unknown action, bad key), and the broker decides whether
//!   to fail open or closed.
//! - One [`Client`] is one connection. Clone it freely: clones pipeline their requests onto
//!   the same connection (up to 1024 in flight) and each gets its own reply.
//! - The client does not reconnect. After [`ClientError::Closed`], connect again.
//! - Everything needs a tokio runtime.
//!
//! To speak the protocol without this client (a proxy, a test, another driver), wrap a stream
//! in `tokio_util::codec::Framed` with [`ClientCodec`] or [`ServerCodec`]: they turn
//! [`Request`]s and [`Response`]s into frames and back.
#![deny(missing_docs)]
#![warn(missing_debug_implementations)]

#[macro_use]
mod wire_enum;
mod client;
mod codec;
mod frame;
mod topic_key;
mod verdict;

pub use client::{Client, ClientError};
pub use codec::{ClientCodec, CodecError, DEFAULT_MAX_FRAME, Received, ServerCodec};
pub use frame::{
    ErrorCode, MAX_ACTION_NAME, MAX_KEY_LEN, MAX_TOKEN_LEN, ParseError, Request, Response, op,
};
pub use topic_key::{USER_TOPIC_SEPARATOR, UserTopicError, user_topic_key};
pub use verdict::{Checked, Escalation, NEVER_MS, Outcome, Verdict};

//! The protocol's messages and their bytes (specified in docs/protocol.md). Parsing never
//! trusts a length it has not checked against what is left, and names what it could not read.

use std::{net::IpAddr, time::Duration};

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::verdict::{Checked, Escalation, Outcome, Verdict};

/// Longest action name. Names travel behind a one-byte length, and the agent refuses to
/// configure a name it could not be asked about.
pub const MAX_ACTION_NAME: usize = 64;

/// Longest key. Session tokens and user names fit with room to spare; the bound keeps every
/// request well under [`DEFAULT_MAX_FRAME`](crate::DEFAULT_MAX_FRAME).
pub const MAX_KEY_LEN: usize = 1024;

/// The first byte of every frame body. Requests are below `0x80` and replies above, so a
/// frame sent the wrong way is recognisably wrong rather than misread.
pub mod op {
    /// Spend tokens if the bucket can pay: [`Request::Check`](crate::Request::Check).
    pub const CHECK: u8 = 0x01;
    /// Ask what a check would answer without spending: [`Request::Peek`](crate::Request::Peek).
    pub const PEEK: u8 = 0x02;
    /// Forget one key's bucket: [`Request::Reset`](crate::Request::Reset).
    pub const RESET: u8 = 0x03;
    /// Count a failed login: [`Request::AuthFailure`](crate::Request::AuthFailure).
    pub const AUTH_FAILURE: u8 = 0x04;
    /// Ban an address in the kernel: [`Request::Ban`](crate::Request::Ban).
    pub const BAN: u8 = 0x05;
    /// Lift a ban: [`Request::Unban`](crate::Request::Unban).
    pub const UNBAN: u8 = 0x06;
    /// Present the admin token: [`Request::Authenticate`](crate::Request::Authenticate).
    pub const AUTHENTICATE: u8 = 0x07;
    /// A check carrying the payload's size, answered with the monitor flag:
    /// [`Request::CheckPayload`](crate::Request::CheckPayload).
    pub const CHECK_PAYLOAD: u8 = 0x08;
    /// A connection the broker named in its keys is gone:
    /// [`Request::ConnectionGone`](crate::Request::ConnectionGone).
    pub const CONNECTION_GONE: u8 = 0x09;
    /// Take a session: [`Request::Acquire`](crate::Request::Acquire).
    pub const ACQUIRE: u8 = 0x0A;
    /// Give a session back: [`Request::Release`](crate::Request::Release).
    pub const RELEASE: u8 = 0x0B;
    /// The reply to a check or peek: [`Response::Verdict`](crate::Response::Verdict).
    pub const VERDICT: u8 = 0x81;
    /// The reply to reset, ban and unban: [`Response::Done`](crate::Response::Done).
    pub const DONE: u8 = 0x82;
    /// The reply to an auth failure: [`Response::Escalation`](crate::Response::Escalation).
    pub const ESCALATION: u8 = 0x83;
    /// The reply to a check-payload: [`Response::Checked`](crate::Response::Checked).
    pub const CHECKED: u8 = 0x84;
    /// The reply to anything that failed: [`Response::Error`](crate::Response::Error).
    pub const ERROR: u8 = 0xFF;
}

/// Longest admin token a client may present.
pub const MAX_TOKEN_LEN: usize = 1024;

/// Bytes in a frame before its payload: opcode and correlation id.
pub(crate) const HEADER_LEN: usize = 5;

/// What a broker can ask the agent. Keys are bytes, not strings, because an action may be
/// keyed by anything the broker has (an address, a token, a user name).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// Spend `cost` tokens from `key`'s bucket in `action` if it can pay; answered with a
    /// [`Response::Verdict`].
    Check {
        /// The action's configured name, 1 to [`MAX_ACTION_NAME`] bytes.
        action: String,
        /// Whose bucket, 1 to [`MAX_KEY_LEN`] bytes.
        key: Bytes,
        /// Tokens to spend; at least 1.
        cost: u32,
    },
    /// What [`Request::Check`] would answer, without spending anything, so a broker can
    /// show a user their remaining budget.
    Peek {
        /// The action's configured name.
        action: String,
        /// Whose bucket.
        key: Bytes,
        /// Tokens the hypothetical check would spend; at least 1.
        cost: u32,
    },
    /// Forget `key`'s bucket, e.g. after a successful login clears earlier failures;
    /// answered with [`Response::Done`].
    Reset {
        /// The action's configured name.
        action: String,
        /// Whose bucket.
        key: Bytes,
    },
    /// Report a failed authentication from `addr`, so repeated failures escalate to a
    /// kernel ban; answered with [`Response::Escalation`].
    AuthFailure {
        /// The address that failed.
        addr: IpAddr,
    },
    /// Ban `addr` in the kernel for `ttl`: its SYNs are refused before they reach any
    /// socket. Answered with [`Response::Done`].
    Ban {
        /// The address to ban.
        addr: IpAddr,
        /// How long; carried in whole milliseconds.
        ttl: Duration,
    },
    /// Lift a ban on `addr`; answered with [`Response::Done`].
    Unban {
        /// The address to unban.
        addr: IpAddr,
    },
    /// Present the agent's broker admin token, so that this connection may reset, ban and
    /// unban (the way a TCP client becomes trusted). Answered with [`Response::Done`], or
    /// [`ErrorCode::BadToken`].
    Authenticate {
        /// The token, 1 to [`MAX_TOKEN_LEN`] bytes.
        token: Bytes,
    },
    /// [`Request::Check`] with the size of what is being checked (a publish's payload), for
    /// actions with `max-payload-bytes`, answered with a [`Response::Checked`], which also
    /// says what a monitored action would have refused. Protocol 1.3.
    CheckPayload {
        /// The action's configured name.
        action: String,
        /// Whose bucket.
        key: Bytes,
        /// Tokens to spend; at least 1.
        cost: u32,
        /// The payload's size in bytes; 0 when there is none (an empty payload is never too
        /// large).
        payload_bytes: u32,
    },
    /// The broker's connection named `key` (in actions keyed by `connection`) is gone: its
    /// buckets and strikes are forgotten. Answered with [`Response::Done`]. Protocol 1.3.
    ConnectionGone {
        /// The connection's name, as the broker's checks gave it.
        key: Bytes,
    },
    /// Take one of `key`'s sessions in the concurrency `action`, named `session` (e.g. the
    /// broker's client handle); held by this protocol connection until released or the
    /// connection ends. Answered with a [`Response::Verdict`]. Protocol 1.3.
    Acquire {
        /// A concurrency action's name.
        action: String,
        /// Whose sessions (e.g. a user name).
        key: Bytes,
        /// The broker's name for this session, 1 to [`MAX_KEY_LEN`] bytes.
        session: Bytes,
    },
    /// Give back a session this connection acquired; answered with [`Response::Done`].
    /// Protocol 1.3.
    Release {
        /// A concurrency action's name.
        action: String,
        /// Whose sessions.
        key: Bytes,
        /// The name it was acquired with.
        session: Bytes,
    },
}

/// What the agent answers. Each request has one expected reply kind, or
/// [`Response::Error`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Response {
    /// The answer to a check or a peek.
    Verdict(Verdict),
    /// Reset, ban and unban.
    Done {
        /// False for a reset of a key that had no bucket.
        changed: bool,
    },
    /// What a reported auth failure led to.
    Escalation(Escalation),
    /// The answer to a check-payload: the verdict and the monitor flag.
    Checked(Checked),
    /// The request failed; the connection stays open unless `code` is
    /// [`ErrorCode::FrameTooLarge`].
    Error {
        /// What kind of failure, for code to branch on.
        code: ErrorCode,
        /// What went wrong, for a human.
        message: String,
    },
}

wire_enum! {
    /// Error reply codes. The connection stays open after every one but `FrameTooLarge`.
    pub enum ErrorCode {
        /// The frame could not be read: short, trailing bytes, a bad length or encoding.
        Malformed = 1,
        /// The opcode is not one this side knows.
        UnknownOpcode = 2,
        /// No action has this name in the agent's configuration.
        UnknownAction = 3,
        /// The key is empty, too long, or not what the action is keyed by (e.g. not an address).
        InvalidKey = 4,
        /// A cost of 0.
        InvalidCost = 5,
        /// The frame's length exceeds the maximum; the agent closes the connection after this,
        /// since skipping the frame would mean reading what a misbehaving client chose.
        FrameTooLarge = 6,
        /// A ban or unban could not be written to the kernel, or its TTL is out of range.
        BanFailed = 7,
        /// The request changes state (ban, unban, reset) and this client may not: over the Unix
        /// socket its uid and gid are not in the agent's admin lists, and it has not presented
        /// the admin token on this connection (the only way over TCP). Also the answer to
        /// [`Request::Authenticate`] when the agent has no admin token configured.
        NotPermitted = 8,
        /// [`Request::Authenticate`] with a token that is not the agent's; the connection stays
        /// as trusted as it was.
        BadToken = 9,
        /// An acquire or release of an action that is not of kind `concurrency` (protocol 1.3).
        WrongKind = 10,
    }
}

/// A frame body that could not be turned into a message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ParseError {
    /// The code the agent answers with when it is the one that could not parse.
    pub code: ErrorCode,
    /// What could not be read and where, for a human.
    pub message: String,
}

impl ParseError {
    fn malformed(message: impl Into<String>) -> Self {
        Self {
            code: ErrorCode::Malformed,
            message: message.into(),
        }
    }
}

/// Reads fields off a frame body, turning every short read into a named error.
struct Fields {
    body: Bytes,
    what: &'static str,
}

impl Fields {
    fn need(&self, field: &str, n: usize) -> Result<(), ParseError> {
        if self.body.remaining() < n {
            return Err(ParseError::malformed(format!(
                "{} frame ends inside {field}: it needs {n} bytes and {} are left",
                self.what,
                self.body.remaining()
            )));
        }
        Ok(())
    }

    fn u8(&mut self, field: &str) -> Result<u8, ParseError> {
        self.need(field, 1)?;
        Ok(self.body.get_u8())
    }

    fn u16(&mut self, field: &str) -> Result<u16, ParseError> {
        self.need(field, 2)?;
        Ok(self.body.get_u16())
    }

    fn u32(&mut self, field: &str) -> Result<u32, ParseError> {
        self.need(field, 4)?;
        Ok(self.body.get_u32())
    }

    fn u64(&mut self, field: &str) -> Result<u64, ParseError> {
        self.need(field, 8)?;
        Ok(self.body.get_u64())
    }

    fn bytes(&mut self, field: &str, n: usize) -> Result<Bytes, ParseError> {
        self.need(field, n)?;
        Ok(self.body.split_to(n))
    }

    fn action(&mut self) -> Result<String, ParseError> {
        let len = usize::from(self.u8("the action length")?);
        if len == 0 || len > MAX_ACTION_NAME {
            return Err(ParseError::malformed(format!(
                "an action name is 1 to {MAX_ACTION_NAME} bytes, not {len}"
            )));
        }
        let bytes = self.bytes("the action name", len)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| ParseError::malformed("the action name is not UTF-8"))
    }

    fn key(&mut self) -> Result<Bytes, ParseError> {
        let len = usize::from(self.u16("the key length")?);
        if len == 0 || len > MAX_KEY_LEN {
            return Err(ParseError {
                code: ErrorCode::InvalidKey,
                message: format!("a key is 1 to {MAX_KEY_LEN} bytes, not {len}"),
            });
        }
        self.bytes("the key", len)
    }

    fn addr(&mut self) -> Result<IpAddr, ParseError> {
        match self.u8("the address family")? {
            4 => {
                let b = self.bytes("the IPv4 address", 4)?;
                Ok(IpAddr::from(
                    <[u8; 4]>::try_from(&b[..]).expect("length checked"),
                ))
            }
            6 => {
                let b = self.bytes("the IPv6 address", 16)?;
                Ok(IpAddr::from(
                    <[u8; 16]>::try_from(&b[..]).expect("length checked"),
                ))
            }
            other => Err(ParseError::malformed(format!(
                "address family {other} is neither 4 nor 6"
            ))),
        }
    }

    fn verdict(&mut self) -> Result<Verdict, ParseError> {
        let raw = self.u8("the outcome")?;
        let outcome = Outcome::from_wire(raw)
            .ok_or_else(|| ParseError::malformed(format!("unknown outcome {raw}")))?;
        Ok(Verdict::new(
            outcome,
            self.u32("the limit")?,
            self.u32("remaining")?,
            self.u64("retry_after_ms")?,
            self.u64("reset_after_ms")?,
        ))
    }

    fn end(self) -> Result<(), ParseError> {
        if self.body.has_remaining() {
            return Err(ParseError::malformed(format!(
                "{} trailing bytes after a {} frame",
                self.body.remaining(),
                self.what
            )));
        }
        Ok(())
    }
}

/// Parses a request body (everything after the correlation id).
pub(crate) fn parse_request(opcode: u8, body: Bytes) -> Result<Request, ParseError> {
    let what = match opcode {
        op::CHECK => "check",
        op::PEEK => "peek",
        op::RESET => "reset",
        op::AUTH_FAILURE => "auth-failure",
        op::BAN => "ban",
        op::UNBAN => "unban",
        op::AUTHENTICATE => "authenticate",
        op::CHECK_PAYLOAD => "check-payload",
        op::CONNECTION_GONE => "connection-gone",
        op::ACQUIRE => "acquire",
        op::RELEASE => "release",
        other => {
            return Err(ParseError {
                code: ErrorCode::UnknownOpcode,
                message: format!("unknown request opcode 0x{other:02x}"),
            });
        }
    };
    let mut f = Fields { body, what };
    let request = match opcode {
        op::CHECK | op::PEEK | op::CHECK_PAYLOAD => {
            let action = f.action()?;
            let key = f.key()?;
            let cost = f.u32("the cost")?;
            if cost == 0 {
                return Err(ParseError {
                    code: ErrorCode::InvalidCost,
                    message: "a cost must be at least 1".into(),
                });
            }
            match opcode {
                op::CHECK => Request::Check { action, key, cost },
                op::PEEK => Request::Peek { action, key, cost },
                _ => Request::CheckPayload {
                    action,
                    key,
                    cost,
                    payload_bytes: f.u32("the payload size")?,
                },
            }
        }
        op::CONNECTION_GONE => Request::ConnectionGone { key: f.key()? },
        op::ACQUIRE | op::RELEASE => {
            let action = f.action()?;
            let key = f.key()?;
            let len = usize::from(f.u16("the session length")?);
            if len == 0 || len > MAX_KEY_LEN {
                return Err(ParseError::malformed(format!(
                    "a session name is 1 to {MAX_KEY_LEN} bytes, not {len}"
                )));
            }
            let session = f.bytes("the session name", len)?;
            if opcode == op::ACQUIRE {
                Request::Acquire {
                    action,
                    key,
                    session,
                }
            } else {
                Request::Release {
                    action,
                    key,
                    session,
                }
            }
        }
        op::RESET => Request::Reset {
            action: f.action()?,
            key: f.key()?,
        },
        op::AUTH_FAILURE => Request::AuthFailure { addr: f.addr()? },
        op::BAN => Request::Ban {
            addr: f.addr()?,
            ttl: Duration::from_millis(f.u64("the ban's ttl")?),
        },
        op::AUTHENTICATE => {
            let len = usize::from(f.u16("the token length")?);
            if len == 0 || len > MAX_TOKEN_LEN {
                return Err(ParseError::malformed(format!(
                    "a token is 1 to {MAX_TOKEN_LEN} bytes, not {len}"
                )));
            }
            Request::Authenticate {
                token: f.bytes("the token", len)?,
            }
        }
        _ => Request::Unban { addr: f.addr()? },
    };
    f.end()?;
    Ok(request)
}

fn put_addr(dst: &mut BytesMut, addr: IpAddr) {
    match addr {
        IpAddr::V4(v4) => {
            dst.put_u8(4);
            dst.put_slice(&v4.octets());
        }
        IpAddr::V6(v6) => {
            dst.put_u8(6);
            dst.put_slice(&v6.octets());
        }
    }
}

/// Writes the body of a request; the caller has checked the name and key lengths.
pub(crate) fn put_request(dst: &mut BytesMut, request: &Request) -> u8 {
    let put_target = |dst: &mut BytesMut, action: &str, key: &Bytes| {
        dst.put_u8(action.len() as u8);
        dst.put_slice(action.as_bytes());
        dst.put_u16(key.len() as u16);
        dst.put_slice(key);
    };
    match request {
        Request::Check { action, key, cost } | Request::Peek { action, key, cost } => {
            put_target(dst, action, key);
            dst.put_u32(*cost);
            if matches!(request, Request::Check { .. }) {
                op::CHECK
            } else {
                op::PEEK
            }
        }
        Request::Reset { action, key } => {
            put_target(dst, action, key);
            op::RESET
        }
        Request::AuthFailure { addr } => {
            put_addr(dst, *addr);
            op::AUTH_FAILURE
        }
        Request::Ban { addr, ttl } => {
            put_addr(dst, *addr);
            dst.put_u64(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX));
            op::BAN
        }
        Request::Unban { addr } => {
            put_addr(dst, *addr);
            op::UNBAN
        }
        Request::Authenticate { token } => {
            dst.put_u16(token.len() as u16);
            dst.put_slice(token);
            op::AUTHENTICATE
        }
        Request::CheckPayload {
            action,
            key,
            cost,
            payload_bytes,
        } => {
            put_target(dst, action, key);
            dst.put_u32(*cost);
            dst.put_u32(*payload_bytes);
            op::CHECK_PAYLOAD
        }
        Request::ConnectionGone { key } => {
            dst.put_u16(key.len() as u16);
            dst.put_slice(key);
            op::CONNECTION_GONE
        }
        Request::Acquire {
            action,
            key,
            session,
        }
        | Request::Release {
            action,
            key,
            session,
        } => {
            put_target(dst, action, key);
            dst.put_u16(session.len() as u16);
            dst.put_slice(session);
            if matches!(request, Request::Acquire { .. }) {
                op::ACQUIRE
            } else {
                op::RELEASE
            }
        }
    }
}

/// Checks what the wire cannot carry before anything is sent.
pub(crate) fn validate_request(request: &Request) -> Result<(), ParseError> {
    let target = match request {
        Request::Check { action, key, cost }
        | Request::Peek { action, key, cost }
        | Request::CheckPayload {
            action, key, cost, ..
        } => {
            if *cost == 0 {
                return Err(ParseError {
                    code: ErrorCode::InvalidCost,
                    message: "a cost must be at least 1".into(),
                });
            }
            Some((action, key))
        }
        Request::Reset { action, key } => Some((action, key)),
        Request::Acquire { session, .. } | Request::Release { session, .. }
            if session.is_empty() || session.len() > MAX_KEY_LEN =>
        {
            return Err(ParseError::malformed(format!(
                "a session name is 1 to {MAX_KEY_LEN} bytes, not {}",
                session.len()
            )));
        }
        Request::Acquire { action, key, .. } | Request::Release { action, key, .. } => {
            Some((action, key))
        }
        Request::ConnectionGone { key } if key.is_empty() || key.len() > MAX_KEY_LEN => {
            return Err(ParseError {
                code: ErrorCode::InvalidKey,
                message: format!("a key is 1 to {MAX_KEY_LEN} bytes, not {}", key.len()),
            });
        }
        Request::Authenticate { token } if token.is_empty() || token.len() > MAX_TOKEN_LEN => {
            return Err(ParseError::malformed(format!(
                "a token is 1 to {MAX_TOKEN_LEN} bytes, not {}",
                token.len()
            )));
        }
        _ => None,
    };
    if let Some((action, key)) = target {
        if action.is_empty() || action.len() > MAX_ACTION_NAME {
            return Err(ParseError::malformed(format!(
                "an action name is 1 to {MAX_ACTION_NAME} bytes, not {}",
                action.len()
            )));
        }
        if key.is_empty() || key.len() > MAX_KEY_LEN {
            return Err(ParseError {
                code: ErrorCode::InvalidKey,
                message: format!("a key is 1 to {MAX_KEY_LEN} bytes, not {}", key.len()),
            });
        }
    }
    Ok(())
}

fn escalation_wire(escalation: Escalation) -> (u8, u32) {
    match escalation {
        Escalation::Off => (0, 0),
        Escalation::Counted { failures } => (1, failures),
        Escalation::Banned => (2, 0),
        Escalation::AlreadyBanned => (3, 0),
        Escalation::BanFailed => (4, 0),
        Escalation::Untracked => (5, 0),
    }
}

/// Writes the body of a response and returns its opcode.
pub(crate) fn put_response(dst: &mut BytesMut, response: &Response) -> u8 {
    let put_verdict = |dst: &mut BytesMut, v: &Verdict| {
        dst.put_u8(v.outcome as u8);
        dst.put_u32(v.limit);
        dst.put_u32(v.remaining);
        dst.put_u64(v.retry_after_ms);
        dst.put_u64(v.reset_after_ms);
    };
    match response {
        Response::Verdict(v) => {
            put_verdict(dst, v);
            op::VERDICT
        }
        Response::Checked(c) => {
            put_verdict(dst, &c.verdict);
            // Outcome 0 (allowed) is never a refusal, so it stands for "none".
            dst.put_u8(c.would_refuse.map_or(0, |o| o as u8));
            op::CHECKED
        }
        Response::Done { changed } => {
            dst.put_u8(u8::from(*changed));
            op::DONE
        }
        Response::Escalation(e) => {
            let (state, failures) = escalation_wire(*e);
            dst.put_u8(state);
            dst.put_u32(failures);
            op::ESCALATION
        }
        Response::Error { code, message } => {
            dst.put_u8(*code as u8);
            // Messages are ours and short; cut rather than overflow the length field.
            let text = &message.as_bytes()[..message.len().min(1024)];
            dst.put_u16(text.len() as u16);
            dst.put_slice(text);
            op::ERROR
        }
    }
}

/// Parses a response body (everything after the correlation id).
pub(crate) fn parse_response(opcode: u8, body: Bytes) -> Result<Response, ParseError> {
    let what = match opcode {
        op::VERDICT => "verdict",
        op::DONE => "done",
        op::ESCALATION => "escalation",
        op::CHECKED => "checked",
        op::ERROR => "error",
        other => {
            return Err(ParseError {
                code: ErrorCode::UnknownOpcode,
                message: format!("unknown response opcode 0x{other:02x}"),
            });
        }
    };
    let mut f = Fields { body, what };
    let response = match opcode {
        op::VERDICT => Response::Verdict(f.verdict()?),
        op::CHECKED => {
            let verdict = f.verdict()?;
            let raw = f.u8("the monitor flag")?;
            let would_refuse = match raw {
                0 => None,
                raw => Some(
                    Outcome::from_wire(raw)
                        .filter(|o| !o.allowed())
                        .ok_or_else(|| {
                            ParseError::malformed(format!("{raw} is no refusal to monitor"))
                        })?,
                ),
            };
            Response::Checked(Checked {
                verdict,
                would_refuse,
            })
        }
        op::DONE => Response::Done {
            changed: f.u8("the changed flag")? != 0,
        },
        op::ESCALATION => {
            let state = f.u8("the escalation state")?;
            let failures = f.u32("the failure count")?;
            Response::Escalation(match state {
                0 => Escalation::Off,
                1 => Escalation::Counted { failures },
                2 => Escalation::Banned,
                3 => Escalation::AlreadyBanned,
                4 => Escalation::BanFailed,
                5 => Escalation::Untracked,
                other => {
                    return Err(ParseError::malformed(format!(
                        "unknown escalation state {other}"
                    )));
                }
            })
        }
        _ => {
            let raw = f.u8("the error code")?;
            let code = ErrorCode::from_wire(raw)
                .ok_or_else(|| ParseError::malformed(format!("unknown error code {raw}")))?;
            let len = usize::from(f.u16("the message length")?);
            let text = f.bytes("the message", len)?;
            Response::Error {
                code,
                message: String::from_utf8_lossy(&text).into_owned(),
            }
        }
    };
    f.end()?;
    Ok(response)
}

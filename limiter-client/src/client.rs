//! The async Rust client for the broker protocol.
//!
//! One connection carries any number of requests in flight: a driver task owns the socket,
//! numbers each request, and routes each reply to its caller by correlation id, so clones of a
//! [`Client`] used from many tasks pipeline onto the same connection.

use std::{
    collections::HashMap,
    io,
    net::{IpAddr, SocketAddr},
    path::Path,
    time::Duration,
};

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::{TcpStream, UnixStream},
    sync::{mpsc, oneshot},
};
use tokio_util::codec::{FramedRead, FramedWrite};

use crate::{
    codec::{ClientCodec, CodecError, DEFAULT_MAX_FRAME},
    frame::{ErrorCode, Request, Response, validate_request},
    verdict::{Checked, Escalation, Verdict},
};

/// Requests in flight per connection. Bounded so that a client that stops reading cannot make
/// both ends block on full socket buffers.
const MAX_IN_FLIGHT: usize = 1024;

/// Why a call got no answer it could return. A refused check is not an error: it is a
/// [`Verdict`] whose `allowed` is false.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The socket could not be reached; the agent is probably not running.
    #[error("connecting to the limiter at {target}")]
    Connect {
        /// The socket path or TCP address, as tried.
        target: String,
        /// Why the connection failed.
        #[source]
        source: io::Error,
    },
    /// The agent answered with an error reply, e.g. an unknown action.
    #[error("the limiter answered {code:?}: {message}")]
    Server {
        /// What kind of failure, for code to branch on.
        code: ErrorCode,
        /// The agent's explanation.
        message: String,
    },
    /// The request breaks a limit of the wire format (an empty or overlong name or key, a
    /// zero cost) and was not sent.
    #[error("the request cannot be sent: {0}")]
    Invalid(String),
    /// The connection ended before this request was answered. The client does not
    /// reconnect: make a new one.
    #[error("the connection to the limiter closed before the reply")]
    Closed,
    /// A reply could not be read, which means the two ends disagree about the protocol.
    #[error("the limiter sent an unreadable reply: {0}")]
    Protocol(String),
    /// A reply of the wrong kind for its request, e.g. a `done` answering a check.
    #[error("the limiter sent a {got} reply to a {sent} request")]
    UnexpectedReply {
        /// The request's name.
        sent: &'static str,
        /// The reply's name.
        got: &'static str,
    },
}

type Reply = oneshot::Sender<Result<Response, ClientError>>;

/// A connection to the agent. Cheap to clone: clones share the connection, and requests
/// from any of them pipeline onto it, so one `Client` per process is usually right.
///
/// Every method needs a running tokio runtime; the connection's driver task ends when the
/// last clone is dropped.
#[derive(Clone, Debug)]
pub struct Client {
    calls: mpsc::Sender<(Request, Reply)>,
}

impl Client {
    /// Connects to the agent's Unix socket (by default `/run/limiter/limiter.sock`).
    pub async fn connect_unix(path: impl AsRef<Path>) -> Result<Self, ClientError> {
        let path = path.as_ref();
        let stream = UnixStream::connect(path)
            .await
            .map_err(|source| ClientError::Connect {
                target: path.display().to_string(),
                source,
            })?;
        Ok(Self::over(stream))
    }

    /// Connects over TCP, for an agent started with `--listen`. Nagle is turned off: a
    /// check is one small frame and waiting to batch it only adds latency.
    pub async fn connect_tcp(addr: SocketAddr) -> Result<Self, ClientError> {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|source| ClientError::Connect {
                target: addr.to_string(),
                source,
            })?;
        let _ = stream.set_nodelay(true);
        Ok(Self::over(stream))
    }

    /// Runs the protocol over any stream; the driver task ends when every clone is dropped.
    pub fn over<S>(stream: S) -> Self
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (calls, rx) = mpsc::channel(MAX_IN_FLIGHT);
        tokio::spawn(drive(stream, rx));
        Self { calls }
    }

    /// Spends `cost` tokens from `key`'s bucket in `action` if it can pay. A refusal is an
    /// `Ok` verdict with `allowed == false`; `Err` means there is no answer.
    pub async fn check(
        &self,
        action: &str,
        key: impl AsRef<[u8]>,
        cost: u32,
    ) -> Result<Verdict, ClientError> {
        let request = Request::Check {
            action: action.to_owned(),
            key: Bytes::copy_from_slice(key.as_ref()),
            cost,
        };
        match self.call(request).await? {
            Response::Verdict(v) => Ok(v),
            other => Err(unexpected("check", &other)),
        }
    }

    /// What [`check`](Self::check) would answer now, spending nothing.
    pub async fn peek(
        &self,
        action: &str,
        key: impl AsRef<[u8]>,
        cost: u32,
    ) -> Result<Verdict, ClientError> {
        let request = Request::Peek {
            action: action.to_owned(),
            key: Bytes::copy_from_slice(key.as_ref()),
            cost,
        };
        match self.call(request).await? {
            Response::Verdict(v) => Ok(v),
            other => Err(unexpected("peek", &other)),
        }
    }

    /// [`check`](Self::check) with the size of the payload being checked, for actions with
    /// `max-payload-bytes` and strikes (protocol 1.3): the verdict may be
    /// [`Outcome::Disconnect`](crate::Outcome::Disconnect), and says what a monitored action
    /// would have refused. An agent before 1.3 answers [`ErrorCode::UnknownOpcode`](crate::ErrorCode::UnknownOpcode).
    pub async fn check_payload(
        &self,
        action: &str,
        key: impl AsRef<[u8]>,
        cost: u32,
        payload_bytes: u32,
    ) -> Result<Checked, ClientError> {
        let request = Request::CheckPayload {
            action: action.to_owned(),
            key: Bytes::copy_from_slice(key.as_ref()),
            cost,
            payload_bytes,
        };
        match self.call(request).await? {
            Response::Checked(c) => Ok(c),
            other => Err(unexpected("check-payload", &other)),
        }
    }

    /// Tells the agent that the broker's connection `key` (a key of its actions keyed by
    /// `connection`) is gone, so its buckets and strikes are forgotten; `true` if it had any.
    pub async fn connection_gone(&self, key: impl AsRef<[u8]>) -> Result<bool, ClientError> {
        let request = Request::ConnectionGone {
            key: Bytes::copy_from_slice(key.as_ref()),
        };
        match self.call(request).await? {
            Response::Done { changed } => Ok(changed),
            other => Err(unexpected("connection-gone", &other)),
        }
    }

    /// Takes one of `key`'s sessions in the concurrency `action`, named `session`: allowed
    /// while fewer than the limit are held, `limited` otherwise. This connection holds it
    /// until [`release`](Self::release), or until the connection ends (the agent then frees
    /// every session it held). Protocol 1.3.
    pub async fn acquire(
        &self,
        action: &str,
        key: impl AsRef<[u8]>,
        session: impl AsRef<[u8]>,
    ) -> Result<Verdict, ClientError> {
        let request = Request::Acquire {
            action: action.to_owned(),
            key: Bytes::copy_from_slice(key.as_ref()),
            session: Bytes::copy_from_slice(session.as_ref()),
        };
        match self.call(request).await? {
            Response::Verdict(v) => Ok(v),
            other => Err(unexpected("acquire", &other)),
        }
    }

    /// Gives back a session this connection acquired; `true` if it held it.
    pub async fn release(
        &self,
        action: &str,
        key: impl AsRef<[u8]>,
        session: impl AsRef<[u8]>,
    ) -> Result<bool, ClientError> {
        let request = Request::Release {
            action: action.to_owned(),
            key: Bytes::copy_from_slice(key.as_ref()),
            session: Bytes::copy_from_slice(session.as_ref()),
        };
        match self.call(request).await? {
            Response::Done { changed } => Ok(changed),
            other => Err(unexpected("release", &other)),
        }
    }

    /// Forgets `key`'s bucket, so its next check finds it full. `true` if the key had a
    /// bucket to forget.
    pub async fn reset(&self, action: &str, key: impl AsRef<[u8]>) -> Result<bool, ClientError> {
        let request = Request::Reset {
            action: action.to_owned(),
            key: Bytes::copy_from_slice(key.as_ref()),
        };
        match self.call(request).await? {
            Response::Done { changed } => Ok(changed),
            other => Err(unexpected("reset", &other)),
        }
    }

    /// Reports a failed authentication by `addr`, which counts towards a kernel ban when the
    /// agent has escalation configured.
    pub async fn report_auth_failure(&self, addr: IpAddr) -> Result<Escalation, ClientError> {
        match self.call(Request::AuthFailure { addr }).await? {
            Response::Escalation(e) => Ok(e),
            other => Err(unexpected("auth-failure", &other)),
        }
    }

    /// Bans `addr` in the kernel for `ttl` (whole milliseconds): its new connections are
    /// refused before they reach any socket.
    pub async fn ban(&self, addr: IpAddr, ttl: Duration) -> Result<(), ClientError> {
        match self.call(Request::Ban { addr, ttl }).await? {
            Response::Done { .. } => Ok(()),
            other => Err(unexpected("ban", &other)),
        }
    }

    /// Lifts a ban on `addr` and clears its escalation count; `true` if a ban was in force.
    pub async fn unban(&self, addr: IpAddr) -> Result<bool, ClientError> {
        match self.call(Request::Unban { addr }).await? {
            Response::Done { changed } => Ok(changed),
            other => Err(unexpected("unban", &other)),
        }
    }

    /// Presents the agent's broker admin token (`[broker] admin-token`), after which this
    /// connection may reset, ban and unban: the way a client over TCP, or a Unix-socket client
    /// outside the admin users and groups, becomes trusted. A wrong token is
    /// [`ErrorCode::BadToken`](crate::ErrorCode::BadToken) and changes nothing; an agent
    /// without a token answers [`ErrorCode::NotPermitted`](crate::ErrorCode::NotPermitted).
    pub async fn authenticate(&self, token: impl AsRef<[u8]>) -> Result<(), ClientError> {
        let token = Bytes::copy_from_slice(token.as_ref());
        match self.call(Request::Authenticate { token }).await? {
            Response::Done { .. } => Ok(()),
            other => Err(unexpected("authenticate", &other)),
        }
    }

    /// Sends one request and waits for its reply; error replies become [`ClientError::Server`].
    pub async fn call(&self, request: Request) -> Result<Response, ClientError> {
        validate_request(&request).map_err(|e| ClientError::Invalid(e.message))?;
        let (reply, answer) = oneshot::channel();
        self.calls
            .send((request, reply))
            .await
            .map_err(|_| ClientError::Closed)?;
        match answer.await.map_err(|_| ClientError::Closed)?? {
            Response::Error { code, message } => Err(ClientError::Server { code, message }),
            response => Ok(response),
        }
    }
}

fn unexpected(sent: &'static str, got: &Response) -> ClientError {
    ClientError::UnexpectedReply {
        sent,
        got: match got {
            Response::Verdict(_) => "verdict",
            Response::Done { .. } => "done",
            Response::Escalation(_) => "escalation",
            Response::Checked(_) => "checked",
            Response::Error { .. } => "error",
        },
    }
}

async fn drive<S>(stream: S, mut calls: mpsc::Receiver<(Request, Reply)>)
where
    S: AsyncRead + AsyncWrite,
{
    let (read, write) = tokio::io::split(stream);
    let codec = ClientCodec::new(DEFAULT_MAX_FRAME);
    let mut reader = FramedRead::new(read, codec);
    let mut writer = FramedWrite::new(write, codec);
    let mut pending: HashMap<u32, Reply> = HashMap::new();
    let mut next_id: u32 = 0;
    let failure = loop {
        tokio::select! {
            call = calls.recv(), if pending.len() < MAX_IN_FLIGHT => {
                let Some(mut call) = call else { break None };
                // Take everything queued, write it, flush once.
                loop {
                    // Id 0 is what the server uses for frames it could not read an id from.
                    next_id = next_id.wrapping_add(1).max(1);
                    let (request, reply) = call;
                    if let Err(error) = writer.feed((next_id, &request)).await {
                        let _ = reply.send(Err(ClientError::Protocol(error.to_string())));
                        break;
                    }
                    pending.insert(next_id, reply);
                    if pending.len() >= MAX_IN_FLIGHT {
                        break;
                    }
                    match calls.try_recv() {
                        Ok(more) => call = more,
                        Err(_) => break,
                    }
                }
                if writer.flush().await.is_err() {
                    break Some(ClientError::Closed);
                }
            }
            frame = reader.next() => match frame {
                Some(Ok(received)) => {
                    let message = received
                        .message
                        .map_err(|e| ClientError::Protocol(e.message));
                    match pending.remove(&received.id) {
                        Some(reply) => { let _ = reply.send(message); }
                        // An id-0 error: the server could not parse a frame and is closing.
                        None => break Some(match message {
                            Ok(Response::Error { code, message }) => ClientError::Server { code, message },
                            _ => ClientError::Protocol(format!("a reply to unknown request {}", received.id)),
                        }),
                    }
                }
                Some(Err(CodecError::TooLarge { len, max })) => {
                    break Some(ClientError::Protocol(format!("reply of {len} bytes exceeds {max}")));
                }
                Some(Err(CodecError::Io(_))) | None => break Some(ClientError::Closed),
            },
        }
    };
    // Whatever is still waiting learns why it will never get an answer.
    for (_, reply) in pending.drain() {
        let error = match &failure {
            Some(ClientError::Server { code, message }) => ClientError::Server {
                code: *code,
                message: message.clone(),
            },
            _ => ClientError::Closed,
        };
        let _ = reply.send(Err(error));
    }
}

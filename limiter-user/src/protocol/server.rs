//! Serving the protocol on the Unix socket (and optionally TCP).
//!
//! Each connection is its own task: a client that sends garbage, stalls mid-frame or vanishes
//! affects nobody else. Replies are written in the order requests arrive and flushed once per
//! batch of requests already buffered, so a pipelining client gets one write per batch. Checks
//! of shared actions wait on the fleet's Redis: those of one batch wait together (pipelined on
//! the one connection to Redis), and a batch without them is answered as before, at once.
//!
//! Each listener holds at most `clients.max` connections ([`Admission`]); a connection gets
//! `header_timeout` for its first whole frame and `idle_timeout` between frames. Requests that
//! change state (ban, unban, reset) are served only to trusted peers: over the Unix socket, a
//! peer whose uid or primary gid (`SO_PEERCRED`) is in the admin lists; over either listener,
//! a connection that presented the admin token (the authenticate request).
//!
//! A reload changes the limits, the admin lists and the token through [`ServeControl`]; they
//! apply to connections accepted (and tokens presented) from then on, and a changed cap at
//! once.

use std::{
    future::Future,
    io,
    net::SocketAddr,
    os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt},
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
    time::Duration,
};

use futures::{FutureExt, SinkExt, StreamExt, stream::FuturesOrdered};
use limiter_client::{
    Checked, CodecError, ErrorCode, NEVER_MS, Outcome, ParseError, Received, Request, Response,
    ServerCodec, Verdict,
};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::{TcpListener, UnixListener},
    task::JoinSet,
};
use tokio_util::codec::Framed;

use crate::{
    admission::{AcceptBackoff, Admission, Ticket},
    api::ban_ttl,
    buckets::{CheckError, Judged, Limiter, Pending, SessionOwner, Submit},
    errors::error_chain,
    events::{self, BanCause, Event},
    secret::token_matches,
    settings::{ClientLimits, ServeConfig},
};

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("creating the socket directory {path}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("another limiter is already serving on {0}")]
    InUse(PathBuf),
    #[error("{path} exists and is not a socket; refusing to remove it")]
    NotASocket { path: PathBuf },
    #[error("binding {path}")]
    BindUnix {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("setting the mode of {path}")]
    Chmod {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("listening on {addr}")]
    BindTcp {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
}

/// Listeners bound and ready: a client may connect as soon as this exists.
pub struct Server {
    limiter: Arc<Limiter>,
    unix: UnixListener,
    socket: PathBuf,
    tcp: Option<TcpListener>,
    max_frame: usize,
    control: ServeControl,
}

/// What one connection has established: its trust, its sessions, and what it has shown it
/// reads.
struct Connection {
    peer: Peer,
    /// The sessions this connection acquired: freed when it ends, however it ends.
    sessions: SessionOwner,
    /// It sent a request of protocol 1.3 or later, so it reads the outcomes 1.3 added.
    speaks_1_3: bool,
}

/// What a connection's peer may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Peer {
    /// Checks, peeks and auth-failure reports only.
    Untrusted,
    /// Also ban, unban and reset.
    Admin,
}

/// The settings a reload may change, as the server applies them.
#[derive(Clone, Debug)]
struct Access {
    clients: ClientLimits,
    admin_uids: Vec<u32>,
    /// Resolved: the socket's group when the settings name none.
    admin_gids: Vec<u32>,
    token: Option<String>,
}

/// A running server's reloadable settings: the client limits (for connections accepted from
/// now on, and each listener's cap at once), the admin users and groups, and the admin token.
#[derive(Clone)]
pub struct ServeControl {
    access: Arc<RwLock<Access>>,
    unix_slots: Arc<Admission>,
    tcp_slots: Arc<Admission>,
    socket_gid: u32,
}

impl ServeControl {
    fn new(config: &ServeConfig, socket_gid: u32) -> Self {
        let control = Self {
            access: Arc::new(RwLock::new(Self::resolve(config, socket_gid))),
            unix_slots: Admission::new(config.clients.max),
            tcp_slots: Admission::new(config.clients.max),
            socket_gid,
        };
        control.log();
        control
    }

    fn resolve(config: &ServeConfig, socket_gid: u32) -> Access {
        Access {
            clients: config.clients,
            admin_uids: config.admin.uids.clone(),
            // By default the socket's group is trusted: it is the group brokers are put in.
            admin_gids: config
                .admin
                .gids
                .clone()
                .unwrap_or_else(|| vec![socket_gid]),
            token: config.admin.token.clone(),
        }
    }

    /// Takes the reloadable part of `config`; the socket and the TCP address stay as bound.
    pub fn apply(&self, config: &ServeConfig) {
        *self.access.write().expect("access lock") = Self::resolve(config, self.socket_gid);
        self.unix_slots.resize(config.clients.max);
        self.tcp_slots.resize(config.clients.max);
        self.log();
    }

    fn log(&self) {
        let access = self.current();
        tracing::info!(
            admin_uids = ?access.admin_uids,
            admin_gids = ?access.admin_gids,
            admin_token = access.token.is_some(),
            max_clients = access.clients.max,
            "broker protocol access"
        );
    }

    fn current(&self) -> Access {
        self.access.read().expect("access lock").clone()
    }
}

/// Binds per `config` and serves until `shutdown` resolves; the agent's entry point.
pub async fn serve(
    config: &ServeConfig,
    limiter: Arc<Limiter>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    Server::bind(config, limiter).await?.run(shutdown).await;
    Ok(())
}

impl Server {
    pub async fn bind(config: &ServeConfig, limiter: Arc<Limiter>) -> Result<Self, ServeError> {
        let path = &config.socket;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| ServeError::CreateDir {
                path: dir.to_owned(),
                source,
            })?;
        }
        remove_stale_socket(path).await?;
        let unix = UnixListener::bind(path).map_err(|source| ServeError::BindUnix {
            path: path.clone(),
            source,
        })?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(config.socket_mode))
            .map_err(|source| ServeError::Chmod {
                path: path.clone(),
                source,
            })?;
        let tcp = match config.listen {
            Some(addr) => Some(
                TcpListener::bind(addr)
                    .await
                    .map_err(|source| ServeError::BindTcp { addr, source })?,
            ),
            None => None,
        };
        let socket_gid =
            std::fs::metadata(path)
                .map(|m| m.gid())
                .map_err(|source| ServeError::Chmod {
                    path: path.clone(),
                    source,
                })?;
        tracing::info!(socket = %path.display(), tcp = ?config.listen, "serving the broker protocol");
        Ok(Self {
            limiter,
            unix,
            socket: path.clone(),
            tcp,
            max_frame: config.max_frame,
            control: ServeControl::new(config, socket_gid),
        })
    }

    /// The handle a reload changes this server's settings through.
    pub fn control(&self) -> ServeControl {
        self.control.clone()
    }

    /// The TCP address actually bound (useful with port 0).
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// Accepts until `shutdown` resolves, then drops every connection and removes the socket.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let mut connections = JoinSet::new();
        let served = Served {
            codec: ServerCodec::new(self.max_frame),
            limiter: Arc::clone(&self.limiter),
            access: Arc::clone(&self.control.access),
        };
        let (unix_slots, tcp_slots) = (&self.control.unix_slots, &self.control.tcp_slots);
        let (mut unix_backoff, mut tcp_backoff) =
            (AcceptBackoff::new("unix"), AcceptBackoff::new("tcp"));
        let tcp_accept = async |tcp: &Option<TcpListener>| match tcp {
            Some(listener) => listener.accept().await.map(|(stream, _)| stream),
            None => std::future::pending().await,
        };
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                accepted = self.unix.accept() => match accepted {
                    Ok((stream, _)) => {
                        unix_backoff.succeeded();
                        let access = self.control.current();
                        let peer = match stream.peer_cred() {
                            Ok(cred)
                                if access.admin_uids.contains(&cred.uid())
                                    || access.admin_gids.contains(&cred.gid()) =>
                            {
                                Peer::Admin
                            }
                            _ => Peer::Untrusted,
                        };
                        let ticket = unix_slots.admit().await;
                        connections.spawn(served.clone().connection(stream, peer, ticket));
                    }
                    Err(error) => unix_backoff.failed(&error).await,
                },
                accepted = tcp_accept(&self.tcp) => match accepted {
                    Ok(stream) => {
                        tcp_backoff.succeeded();
                        let _ = stream.set_nodelay(true);
                        let ticket = tcp_slots.admit().await;
                        connections.spawn(served.clone().connection(stream, Peer::Untrusted, ticket));
                    }
                    Err(error) => tcp_backoff.failed(&error).await,
                },
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
            }
        }
        connections.shutdown().await;
        if let Err(error) = std::fs::remove_file(&self.socket) {
            tracing::warn!(%error, socket = %self.socket.display(), "removing the socket");
        }
    }
}

/// A socket file left by a crash is removed; one that still answers belongs to a live agent.
async fn remove_stale_socket(path: &Path) -> Result<(), ServeError> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if !meta.file_type().is_socket() {
        return Err(ServeError::NotASocket {
            path: path.to_owned(),
        });
    }
    if tokio::net::UnixStream::connect(path).await.is_ok() {
        return Err(ServeError::InUse(path.to_owned()));
    }
    std::fs::remove_file(path).map_err(|source| ServeError::BindUnix {
        path: path.to_owned(),
        source,
    })
}

/// What every connection task shares.
#[derive(Clone)]
struct Served {
    codec: ServerCodec,
    limiter: Arc<Limiter>,
    access: Arc<RwLock<Access>>,
}

impl Served {
    /// Serves one client until it closes, breaks framing, stays silent past its timeout, loses
    /// its slot to a newer connection, or the server stops.
    async fn connection<S>(self, stream: S, peer: Peer, ticket: Ticket)
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let clients = self.access.read().expect("access lock").clients;
        let mut framed = Framed::new(stream, self.codec);
        let evicted = ticket.evicted();
        tokio::pin!(evicted);
        let mut wait = clients.header_timeout;
        // Replies still waiting on Redis, and those behind them, which keep their order.
        let mut waiting = Waiting::new();
        let mut connection = Connection {
            peer,
            sessions: SessionOwner::default(),
            speaks_1_3: false,
        };
        loop {
            let first = tokio::select! {
                () = &mut evicted => {
                    tracing::debug!("connection closed to make room for a newer one");
                    return;
                }
                Some(reply) = waiting.next(), if !waiting.is_empty() => {
                    if !self.send_ready(&mut framed, reply, &mut waiting, clients.idle_timeout).await {
                        return;
                    }
                    continue;
                }
                next = tokio::time::timeout(wait, framed.next()), if waiting.len() < MAX_WAITING => {
                    match next {
                        Ok(Some(first)) => first,
                        Ok(None) => {
                            // The client is done sending; what it asked is still answered.
                            self.finish(&mut framed, &mut waiting, clients.idle_timeout).await;
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(?wait, "connection closed: no whole frame in time");
                            return;
                        }
                    }
                }
            };
            ticket.proven();
            wait = clients.idle_timeout;
            if !self
                .answer_buffered(&mut framed, first, &mut connection, clients, &mut waiting)
                .await
            {
                return;
            }
        }
    }

    /// Answers `first` and everything already buffered behind it: replies that need no wait
    /// are sent, in order, then flushed once; checks waiting on Redis join `waiting`, and so
    /// does every reply behind them. False when the connection is over.
    async fn answer_buffered<S>(
        &self,
        framed: &mut Framed<S, ServerCodec>,
        first: Result<Received<Request>, CodecError>,
        connection: &mut Connection,
        clients: ClientLimits,
        waiting: &mut Waiting,
    ) -> bool
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let mut next = Some(first);
        while let Some(item) = next.take() {
            let (reply, fatal) = match item {
                Ok(received) => (self.answer(received, connection), false),
                Err(CodecError::TooLarge { len, max }) => (
                    Pending::ready((
                        0,
                        error(
                            ErrorCode::FrameTooLarge,
                            format!("frame of {len} bytes exceeds the maximum of {max}; closing"),
                        ),
                    )),
                    true,
                ),
                Err(CodecError::Io(error)) => {
                    tracing::debug!(%error, "connection ended mid-frame or failed");
                    // Requests that arrived whole before the break are still answered.
                    self.finish(framed, waiting, clients.idle_timeout).await;
                    return false;
                }
            };
            match reply.now() {
                Ok(reply) if waiting.is_empty() => {
                    if framed.feed(reply).await.is_err() {
                        return false;
                    }
                }
                Ok(reply) => waiting.push_back(Pending::ready(reply)),
                Err(later) => waiting.push_back(later),
            }
            if fatal {
                self.finish(framed, waiting, clients.idle_timeout).await;
                return false;
            }
            if waiting.len() < MAX_WAITING {
                next = framed.next().now_or_never().flatten();
            }
        }
        self.flush(framed, clients.idle_timeout).await
    }

    /// Sends `reply` and every reply ready behind it, then flushes.
    async fn send_ready<S>(
        &self,
        framed: &mut Framed<S, ServerCodec>,
        reply: (u32, Response),
        waiting: &mut Waiting,
        idle: Duration,
    ) -> bool
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let mut next = Some(reply);
        while let Some(reply) = next.take() {
            if framed.feed(reply).await.is_err() {
                return false;
            }
            next = waiting.next().now_or_never().flatten();
        }
        self.flush(framed, idle).await
    }

    /// Sends every reply still to come, as it comes, and flushes: the connection is ending.
    async fn finish<S>(
        &self,
        framed: &mut Framed<S, ServerCodec>,
        waiting: &mut Waiting,
        idle: Duration,
    ) where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        while let Some(reply) = waiting.next().await {
            if framed.feed(reply).await.is_err() {
                return;
            }
        }
        self.flush(framed, idle).await;
    }

    /// A reader that never drains its replies cannot hold the connection past the timeout.
    async fn flush<S>(&self, framed: &mut Framed<S, ServerCodec>, idle: Duration) -> bool
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        matches!(tokio::time::timeout(idle, framed.flush()).await, Ok(Ok(())))
    }
}

/// Replies of one connection not yet sent, in the order of their requests.
type Waiting = FuturesOrdered<Pending<(u32, Response)>>;

/// Requests of one connection waiting on Redis at most; past it the connection is not read
/// until some are answered (each within the check timeout).
const MAX_WAITING: usize = 1024;

fn error(code: ErrorCode, message: impl Into<String>) -> Response {
    Response::Error {
        code,
        message: message.into(),
    }
}

fn check_error(e: CheckError) -> Response {
    let code = match e {
        CheckError::UnknownAction(_) => ErrorCode::UnknownAction,
        CheckError::InvalidKey { .. } => ErrorCode::InvalidKey,
        CheckError::ZeroCost => ErrorCode::InvalidCost,
        CheckError::NotConcurrency(_) => ErrorCode::WrongKind,
    };
    error(code, e.to_string())
}

impl Served {
    /// Whether `token` is the admin token; a match makes the connection trusted.
    fn authenticate(&self, token: &[u8], peer: &mut Peer) -> Response {
        let expected = self.access.read().expect("access lock").token.clone();
        match expected {
            None => error(
                ErrorCode::NotPermitted,
                "this agent has no broker admin token ([broker] admin-token), so none is accepted",
            ),
            Some(expected) if token_matches(token, &expected) => {
                *peer = Peer::Admin;
                Response::Done { changed: true }
            }
            Some(_) => error(
                ErrorCode::BadToken,
                "that is not the agent's broker admin token; the connection is as trusted as before",
            ),
        }
    }

    /// The reply to one request: at once, or once the fleet's Redis has answered. An accepted
    /// token makes the connection trusted.
    fn answer(
        &self,
        received: Received<Request>,
        connection: &mut Connection,
    ) -> Pending<(u32, Response)> {
        let limiter = &self.limiter;
        let id = received.id;
        let request = match received.message {
            Ok(request) => request,
            Err(ParseError { code, message }) => return Pending::ready((id, error(code, message))),
        };
        if id == 0 {
            return Pending::ready((
                0,
                error(
                    ErrorCode::Malformed,
                    "id 0 is reserved for the agent's connection-level errors; use another id",
                ),
            ));
        }
        connection.speaks_1_3 |= since_1_3(&request);
        // A client before 1.3 reports outcomes 6 and 7 as a malformed reply.
        let plain = if connection.speaks_1_3 {
            plain
        } else {
            plain_before_1_3
        };
        let admin_only = matches!(
            request,
            Request::Reset { .. } | Request::Ban { .. } | Request::Unban { .. }
        );
        if admin_only && connection.peer != Peer::Admin {
            return Pending::ready((
                id,
                error(
                    ErrorCode::NotPermitted,
                    "ban, unban and reset are served only to the agent's admin users and groups \
                     over the Unix socket (admin-uids, admin-gids), or after the authenticate \
                     request with the broker admin token",
                ),
            ));
        }
        let response = match request {
            Request::Check { action, key, cost } => {
                return verdict(
                    id,
                    limiter,
                    (&action, &key),
                    (cost, 0),
                    Submit::Check,
                    plain,
                );
            }
            Request::Peek { action, key, cost } => {
                return verdict(id, limiter, (&action, &key), (cost, 0), Submit::Peek, plain);
            }
            Request::CheckPayload {
                action,
                key,
                cost,
                payload_bytes,
            } => {
                let weighed = (cost, payload_bytes);
                return verdict(
                    id,
                    limiter,
                    (&action, &key),
                    weighed,
                    Submit::Check,
                    flagged,
                );
            }
            Request::ConnectionGone { key } => Response::Done {
                changed: limiter.connection_gone(&key),
            },
            Request::Acquire {
                action,
                key,
                session,
            } => match limiter.acquire(&connection.sessions, &action, &key, &session) {
                Ok(judged) => return later(id, judged, plain),
                Err(e) => check_error(e),
            },
            Request::Release {
                action,
                key,
                session,
            } => match limiter.release(&connection.sessions, &action, &key, &session) {
                Ok(changed) => return later(id, changed, |changed| Response::Done { changed }),
                Err(e) => check_error(e),
            },
            Request::Reset { action, key } => match limiter.forget(&action, &key) {
                Err(e) => check_error(e),
                Ok(changed) => {
                    return later(id, changed, |changed| Response::Done { changed });
                }
            },
            Request::AuthFailure { addr } => {
                Response::Escalation(limiter.report_auth_failure(addr))
            }
            Request::Ban { addr, ttl } => match ban_ttl(ttl) {
                Err(e) => error(ErrorCode::BanFailed, e.to_string()),
                Ok(ttl) => match limiter.ban(addr, ttl) {
                    Ok(()) => {
                        events::emit(&Event::Ban {
                            addr: addr.to_canonical(),
                            cause: BanCause::Broker,
                            ttl,
                        });
                        Response::Done { changed: true }
                    }
                    Err(e) => error(ErrorCode::BanFailed, error_chain(&e)),
                },
            },
            Request::Unban { addr } => match limiter.unban(addr) {
                Ok(changed) => {
                    events::emit(&Event::Unban {
                        addr: addr.to_canonical(),
                        cause: BanCause::Broker,
                        lifted: changed,
                    });
                    Response::Done { changed }
                }
                Err(e) => error(ErrorCode::BanFailed, error_chain(&e)),
            },
            Request::Authenticate { token } => self.authenticate(&token, &mut connection.peer),
        };
        Pending::ready((id, response))
    }
}

fn verdict(
    id: u32,
    limiter: &Arc<Limiter>,
    (action, key): (&str, &[u8]),
    weighed: (u32, u32),
    how: Submit,
    reply: fn(Judged) -> Response,
) -> Pending<(u32, Response)> {
    match limiter
        .action_id(action)
        .and_then(|action| limiter.submit(&action, key, weighed, how))
    {
        Ok(judged) => later(id, judged, reply),
        Err(e) => Pending::ready((id, check_error(e))),
    }
}

/// The verdict reply (`0x81`) has no monitor flag: a monitored refusal goes out as the
/// allowance it is enforced as.
fn plain(judged: Judged) -> Response {
    Response::Verdict(judged.enforced())
}

/// The verdict reply for a client that has sent no request of protocol 1.3: the outcomes 1.3
/// added (`disconnect`, `payload_too_large`) go out as `limited`, a refusal it reads, with
/// "never" to retry.
fn plain_before_1_3(judged: Judged) -> Response {
    Response::Verdict(readable_before_1_3(judged.enforced()))
}

/// `verdict` as a client before protocol 1.3 can read it.
fn readable_before_1_3(verdict: Verdict) -> Verdict {
    match verdict.outcome {
        Outcome::Disconnect | Outcome::PayloadTooLarge => Verdict::new(
            Outcome::Limited,
            verdict.limit,
            0,
            NEVER_MS,
            verdict.reset_after_ms,
        ),
        _ => verdict,
    }
}

/// Whether `request` exists only since protocol 1.3: its sender reads 1.3's outcomes.
fn since_1_3(request: &Request) -> bool {
    matches!(
        request,
        Request::CheckPayload { .. }
            | Request::ConnectionGone { .. }
            | Request::Acquire { .. }
            | Request::Release { .. }
    )
}

/// The checked reply (`0x84`, protocol 1.3) says what a monitored action would have refused.
fn flagged(judged: Judged) -> Response {
    Response::Checked(Checked {
        verdict: judged.enforced(),
        would_refuse: judged.would_refuse(),
    })
}

/// The reply `reply` makes of an answer, now or when it comes.
fn later<T: Unpin + Send + 'static>(
    id: u32,
    answer: Pending<T>,
    reply: fn(T) -> Response,
) -> Pending<(u32, Response)> {
    match answer.now() {
        Ok(value) => Pending::ready((id, reply(value))),
        Err(waiting) => Pending::Waiting(Box::pin(async move { (id, reply(waiting.await)) })),
    }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use super::*;

    #[test]
    fn a_client_before_1_3_meets_no_outcome_it_cannot_read() {
        let closed = Verdict::new(Outcome::Disconnect, 10, 0, NEVER_MS, NEVER_MS);
        assert_eq!(
            readable_before_1_3(closed),
            Verdict::new(Outcome::Limited, 10, 0, NEVER_MS, NEVER_MS)
        );
        let oversize = Verdict::new(Outcome::PayloadTooLarge, 10, 0, NEVER_MS, 0);
        assert_eq!(readable_before_1_3(oversize).outcome, Outcome::Limited);
        for outcome in [
            Outcome::Allowed,
            Outcome::Unlimited,
            Outcome::Limited,
            Outcome::CostExceedsBurst,
            Outcome::Closed,
            Outcome::CostExceedsLimit,
        ] {
            let verdict = Verdict::new(outcome, 10, 3, 0, 600);
            assert_eq!(
                readable_before_1_3(verdict),
                verdict,
                "{outcome:?} is 1.2's"
            );
        }
    }

    #[test]
    fn only_requests_of_1_3_say_the_client_reads_it() {
        let key = bytes::Bytes::from_static(b"c1");
        assert!(since_1_3(&Request::ConnectionGone { key: key.clone() }));
        assert!(since_1_3(&Request::CheckPayload {
            action: "pub".into(),
            key: key.clone(),
            cost: 1,
            payload_bytes: 0
        }));
        assert!(!since_1_3(&Request::Check {
            action: "pub".into(),
            key,
            cost: 1
        }));
        assert!(!since_1_3(&Request::AuthFailure {
            addr: IpAddr::V4(Ipv4Addr::LOCALHOST)
        }));
    }
}

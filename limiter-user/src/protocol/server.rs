//! Serving the protocol on the Unix socket (and optionally TCP).
//!
//! Each connection is its own task: a client that sends garbage, stalls mid-frame or vanishes
//! affects nobody else. Replies are written in the order requests arrive and flushed once per
//! batch of requests already buffered, so a pipelining client gets one write per batch.

use std::{
    future::Future,
    io,
    net::SocketAddr,
    os::unix::fs::{FileTypeExt, PermissionsExt},
    path::{Path, PathBuf},
    sync::Arc,
};

use futures::{FutureExt, SinkExt, StreamExt};
use limiter_client::{CodecError, ErrorCode, ParseError, Received, Request, Response, ServerCodec};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::{TcpListener, UnixListener},
    task::JoinSet,
};
use tokio_util::codec::Framed;

use crate::{
    buckets::{CheckError, Limiter},
    settings::ServeConfig,
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
        tracing::info!(socket = %path.display(), tcp = ?config.listen, "serving the broker protocol");
        Ok(Self {
            limiter,
            unix,
            socket: path.clone(),
            tcp,
            max_frame: config.max_frame,
        })
    }

    /// The TCP address actually bound (useful with port 0).
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// Accepts until `shutdown` resolves, then drops every connection and removes the socket.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let mut connections = JoinSet::new();
        let codec = ServerCodec::new(self.max_frame);
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
                        connections.spawn(connection(stream, codec, self.limiter.clone()));
                    }
                    Err(error) => tracing::warn!(%error, "accepting on the Unix socket"),
                },
                accepted = tcp_accept(&self.tcp) => match accepted {
                    Ok(stream) => {
                        let _ = stream.set_nodelay(true);
                        connections.spawn(connection(stream, codec, self.limiter.clone()));
                    }
                    Err(error) => tracing::warn!(%error, "accepting on TCP"),
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

/// Serves one client until it closes, breaks framing, or the server stops.
async fn connection<S>(stream: S, codec: ServerCodec, limiter: Arc<Limiter>)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut framed = Framed::new(stream, codec);
    while let Some(first) = framed.next().await {
        let mut next = Some(first);
        // Answer everything already buffered, then flush once.
        while let Some(item) = next.take() {
            let (reply, fatal) = match item {
                Ok(received) => (answer(&limiter, received), false),
                Err(CodecError::TooLarge { len, max }) => (
                    (
                        0,
                        error(
                            ErrorCode::FrameTooLarge,
                            format!("frame of {len} bytes exceeds the maximum of {max}; closing"),
                        ),
                    ),
                    true,
                ),
                Err(CodecError::Io(error)) => {
                    tracing::debug!(%error, "connection ended mid-frame or failed");
                    // Requests that arrived whole before the break are still answered.
                    let _ = framed.flush().await;
                    return;
                }
            };
            if framed.feed(reply).await.is_err() {
                return;
            }
            if fatal {
                let _ = framed.flush().await;
                return;
            }
            next = framed.next().now_or_never().flatten();
        }
        if framed.flush().await.is_err() {
            return;
        }
    }
}

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
    };
    error(code, e.to_string())
}

fn answer(limiter: &Limiter, received: Received<Request>) -> (u32, Response) {
    let id = received.id;
    let request = match received.message {
        Ok(request) => request,
        Err(ParseError { code, message }) => return (id, error(code, message)),
    };
    let response = match request {
        Request::Check { action, key, cost } => limiter
            .check(&action, &key, cost)
            .map_or_else(check_error, Response::Verdict),
        Request::Peek { action, key, cost } => limiter
            .peek(&action, &key, cost)
            .map_or_else(check_error, Response::Verdict),
        Request::Reset { action, key } => limiter
            .reset(&action, &key)
            .map_or_else(check_error, |changed| Response::Done { changed }),
        Request::AuthFailure { addr } => Response::Escalation(limiter.report_auth_failure(addr)),
        Request::Ban { addr, ttl } => match limiter.ban(addr, ttl) {
            Ok(()) => Response::Done { changed: true },
            Err(e) => error(ErrorCode::BanFailed, e.to_string()),
        },
        Request::Unban { addr } => match limiter.unban(addr) {
            Ok(()) => Response::Done { changed: true },
            Err(e) => error(ErrorCode::BanFailed, e.to_string()),
        },
    };
    (id, response)
}

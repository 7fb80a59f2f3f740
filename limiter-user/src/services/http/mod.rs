//! The agent's HTTP listener: Prometheus metrics, health, the JSON views, the dashboards'
//! rate-limit check, and token-protected admin changes. Each group of routes has its module;
//! this one binds, routes and serves.
//!
//! Connections are served one task each by hyper, within the `clients` limits: at most `max`
//! at once ([`Admission`]: a newcomer takes the slot of the oldest connection that has not yet
//! sent a whole request), and `header_timeout` for each request's headers, which also closes
//! a keep-alive connection idle that long. The timeout is read from the live settings for
//! each new connection; a reload changes the cap through [`HttpServer::slots`].

mod admin_routes;
mod auth;
mod check_route;
mod problem;
mod read;

use std::{future::Future, io, net::SocketAddr, sync::Arc, time::Duration};

use axum::{
    Router, middleware,
    routing::{delete, get, post},
};
use hyper_util::rt::{TokioIo, TokioTimer};
use thiserror::Error;
use tokio::task::JoinSet;
use tower::ServiceExt;

pub use problem::{PROBLEM_JSON, Problem};

use super::{
    metrics::{Metrics, MetricsError},
    sweeper::SweepStats,
};
use crate::{
    admission::{AcceptBackoff, Admission},
    buckets::Limiter,
    datapath::Enforcer,
    settings::{CheckAccess, Live},
};

/// How long requests in flight get to finish once the agent stops.
const DRAIN: Duration = Duration::from_secs(5);

#[derive(Debug, Error)]
pub enum HttpError {
    #[error("binding the HTTP listener to {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("serving HTTP")]
    Serve(#[source] io::Error),
    #[error(transparent)]
    Metrics(#[from] MetricsError),
}

/// What the handlers reach: the datapath, the broker limiter, the live settings (the admin
/// token is read per request, so a reload applies at once) and the metrics registry.
#[derive(Clone)]
struct AppState {
    enforcer: Arc<Enforcer>,
    limiter: Arc<Limiter>,
    settings: Live,
    metrics: Arc<Metrics>,
}

/// The listener bound and the routes built: requests are accepted (queued by the kernel) as
/// soon as this exists, so a caller can learn the port before serving starts.
pub struct HttpServer {
    listener: tokio::net::TcpListener,
    app: Router,
    settings: Live,
    slots: Arc<Admission>,
}

impl HttpServer {
    /// Binds the `http` setting's address.
    pub async fn bind(
        enforcer: Arc<Enforcer>,
        limiter: Arc<Limiter>,
        settings: Live,
        sweep: &SweepStats,
    ) -> Result<Self, HttpError> {
        let (addr, max, closed) = settings.read(|s| {
            (
                s.restart.http,
                s.clients.max,
                s.check == CheckAccess::Closed,
            )
        });
        if closed {
            tracing::warn!("{}", check_route::CLOSED);
        }
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| HttpError::Bind { addr, source })?;
        let state = AppState {
            metrics: Arc::new(Metrics::new(&enforcer, &limiter, sweep)?),
            enforcer,
            limiter,
            settings: settings.clone(),
        };
        Ok(Self {
            listener,
            app: router(state),
            settings,
            slots: Admission::new(max),
        })
    }

    /// The listener's connection slots, which a reload resizes.
    pub fn slots(&self) -> Arc<Admission> {
        Arc::clone(&self.slots)
    }

    pub fn local_addr(&self) -> Result<SocketAddr, HttpError> {
        self.listener.local_addr().map_err(HttpError::Serve)
    }

    /// Serves until `shutdown` resolves, then lets requests in flight finish (for up to
    /// five seconds).
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), HttpError> {
        if let Ok(addr) = self.listener.local_addr() {
            tracing::info!(%addr, "HTTP listener up");
        }
        let slots = &self.slots;
        let mut backoff = AcceptBackoff::new("http");
        let stop = tokio_util::sync::CancellationToken::new();
        let mut connections = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        backoff.succeeded();
                        let ticket = slots.admit().await;
                        let app = self.app.clone();
                        let stop = stop.clone();
                        let header_timeout = self.settings.read(|s| s.clients.header_timeout);
                        connections.spawn(async move {
                            let evicted = ticket.evicted();
                            let ticket = Arc::new(ticket);
                            let service = hyper::service::service_fn(move |request| {
                                ticket.proven();
                                app.clone().oneshot(request)
                            });
                            let mut builder = hyper::server::conn::http1::Builder::new();
                            builder
                                .timer(TokioTimer::new())
                                .header_read_timeout(header_timeout);
                            let connection =
                                builder.serve_connection(TokioIo::new(stream), service);
                            tokio::pin!(connection);
                            tokio::select! {
                                _ = connection.as_mut() => return,
                                () = evicted => return,
                                () = stop.cancelled() => {}
                            }
                            connection.as_mut().graceful_shutdown();
                            let _ = tokio::time::timeout(DRAIN, connection).await;
                        });
                    }
                    Err(error) => backoff.failed(&error).await,
                },
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
            }
        }
        stop.cancel();
        while connections.join_next().await.is_some() {}
        Ok(())
    }
}

/// Every route of the listener.
fn router(state: AppState) -> Router {
    let admin = Router::new()
        .route("/v1/bans", post(admin_routes::ban))
        .route("/v1/bans/{addr}", delete(admin_routes::unban))
        .route(
            "/v1/allow",
            post(admin_routes::list_add::<admin_routes::Allow>)
                .delete(admin_routes::list_del::<admin_routes::Allow>),
        )
        .route(
            "/v1/deny",
            post(admin_routes::list_add::<admin_routes::Deny>)
                .delete(admin_routes::list_del::<admin_routes::Deny>),
        )
        // A route layer runs before the handler's extractors: an unauthorised request is
        // refused before its body is even read.
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            admin_routes::require_admin,
        ));
    Router::new()
        .route("/metrics", get(read::metrics))
        .route("/healthz", get(read::healthz))
        .route("/readyz", get(read::readyz))
        .route("/connections", get(read::connections))
        .route("/rate_limits", get(read::rate_limits))
        .route("/v1/status", get(read::status))
        .merge(
            Router::new()
                .route("/v1/check", post(check_route::check))
                .route_layer(middleware::from_fn_with_state(
                    state.clone(),
                    check_route::require_check_token,
                )),
        )
        .merge(admin)
        .fallback(problem::not_found)
        .with_state(state)
}

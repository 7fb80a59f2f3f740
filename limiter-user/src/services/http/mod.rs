//! The agent's HTTP listener: Prometheus metrics, health, the JSON views, the dashboards'
//! rate-limit check, and token-protected admin changes. Each group of routes has its module;
//! this one binds, routes and serves.

mod admin;
mod check;
mod problem;
mod read;

use std::{future::Future, io, net::SocketAddr, sync::Arc};

use axum::{
    Router, middleware,
    routing::{delete, get, post},
};
use thiserror::Error;

pub use problem::{PROBLEM_JSON, Problem};

use super::{
    metrics::{Metrics, MetricsError},
    sweeper::SweepStats,
};
use crate::{buckets::Limiter, datapath::Enforcer, settings::Live};

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
}

impl HttpServer {
    /// Binds the `http` setting's address.
    pub async fn bind(
        enforcer: Arc<Enforcer>,
        limiter: Arc<Limiter>,
        settings: Live,
        sweep: &SweepStats,
    ) -> Result<Self, HttpError> {
        let addr = settings.get().http;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| HttpError::Bind { addr, source })?;
        let state = AppState {
            metrics: Arc::new(Metrics::new(&enforcer, &limiter, sweep)?),
            enforcer,
            limiter,
            settings,
        };
        Ok(Self {
            listener,
            app: router(state),
        })
    }

    pub fn local_addr(&self) -> Result<SocketAddr, HttpError> {
        self.listener.local_addr().map_err(HttpError::Serve)
    }

    /// Serves until `shutdown` resolves, then lets requests in flight finish.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), HttpError> {
        if let Ok(addr) = self.listener.local_addr() {
            tracing::info!(%addr, "HTTP listener up");
        }
        axum::serve(self.listener, self.app)
            .with_graceful_shutdown(shutdown)
            .await
            .map_err(HttpError::Serve)
    }
}

/// Every route of the listener.
fn router(state: AppState) -> Router {
    let admin = Router::new()
        .route("/v1/bans", post(admin::ban))
        .route("/v1/bans/{addr}", delete(admin::unban))
        .route("/v1/allow", post(admin::allow_add).delete(admin::allow_del))
        .route("/v1/deny", post(admin::deny_add).delete(admin::deny_del))
        // A route layer runs before the handler's extractors: an unauthorised request is
        // refused before its body is even read.
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            admin::require_admin,
        ));
    Router::new()
        .route("/metrics", get(read::metrics))
        .route("/healthz", get(read::healthz))
        .route("/readyz", get(read::readyz))
        .route("/connections", get(read::connections))
        .route("/rate_limits", get(read::rate_limits))
        .route("/v1/status", get(read::status))
        .route("/v1/check", post(check::check))
        .merge(admin)
        .fallback(problem::not_found)
        .with_state(state)
}

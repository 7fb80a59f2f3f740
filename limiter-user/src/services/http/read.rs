//! The read-only endpoints: metrics, health, readiness and the JSON views.

use axum::{
    Json,
    extract::{Query, State, rejection::QueryRejection},
    http::{StatusCode, header},
    response::{IntoResponse, Response},
};
use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::{
    AppState,
    problem::{Problem, blocking, maps_problem, query_rejection},
};
use crate::{
    api::{Connections, RateLimits, Status},
    datapath::CookieMode,
    services::{
        metrics,
        view_builder::{broker_rate_limits, connections_view, kernel_rate_limits, kernel_status},
    },
};

pub(super) async fn metrics(State(state): State<AppState>) -> Result<Response, Problem> {
    let text = blocking(move || {
        state
            .metrics
            .render()
            .map_err(|e| Problem::internal("rendering the metrics", &e))
    })
    .await?;
    Ok(([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], text).into_response())
}

#[derive(Serialize)]
pub(super) struct Health {
    status: &'static str,
}

pub(super) async fn healthz() -> Json<Health> {
    Json(Health { status: "ok" })
}

pub(super) async fn readyz(State(state): State<AppState>) -> Result<Response, Problem> {
    let ready = blocking(move || Ok(state.enforcer.ready())).await?;
    Ok(if ready {
        Json(Health { status: "ready" }).into_response()
    } else {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the kernel programs are not attached or their maps do not answer",
        )
        .into_response()
    })
}

/// `limit`, for the lists of `/connections` and `/rate_limits`.
#[derive(Deserialize)]
pub(super) struct LimitQuery {
    limit: Option<usize>,
}

impl LimitQuery {
    fn get(
        query: Result<Query<LimitQuery>, QueryRejection>,
        default: usize,
    ) -> Result<usize, Problem> {
        let Query(query) = query.map_err(query_rejection)?;
        match query.limit {
            None => Ok(default),
            Some(0) => Err(Problem::bad_request("limit", "must be at least 1")),
            Some(n) => Ok(n),
        }
    }
}

pub(super) async fn connections(
    State(state): State<AppState>,
    query: Result<Query<LimitQuery>, QueryRejection>,
) -> Result<Json<Connections>, Problem> {
    let limit = LimitQuery::get(query, 20)?;
    let view =
        blocking(move || connections_view(&*state.enforcer, limit).map_err(maps_problem)).await?;
    Ok(Json(view))
}

pub(super) async fn rate_limits(
    State(state): State<AppState>,
    query: Result<Query<LimitQuery>, QueryRejection>,
) -> Result<Json<RateLimits>, Problem> {
    let limit = LimitQuery::get(query, 10)?;
    let view = blocking(move || {
        let mut kernel = kernel_rate_limits(&*state.enforcer, limit).map_err(maps_problem)?;
        let policy = state.enforcer.policy();
        kernel.ports = Some(policy.ports.clone());
        kernel.allow = Some(policy.allow.iter().map(IpNet::to_string).collect());
        kernel.deny = Some(policy.deny.iter().map(IpNet::to_string).collect());
        Ok(RateLimits {
            enabled: kernel.limits.enabled(),
            kernel,
            broker: Some(broker_rate_limits(&state.limiter, limit)),
        })
    })
    .await?;
    Ok(Json(view))
}

pub(super) async fn status(State(state): State<AppState>) -> Result<Json<Status>, Problem> {
    let view = blocking(move || {
        let mut status = kernel_status(&*state.enforcer).map_err(maps_problem)?;
        status.version = Some(env!("CARGO_PKG_VERSION").to_owned());
        status.ready = Some(state.enforcer.ready());
        let settings = state.settings.get();
        status.pinned = Some(settings.pinned);
        status.restart_required = Some(settings.restart_required);
        status.fleet = state.limiter.shared_status();
        let cookies = state
            .enforcer
            .cookie_status()
            .map_err(|e| Problem::internal("reading the SYN cookies", &e))?;
        status.syn_cookies = Some(crate::api::SynCookiesStatus {
            mode: match cookies.mode {
                CookieMode::Off => "off",
                CookieMode::Auto { .. } => "auto",
                CookieMode::Always => "always",
            }
            .to_owned(),
            active: cookies.active,
            threshold: match cookies.mode {
                CookieMode::Auto { threshold } => Some(threshold),
                _ => None,
            },
            switched_on: cookies.switched_on,
            switched_off: cookies.switched_off,
        });
        Ok(status)
    })
    .await?;
    Ok(Json(view))
}

//! The agent's HTTP listener: Prometheus metrics, health, the JSON views (`views`), the
//! dashboards' rate-limit check, and token-protected admin changes.

use std::{
    future::Future,
    io,
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use axum::{
    Json, Router,
    extract::{
        Path, Query, Request, State,
        rejection::{JsonRejection, QueryRejection},
    },
    http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::{delete, get, post},
};
use ipnet::IpNet;
use limiter_client::{NEVER_MS, Outcome};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use thiserror::Error;

use crate::{
    agent::{Agent, AgentError, ListKind},
    buckets::CheckError,
    maps::{MapsError, key_address, source_key},
    metrics::{self, Metrics, MetricsError},
    views::{
        Connections, RateLimits, ReadMaps, Status, broker_rate_limits, connections_view,
        kernel_rate_limits, kernel_status, millis,
    },
};

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

/// The listener bound and the routes built: requests are accepted (queued by the kernel) as
/// soon as this exists, so a caller can learn the port before serving starts.
pub struct HttpServer {
    listener: tokio::net::TcpListener,
    app: Router,
}

impl HttpServer {
    /// Binds `agent.settings().http`.
    pub async fn bind(agent: Arc<Agent>) -> Result<Self, HttpError> {
        let addr = agent.settings().http;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| HttpError::Bind { addr, source })?;
        Ok(Self {
            listener,
            app: router(agent)?,
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

/// Binds `agent.settings().http` and serves until `shutdown` resolves; the agent's entry point.
pub async fn serve(
    agent: Arc<Agent>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), HttpError> {
    HttpServer::bind(agent).await?.run(shutdown).await
}

#[derive(Clone)]
struct AppState {
    agent: Arc<Agent>,
    metrics: Arc<Metrics>,
}

/// Every route of the listener.
pub fn router(agent: Arc<Agent>) -> Result<Router, HttpError> {
    let state = AppState {
        metrics: Arc::new(Metrics::new(&agent)?),
        agent,
    };
    let admin = Router::new()
        .route("/v1/bans", post(ban))
        .route("/v1/bans/{addr}", delete(unban))
        .route("/v1/allow", post(allow_add).delete(allow_del))
        .route("/v1/deny", post(deny_add).delete(deny_del))
        // A route layer runs before the handler's extractors: an unauthorised request is
        // refused before its body is even read.
        .route_layer(middleware::from_fn_with_state(state.clone(), require_admin));
    Ok(Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/connections", get(connections))
        .route("/rate_limits", get(rate_limits))
        .route("/v1/status", get(status))
        .route("/v1/check", post(check))
        .merge(admin)
        .fallback(not_found)
        .with_state(state))
}

// ---------------------------------------------------------------------------------------------
// Problems (RFC 9457)

/// An error answer: `application/problem+json` with a status, a title and a detail that names
/// the field at fault, plus any extension members.
#[derive(Debug)]
pub struct Problem(Box<ProblemDetails>);

#[derive(Debug)]
struct ProblemDetails {
    status: StatusCode,
    detail: String,
    extra: serde_json::Map<String, serde_json::Value>,
    headers: HeaderMap,
}

pub const PROBLEM_JSON: &str = "application/problem+json";

impl Problem {
    pub fn new(status: StatusCode, detail: impl Into<String>) -> Self {
        Self(Box::new(ProblemDetails {
            status,
            detail: detail.into(),
            extra: serde_json::Map::new(),
            headers: HeaderMap::new(),
        }))
    }

    fn bad_request(field: &str, detail: impl std::fmt::Display) -> Self {
        Self::new(StatusCode::BAD_REQUEST, format!("{field}: {detail}")).with("field", field)
    }

    fn with(mut self, key: &str, value: impl Into<serde_json::Value>) -> Self {
        self.0.extra.insert(key.to_owned(), value.into());
        self
    }

    fn internal(what: &str, error: &dyn std::error::Error) -> Self {
        let detail = format!("{what}: {}", crate::error_chain(error));
        tracing::error!("{detail}");
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, detail)
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let problem = *self.0;
        let mut body = serde_json::Map::new();
        body.insert(
            "title".into(),
            problem
                .status
                .canonical_reason()
                .unwrap_or("Error")
                .to_owned()
                .into(),
        );
        body.insert("status".into(), problem.status.as_u16().into());
        body.insert("detail".into(), problem.detail.into());
        body.extend(problem.extra);
        let mut response = (
            problem.status,
            [(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON))],
            serde_json::Value::Object(body).to_string(),
        )
            .into_response();
        response.headers_mut().extend(problem.headers);
        response
    }
}

/// A body that is not the JSON expected is a bad request (400) whether it fails to parse or
/// to fit the fields; axum's text names the field. A wrong content type keeps its 415.
fn json_rejection(rejection: JsonRejection) -> Problem {
    let status = match &rejection {
        JsonRejection::JsonDataError(_) | JsonRejection::JsonSyntaxError(_) => {
            StatusCode::BAD_REQUEST
        }
        other => other.status(),
    };
    Problem::new(status, rejection.body_text())
}

fn query_rejection(rejection: QueryRejection) -> Problem {
    Problem::new(StatusCode::BAD_REQUEST, rejection.body_text())
}

async fn not_found() -> Problem {
    Problem::new(StatusCode::NOT_FOUND, "no such endpoint")
}

/// Runs map syscalls (a list change rewrites the LPM tries, a scrape walks the flow table)
/// off the runtime's worker threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Problem> + Send + 'static,
) -> Result<T, Problem> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Problem::internal("the request's task failed", &e))?
}

fn maps_problem(error: MapsError) -> Problem {
    Problem::internal("reading the kernel maps", &error)
}

// ---------------------------------------------------------------------------------------------
// Read-only handlers

async fn metrics(State(state): State<AppState>) -> Result<Response, Problem> {
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
struct Health {
    status: &'static str,
}

async fn healthz() -> Json<Health> {
    Json(Health { status: "ok" })
}

async fn readyz(State(state): State<AppState>) -> Result<Response, Problem> {
    let ready = blocking(move || Ok(state.agent.ready())).await?;
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
struct LimitQuery {
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

async fn connections(
    State(state): State<AppState>,
    query: Result<Query<LimitQuery>, QueryRejection>,
) -> Result<Json<Connections>, Problem> {
    let limit = LimitQuery::get(query, 20)?;
    let view =
        blocking(move || connections_view(&*state.agent, limit).map_err(maps_problem)).await?;
    Ok(Json(view))
}

async fn rate_limits(
    State(state): State<AppState>,
    query: Result<Query<LimitQuery>, QueryRejection>,
) -> Result<Json<RateLimits>, Problem> {
    let limit = LimitQuery::get(query, 10)?;
    let view = blocking(move || {
        let agent = &*state.agent;
        let mut kernel = kernel_rate_limits(agent, limit).map_err(maps_problem)?;
        let settings = agent.settings();
        let (allow, deny) = agent.lists();
        kernel.ports = Some(settings.kernel.ports.clone());
        kernel.allow = Some(allow.iter().map(IpNet::to_string).collect());
        kernel.deny = Some(deny.iter().map(IpNet::to_string).collect());
        Ok(RateLimits {
            enabled: kernel.limits.enabled(),
            kernel,
            broker: Some(broker_rate_limits(agent, limit)),
        })
    })
    .await?;
    Ok(Json(view))
}

async fn status(State(state): State<AppState>) -> Result<Json<Status>, Problem> {
    let view = blocking(move || {
        let agent = &*state.agent;
        let mut status = kernel_status(agent).map_err(maps_problem)?;
        status.version = Some(env!("CARGO_PKG_VERSION").to_owned());
        status.ready = Some(agent.ready());
        Ok(status)
    })
    .await?;
    Ok(Json(view))
}

// ---------------------------------------------------------------------------------------------
// The dashboards' check

#[derive(Debug, Serialize, Deserialize)]
pub struct CheckRequest {
    pub action: String,
    pub key: String,
    pub cost: Option<u32>,
}

/// The body of a `/v1/check` answer, allowed or not.
#[derive(Debug, Serialize, Deserialize)]
pub struct CheckAnswer {
    pub action: String,
    pub allowed: bool,
    pub outcome: String,
    pub limit: u32,
    /// `None` when the action is unlimited.
    pub remaining: Option<u32>,
    /// `None` when waiting will never help (a cost over the burst, a closed action).
    pub retry_after_ms: Option<u64>,
    pub reset_after_ms: Option<u64>,
}

const RATE_LIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
const RATE_LIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
const RATE_LIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// 200 when allowed; 429 when limited (with `Retry-After`) or closed; 422 when the cost is
/// more than the bucket can ever hold, since no wait will help.
async fn check(
    State(state): State<AppState>,
    body: Result<Json<CheckRequest>, JsonRejection>,
) -> Result<Response, Problem> {
    let Json(request) = body.map_err(json_rejection)?;
    let cost = request.cost.unwrap_or(1);
    let verdict = state
        .agent
        .limiter
        .check_unescalated(&request.action, request.key.as_bytes(), cost)
        .map_err(|error| match error {
            CheckError::UnknownAction(action) => Problem::new(
                StatusCode::NOT_FOUND,
                format!("action: no action is named {action:?}"),
            )
            .with("field", "action"),
            CheckError::InvalidKey { source, .. } => Problem::bad_request("key", source),
            CheckError::ZeroCost => Problem::bad_request("cost", "must be at least 1"),
        })?;
    let never = |ms: u64| (ms != NEVER_MS).then_some(ms);
    let answer = CheckAnswer {
        action: request.action,
        allowed: verdict.allowed,
        outcome: verdict.outcome.as_str().to_owned(),
        limit: verdict.limit,
        remaining: (verdict.outcome != Outcome::Unlimited).then_some(verdict.remaining),
        retry_after_ms: never(verdict.retry_after_ms),
        reset_after_ms: never(verdict.reset_after_ms),
    };
    let mut headers = HeaderMap::new();
    if verdict.outcome != Outcome::Unlimited {
        headers.insert(RATE_LIMIT_LIMIT, verdict.limit.into());
        headers.insert(RATE_LIMIT_REMAINING, verdict.remaining.into());
        if verdict.reset_after_ms != NEVER_MS {
            headers.insert(RATE_LIMIT_RESET, verdict.reset_after_secs().into());
        }
    }
    if verdict.allowed {
        return Ok((headers, Json(answer)).into_response());
    }
    let (status, detail) = match verdict.outcome {
        Outcome::CostExceedsBurst => (
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "cost: {cost} is more than action {:?} can ever allow at once",
                answer.action
            ),
        ),
        Outcome::Closed => (
            StatusCode::TOO_MANY_REQUESTS,
            format!("action {:?} refuses every request", answer.action),
        ),
        _ => (
            StatusCode::TOO_MANY_REQUESTS,
            format!("action {:?} is over its limit for this key", answer.action),
        ),
    };
    if verdict.retry_after_ms != NEVER_MS {
        headers.insert(header::RETRY_AFTER, verdict.retry_after_secs().into());
    }
    let mut problem = Problem::new(status, detail)
        .with("action", answer.action)
        .with("reason", answer.outcome)
        .with("limit", answer.limit)
        .with("retry_after_ms", answer.retry_after_ms)
        .with("reset_after_ms", answer.reset_after_ms)
        .with("remaining", answer.remaining);
    problem.0.headers = headers;
    Ok(problem.into_response())
}

// ---------------------------------------------------------------------------------------------
// Admin

/// Off (403) without a configured token; 401 for a missing or wrong one. The token is read per
/// request, so a SIGHUP reload that changes it applies at once.
async fn require_admin(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Result<Response, Problem> {
    let Some(expected) = state.agent.settings().admin_token else {
        return Err(Problem::new(
            StatusCode::FORBIDDEN,
            "the admin endpoints are disabled: no admin token is configured (--admin-token)",
        ));
    };
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, token) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        });
    if !presented.is_some_and(|token| token_matches(token, &expected)) {
        let mut problem = Problem::new(
            StatusCode::UNAUTHORIZED,
            "a valid bearer token is required (Authorization: Bearer <admin token>)",
        );
        problem
            .0
            .headers
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return Err(problem);
    }
    Ok(next.run(request).await)
}

/// Compares digests in constant time: neither the content nor the length of the configured
/// token leaks through response timing.
fn token_matches(presented: &str, expected: &str) -> bool {
    let a = Sha256::digest(presented.as_bytes());
    let b = Sha256::digest(expected.as_bytes());
    a.ct_eq(&b).into()
}

#[derive(Debug, Serialize, Deserialize)]
pub struct BanRequest {
    pub addr: String,
    /// A duration such as `"10m"` or `"1h 30m"`.
    pub ttl: String,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct BanAnswer {
    pub addr: String,
    /// The source key the ban applies to (the address masked to its prefix).
    pub source: String,
    /// For a ban: how long it lasts; for an unban: absent.
    pub ttl_ms: Option<u64>,
    /// For an unban: whether a ban was in force.
    pub lifted: Option<bool>,
}

fn parse_addr(text: &str) -> Result<IpAddr, Problem> {
    text.trim()
        .parse::<IpAddr>()
        // `::ffff:a.b.c.d` is the IPv4 client the kernel keys as such.
        .map(|a| a.to_canonical())
        .map_err(|_| Problem::bad_request("addr", format!("`{text}` is not an IP address")))
}

fn agent_problem(error: AgentError) -> Problem {
    match error {
        AgentError::Configured(net) => Problem::new(
            StatusCode::CONFLICT,
            format!("cidr: {net} comes from the configuration; change it there"),
        )
        .with("field", "cidr"),
        other => Problem::internal("changing the kernel maps", &other),
    }
}

async fn ban(
    State(state): State<AppState>,
    body: Result<Json<BanRequest>, JsonRejection>,
) -> Result<Json<BanAnswer>, Problem> {
    let Json(request) = body.map_err(json_rejection)?;
    let addr = parse_addr(&request.addr)?;
    let ttl = humantime::parse_duration(request.ttl.trim()).map_err(|e| {
        Problem::bad_request("ttl", format!("`{}` is not a duration: {e}", request.ttl))
    })?;
    if ttl.is_zero() {
        return Err(Problem::bad_request("ttl", "must be longer than zero"));
    }
    let answer = blocking(move || {
        let agent = &*state.agent;
        agent.ban(addr, ttl).map_err(agent_problem)?;
        let source = ban_source(agent, addr)?;
        Ok(BanAnswer {
            addr: addr.to_string(),
            source,
            ttl_ms: Some(millis(ttl)),
            lifted: None,
        })
    })
    .await?;
    Ok(Json(answer))
}

fn ban_source(agent: &Agent, addr: IpAddr) -> Result<String, Problem> {
    let config = agent.read(|m| m.config()).map_err(maps_problem)?;
    Ok(key_address(&source_key(addr, &config)).to_string())
}

async fn unban(
    State(state): State<AppState>,
    Path(addr): Path<String>,
) -> Result<Json<BanAnswer>, Problem> {
    let addr = parse_addr(&addr)?;
    let answer = blocking(move || {
        let agent = &*state.agent;
        let lifted = agent.unban(addr).map_err(agent_problem)?;
        // Also forgets the address's authentication failures, so escalation starts over.
        agent
            .limiter
            .unban(addr)
            .map_err(|e| Problem::internal("lifting the ban", &e))?;
        Ok(BanAnswer {
            addr: addr.to_string(),
            source: ban_source(agent, addr)?,
            ttl_ms: None,
            lifted: Some(lifted),
        })
    })
    .await?;
    Ok(Json(answer))
}

#[derive(Debug, Serialize, Deserialize)]
pub struct ListRequest {
    pub cidr: String,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct ListAnswer {
    pub list: String,
    /// The entry as stored (host bits cleared, RFC 5952 for IPv6).
    pub cidr: String,
    /// False when adding an entry already there or removing one that is not.
    pub changed: bool,
}

fn list_name(kind: ListKind) -> &'static str {
    match kind {
        ListKind::Allow => "allow",
        ListKind::Deny => "deny",
    }
}

async fn list_change(
    state: AppState,
    kind: ListKind,
    cidr: &str,
    add: bool,
) -> Result<Response, Problem> {
    let net = crate::config::parse_cidr("cidr", cidr)
        .map_err(|e| Problem::bad_request("cidr", e.message))?;
    let answer = blocking(move || {
        let agent = &*state.agent;
        let changed = if add {
            agent.list_add(kind, net)
        } else {
            agent.list_del(kind, net)
        }
        .map_err(agent_problem)?;
        Ok(ListAnswer {
            list: list_name(kind).to_owned(),
            cidr: net.trunc().to_string(),
            changed,
        })
    })
    .await?;
    let status = if add && answer.changed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(answer)).into_response())
}

async fn allow_add(
    State(state): State<AppState>,
    body: Result<Json<ListRequest>, JsonRejection>,
) -> Result<Response, Problem> {
    let Json(request) = body.map_err(json_rejection)?;
    list_change(state, ListKind::Allow, &request.cidr, true).await
}

async fn deny_add(
    State(state): State<AppState>,
    body: Result<Json<ListRequest>, JsonRejection>,
) -> Result<Response, Problem> {
    let Json(request) = body.map_err(json_rejection)?;
    list_change(state, ListKind::Deny, &request.cidr, true).await
}

async fn allow_del(
    State(state): State<AppState>,
    query: Result<Query<ListRequest>, QueryRejection>,
) -> Result<Response, Problem> {
    let Query(request) = query.map_err(query_rejection)?;
    list_change(state, ListKind::Allow, &request.cidr, false).await
}

async fn deny_del(
    State(state): State<AppState>,
    query: Result<Query<ListRequest>, QueryRejection>,
) -> Result<Response, Problem> {
    let Query(request) = query.map_err(query_rejection)?;
    list_change(state, ListKind::Deny, &request.cidr, false).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_match_only_exactly() {
        assert!(token_matches("s3cret", "s3cret"));
        assert!(!token_matches("s3cret ", "s3cret"));
        assert!(!token_matches("s3cre", "s3cret"));
        assert!(!token_matches("", "s3cret"));
    }

    #[test]
    fn addresses_are_canonical_and_errors_name_the_field() {
        assert_eq!(
            parse_addr("::ffff:10.0.0.1").unwrap(),
            "10.0.0.1".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            parse_addr("2001:0db8:0:0::1").unwrap().to_string(),
            "2001:db8::1"
        );
        let problem = parse_addr("10.0.0.0/8").unwrap_err();
        assert_eq!(problem.0.status, StatusCode::BAD_REQUEST);
        assert!(
            problem.0.detail.starts_with("addr: "),
            "{}",
            problem.0.detail
        );
    }
}

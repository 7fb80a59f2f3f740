//! `POST /v1/check`: a broker verdict for dashboards and scripts. A check spends the key's
//! bucket, so it is answered only as `check-token` or `check-open` allows ([`CheckAccess`]),
//! and it never escalates into a ban even then: whoever holds the token is not the broker.

use axum::{
    Json,
    extract::{Request, State, rejection::JsonRejection},
    http::{HeaderMap, HeaderName, StatusCode, header},
    middleware::Next,
    response::{IntoResponse, Response},
};

use limiter_client::{NEVER_MS, Outcome};

use super::{
    AppState,
    auth::require_bearer,
    problem::{Problem, json_rejection},
};
use crate::{
    api::{CheckAnswer, CheckRequest},
    buckets::{CheckError, Submit},
    settings::CheckAccess,
};

const RATE_LIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
const RATE_LIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
const RATE_LIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// 401 without the configured token, 403 while neither a token nor `check-open` is set. Read
/// per request, so a reload applies at once.
pub(super) async fn require_check_token(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Result<Response, Problem> {
    match state.settings.read(|s| s.check.clone()) {
        CheckAccess::Token(expected) => require_bearer(&request, &expected, "check token")?,
        CheckAccess::Open => {}
        CheckAccess::Closed => {
            return Err(Problem::new(StatusCode::FORBIDDEN, CLOSED).with("setting", "check-token"));
        }
    }
    Ok(next.run(request).await)
}

/// What a caller of the closed endpoint is told, and the agent logs at the start.
pub(super) const CLOSED: &str = "POST /v1/check is closed until a check-token is set \
    (check-token in the file, --check-token or LIMITER_CHECK_TOKEN; then send it as \
    Authorization: Bearer <token>), or check-open = true opens it to every local user";

/// 200 when allowed; 429 when limited (with `Retry-After`) or closed; 422 when the cost is
/// more than the bucket can ever hold or the quota ever allow, since no wait will help.
pub(super) async fn check(
    State(state): State<AppState>,
    body: Result<Json<CheckRequest>, JsonRejection>,
) -> Result<Response, Problem> {
    let Json(request) = body.map_err(json_rejection)?;
    let cost = request.cost.unwrap_or(1);
    let limiter = &state.limiter;
    let judged = limiter
        .action_id(&request.action)
        .and_then(|id| {
            limiter.submit(
                &id,
                request.key.as_bytes(),
                (cost, 0),
                Submit::CheckUnescalated,
            )
        })
        .map_err(|error| match error {
            CheckError::UnknownAction(action) => Problem::new(
                StatusCode::NOT_FOUND,
                format!("action: no action is named {action:?}"),
            )
            .with("field", "action"),
            CheckError::InvalidKey { source, .. } => Problem::bad_request("key", source),
            CheckError::ZeroCost => Problem::bad_request("cost", "must be at least 1"),
            e @ CheckError::NotConcurrency(_) => Problem::bad_request("action", e),
        })?
        .await;
    // In monitor mode a refusal is answered as the allowance it becomes, and says so.
    let verdict = judged.enforced();
    let never = |ms: u64| (ms != NEVER_MS).then_some(ms);
    let answer = CheckAnswer {
        action: request.action,
        mode: if judged.monitored {
            "monitor"
        } else {
            "enforce"
        }
        .to_owned(),
        would_refuse: judged.would_refuse().map(|o| o.as_str().to_owned()),
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
        Outcome::CostExceedsBurst | Outcome::CostExceedsLimit => (
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
        Outcome::Disconnect => (
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "action {:?} has closed this connection for its strikes",
                answer.action
            ),
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

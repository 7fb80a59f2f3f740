//! Bearer tokens: how the admin endpoints and, when configured, the check endpoint tell an
//! authorised caller from any local user.

use super::problem::Problem;
use crate::secret::token_matches;
use axum::{
    extract::Request,
    http::{HeaderValue, StatusCode, header},
};

/// `Ok` when `request` carries `Authorization: Bearer <expected>`, else the 401 to answer.
pub(super) fn require_bearer(request: &Request, expected: &str, what: &str) -> Result<(), Problem> {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, token) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        });
    if presented.is_some_and(|token| token_matches(token.as_bytes(), expected)) {
        return Ok(());
    }
    let mut problem = Problem::new(
        StatusCode::UNAUTHORIZED,
        format!("a valid bearer token is required (Authorization: Bearer <{what}>)"),
    );
    problem
        .0
        .headers
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    Err(problem)
}

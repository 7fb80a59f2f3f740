//! Bearer tokens: how the admin endpoints and, when configured, the check endpoint tell an
//! authorised caller from any local user.

use axum::{
    extract::Request,
    http::{HeaderValue, StatusCode, header},
};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::problem::Problem;

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
    if presented.is_some_and(|token| token_matches(token, expected)) {
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

/// Compares digests in constant time: neither the content nor the length of the configured
/// token leaks through response timing.
fn token_matches(presented: &str, expected: &str) -> bool {
    let a = Sha256::digest(presented.as_bytes());
    let b = Sha256::digest(expected.as_bytes());
    a.ct_eq(&b).into()
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
}

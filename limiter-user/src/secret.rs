//! Comparing a presented token with the configured one, the one way every listener does it.

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Compares digests in constant time: neither the content nor the length of the configured
/// token leaks through response timing.
pub fn token_matches(presented: &[u8], expected: &str) -> bool {
    let a = Sha256::digest(presented);
    let b = Sha256::digest(expected.as_bytes());
    a.ct_eq(&b).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_match_only_exactly() {
        assert!(token_matches(b"s3cret", "s3cret"));
        assert!(!token_matches(b"s3cret ", "s3cret"));
        assert!(!token_matches(b"s3cre", "s3cret"));
        assert!(!token_matches(b"", "s3cret"));
    }
}

//! A `Duration` as a whole number of milliseconds or nanoseconds in a `u64`: the units the
//! kernel's clocks, Redis, the API and the event log count in. One conversion for every
//! site, saturating: a duration too long for a `u64` (an absurd setting) means "forever"
//! rather than wrapping round to a short one.

use std::time::Duration;

/// Whole milliseconds; `u64::MAX` for a duration that does not fit.
pub fn duration_ms(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// A duration serialized as [`duration_ms`] (`serialize_with`), for views whose fields say `_ms`.
pub fn serialize_ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(duration_ms(*d))
}

/// Whole nanoseconds; `u64::MAX` for a duration that does not fit (about 584 years).
pub fn duration_ns(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_below_the_limit() {
        let d = Duration::new(3, 4_500_000);
        assert_eq!(duration_ms(d), 3_004);
        assert_eq!(duration_ns(d), 3_004_500_000);
        assert_eq!(duration_ns(Duration::from_nanos(u64::MAX)), u64::MAX);
    }

    #[test]
    fn saturates_rather_than_wraps() {
        assert_eq!(
            duration_ns(Duration::from_nanos(u64::MAX) + Duration::from_nanos(1)),
            u64::MAX
        );
        assert_eq!(duration_ms(Duration::MAX), u64::MAX);
        assert_eq!(duration_ns(Duration::MAX), u64::MAX);
    }
}

//! Saturating time arithmetic: `Instant + Duration` panics when the sum does not fit (a timeout
//! of `u64::MAX` seconds from the command line, say), so every deadline in this crate is formed
//! here instead.

use std::time::{Duration, Instant};

/// About a century: "never" for a deadline, yet representable on every platform's `Instant`.
const FAR: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `now + d`, or a far-future instant when the sum does not fit: a huge timeout means "wait as
/// long as it takes", never a panic and never an instant that is already past.
pub fn deadline(now: Instant, d: Duration) -> Instant {
    if let Some(t) = now.checked_add(d) {
        return t;
    }
    // Halve the far future until it fits; one second always does in practice, and `now` itself
    // (a deadline already reached) is the last resort on a platform that cannot add even that.
    let mut far = FAR.min(d);
    while !far.is_zero() {
        if let Some(t) = now.checked_add(far) {
            return t;
        }
        far /= 2;
    }
    now
}

/// `deadline(Instant::now(), d)`.
pub fn after(d: Duration) -> Instant {
    deadline(Instant::now(), d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_durations_saturate_to_the_far_future() {
        let now = Instant::now();
        assert_eq!(
            deadline(now, Duration::from_secs(5)),
            now + Duration::from_secs(5)
        );
        for d in [
            Duration::MAX,
            Duration::from_secs(u64::MAX),
            Duration::from_secs(1 << 62),
        ] {
            let t = deadline(now, d);
            // Far ahead: at least a year, and no panic.
            assert!(t >= now + Duration::from_secs(365 * 24 * 3600), "{d:?}");
        }
        assert_eq!(deadline(now, Duration::ZERO), now);
        let _ = after(Duration::MAX);
    }
}

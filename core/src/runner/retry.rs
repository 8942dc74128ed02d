//! When a failed provider request is sent again.
//!
//! Only a retryable failure ([`provider::Error::retryable`]: rate limit, server error,
//! transport, a stream cut short) that came before any output of the step is retried; the
//! step then publishes `retry.scheduled` and waits. The waits are 2, 4, 8 and 16 s, each
//! ±20 %, so at most 5 attempts in all; a `retry-after` the provider sent is honoured as
//! a floor, up to [`RetryPolicy::retry_after_cap`]. An interrupt during the wait ends the
//! step (`step.interrupted`) with no further attempt.
//!
//! The schedule is four numbers and a jitter; it is written out here rather than taken
//! from a backoff crate because the runner owns the wait (it must publish before it and
//! stay interruptible during it) and no crate would shorten that.

use std::time::Duration;

use crate::provider;

/// How failed provider requests are retried.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// The wait before each retry; their number bounds the retries.
    pub delays: Vec<Duration>,
    /// Each wait is scaled by a random factor in `1 ± jitter`.
    pub jitter: f64,
    /// The longest `retry-after` honoured.
    pub retry_after_cap: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            delays: [2, 4, 8, 16].map(Duration::from_secs).to_vec(),
            jitter: 0.2,
            retry_after_cap: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// The wait before retry number `retry` (1 for the first) after `error`, or `None`
    /// when the error is not retried or the retries are used up.
    pub fn delay(&self, retry: u32, error: &provider::Error) -> Option<Duration> {
        if !error.retryable() {
            return None;
        }
        let index = usize::try_from(retry.checked_sub(1)?).ok()?;
        let base = *self.delays.get(index)?;
        let factor = 1.0 + self.jitter * (fastrand::f64() * 2.0 - 1.0);
        let backoff = base.mul_f64(factor.max(0.0));
        let floor = match error {
            provider::Error::RateLimit {
                retry_after_ms: Some(ms),
                ..
            } => Duration::from_millis(*ms).min(self.retry_after_cap),
            _ => Duration::ZERO,
        };
        Some(backoff.max(floor))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server() -> provider::Error {
        provider::Error::Server {
            status: 503,
            message: "busy".into(),
        }
    }

    #[test]
    fn waits_double_within_the_jitter_and_stop_after_four_retries() {
        let policy = RetryPolicy::default();
        for _ in 0..200 {
            for (retry, base) in [(1, 2.0), (2, 4.0), (3, 8.0), (4, 16.0)] {
                let wait = policy.delay(retry, &server()).unwrap().as_secs_f64();
                assert!(
                    (base * 0.8..=base * 1.2).contains(&wait),
                    "retry {retry}: {wait}"
                );
            }
        }
        assert_eq!(policy.delay(5, &server()), None);
        assert_eq!(policy.delay(0, &server()), None);
    }

    #[test]
    fn retry_after_is_a_floor_up_to_the_cap() {
        let policy = RetryPolicy::default();
        let limited = |ms| provider::Error::RateLimit {
            retry_after_ms: Some(ms),
            message: "slow down".into(),
        };
        assert!(policy.delay(1, &limited(30_000)).unwrap() >= Duration::from_secs(30));
        assert_eq!(
            policy.delay(1, &limited(3_600_000)),
            Some(Duration::from_secs(60))
        );
        assert!(policy.delay(1, &limited(10)).unwrap() >= Duration::from_millis(1600));
    }

    #[test]
    fn failures_that_would_repeat_are_not_retried() {
        let policy = RetryPolicy::default();
        for error in [
            provider::Error::ContextOverflow("long".into()),
            provider::Error::Auth("key".into()),
            provider::Error::BadRequest("bad".into()),
            provider::Error::Protocol("odd".into()),
        ] {
            assert_eq!(policy.delay(1, &error), None, "{error:?}");
        }
    }
}

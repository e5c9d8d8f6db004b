//! Failed authentication, counted per client address, so that passwords cannot be guessed at
//! the rate the server can answer.
//!
//! An address gets [`FREE_FAILURES`] failures; each one after that closes the address to
//! password logins for a delay that doubles from [`FIRST_DELAY`] up to [`MAX_DELAY`]. A blocked
//! address's logins are refused before the password is checked, so guessing slows to one try per
//! delay; attempts refused that way are not failures and do not lengthen the block. An address
//! with no failure for [`FORGET_AFTER`] starts afresh. Other addresses are never slowed, and
//! neither are valid bearer tokens (256 random bits, checked by a hash lookup: nothing to guess).
//!
//! The table holds at most [`MAX_ADDRESSES`] addresses: when full, forgotten ones go first,
//! then the one whose last failure is oldest. The clock is a parameter, for the tests.

use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub(super) const FREE_FAILURES: u32 = 5;
pub(super) const FIRST_DELAY: Duration = Duration::from_secs(1);
pub(super) const MAX_DELAY: Duration = Duration::from_secs(60);
pub(super) const FORGET_AFTER: Duration = Duration::from_secs(15 * 60);
pub(super) const MAX_ADDRESSES: usize = 10_000;

/// Where a request came from, as failures are counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Origin {
    Ip(IpAddr),
    /// A Unix socket's peer, by user id where the kernel told it.
    UnixUser(Option<u32>),
}

impl Origin {
    /// The key failures are counted under: an IPv6 client usually holds a whole /64, so the
    /// prefix counts as one address.
    fn key(self) -> Self {
        match self {
            Self::Ip(IpAddr::V6(v6)) if v6.to_ipv4_mapped().is_none() => {
                let prefix = u128::from(v6) & !((1u128 << 64) - 1);
                Self::Ip(IpAddr::V6(prefix.into()))
            }
            Self::Ip(IpAddr::V6(v6)) => Self::Ip(v6.to_canonical()),
            other => other,
        }
    }
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ip(ip) => ip.fmt(f),
            Self::UnixUser(Some(uid)) => write!(f, "unix uid={uid}"),
            Self::UnixUser(None) => f.write_str("unix"),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Record {
    failures: u32,
    last_failure: Instant,
    blocked_until: Instant,
}

#[derive(Debug, Default)]
pub(super) struct FailureLimiter {
    records: Mutex<HashMap<Origin, Record>>,
}

impl FailureLimiter {
    /// How long `origin` must still wait before its next login is checked, if it must.
    pub(super) fn blocked(&self, origin: Origin, now: Instant) -> Option<Duration> {
        let records = self.lock();
        let record = records.get(&origin.key())?;
        (record.blocked_until > now).then(|| record.blocked_until - now)
    }

    /// Counts a failure; the block it starts, if it starts one.
    pub(super) fn failed(&self, origin: Origin, now: Instant) -> Option<Duration> {
        let key = origin.key();
        let mut records = self.lock();
        if !records.contains_key(&key) && records.len() >= MAX_ADDRESSES {
            make_room(&mut records, now);
        }
        let record = records.entry(key).or_insert(Record {
            failures: 0,
            last_failure: now,
            blocked_until: now,
        });
        if now.saturating_duration_since(record.last_failure) >= FORGET_AFTER {
            record.failures = 0;
        }
        record.failures = record.failures.saturating_add(1);
        record.last_failure = now;
        let excess = record.failures.checked_sub(FREE_FAILURES + 1)?;
        let delay = FIRST_DELAY
            .saturating_mul(1u32 << excess.min(16))
            .min(MAX_DELAY);
        record.blocked_until = now + delay;
        Some(delay)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Origin, Record>> {
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }
}

/// Frees a place: every forgotten address, or else the one whose last failure is oldest.
fn make_room(records: &mut HashMap<Origin, Record>, now: Instant) {
    records.retain(|_, record| {
        now.saturating_duration_since(record.last_failure) < FORGET_AFTER
            || record.blocked_until > now
    });
    if records.len() < MAX_ADDRESSES {
        return;
    }
    let oldest = records
        .iter()
        .min_by_key(|(_, record)| record.last_failure)
        .map(|(key, _)| *key);
    if let Some(oldest) = oldest {
        records.remove(&oldest);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn ip(last: u8) -> Origin {
        Origin::Ip(IpAddr::V4(Ipv4Addr::new(192, 0, 2, last)))
    }

    #[test]
    fn failures_past_the_free_ones_block_with_a_doubling_delay() {
        let limiter = FailureLimiter::default();
        let start = Instant::now();
        let attacker = ip(1);
        for i in 0..FREE_FAILURES {
            assert_eq!(limiter.failed(attacker, start), None, "failure {i} is free");
            assert_eq!(limiter.blocked(attacker, start), None);
        }
        assert_eq!(limiter.failed(attacker, start), Some(FIRST_DELAY));
        assert_eq!(limiter.blocked(attacker, start), Some(FIRST_DELAY));
        // Another address is not slowed.
        assert_eq!(limiter.blocked(ip(2), start), None);
        // After the delay the next attempt is checked; failing doubles the delay.
        let later = start + FIRST_DELAY;
        assert_eq!(limiter.blocked(attacker, later), None);
        assert_eq!(limiter.failed(attacker, later), Some(FIRST_DELAY * 2));
        assert_eq!(
            limiter.blocked(attacker, later + FIRST_DELAY),
            Some(FIRST_DELAY)
        );
        // The delay stops growing at its cap.
        let mut now = later;
        for _ in 0..40 {
            now += MAX_DELAY;
            assert!(limiter.failed(attacker, now).expect("blocked") <= MAX_DELAY);
        }
        assert_eq!(limiter.failed(attacker, now), Some(MAX_DELAY));
        // A quiet address starts afresh.
        let quiet = now + MAX_DELAY + FORGET_AFTER;
        assert_eq!(limiter.blocked(attacker, quiet), None);
        assert_eq!(limiter.failed(attacker, quiet), None);
    }

    #[test]
    fn an_ipv6_prefix_counts_as_one_address() {
        let limiter = FailureLimiter::default();
        let now = Instant::now();
        let address = |host: u16| {
            Origin::Ip(IpAddr::V6(Ipv6Addr::new(
                0x2001, 0xdb8, 1, 2, 0, 0, 0, host,
            )))
        };
        for host in 0..=FREE_FAILURES as u16 {
            limiter.failed(address(host), now);
        }
        assert!(limiter.blocked(address(999), now).is_some());
        let elsewhere = Origin::Ip(IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 1, 3, 0, 0, 0, 1)));
        assert_eq!(limiter.blocked(elsewhere, now), None);
    }

    #[test]
    fn the_table_is_bounded() {
        let limiter = FailureLimiter::default();
        let start = Instant::now();
        for n in 0..MAX_ADDRESSES as u32 + 100 {
            let origin = Origin::Ip(IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + n)));
            limiter.failed(
                origin,
                start + Duration::from_millis(1 + u64::from(n % 500)),
            );
        }
        assert!(limiter.len() <= MAX_ADDRESSES);
        // Forgotten addresses go before anything else.
        let much_later = start + FORGET_AFTER + Duration::from_secs(1);
        limiter.failed(ip(9), much_later);
        assert_eq!(limiter.len(), 1);
    }
}

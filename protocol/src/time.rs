//! Time as every part of fedfleet speaks it: unix milliseconds ([`Millis`]) and the one clock
//! abstraction ([`Clock`]) the shells are handed.
//!
//! The cores never read a clock: they take `now: Millis` as an argument. A shell holds a
//! [`SharedClock`] it was given at `open` and passes its readings in. [`SystemClock`] is the one
//! reading of the wall clock in the tree (the tidy test in `xtask` keeps it that way); tests
//! pass a fake clock (`fedfleet_testkit::clock::FakeClock`) or any `Fn() -> Millis` closure.

use std::sync::Arc;

/// Unix time in milliseconds.
pub type Millis = u64;

/// Where a shell gets the time from.
pub trait Clock: Send + Sync {
    fn now_ms(&self) -> Millis;

    /// Unix seconds (certificate validity, TLS).
    fn now_secs(&self) -> i64 {
        (self.now_ms() / 1000) as i64
    }
}

/// A clock shared by a service's tasks.
pub type SharedClock = Arc<dyn Clock>;

/// Any `Fn() -> Millis` is a clock (tests hand in closures over their own counters).
impl<F: Fn() -> Millis + Send + Sync> Clock for F {
    fn now_ms(&self) -> Millis {
        self()
    }
}

/// The system's wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl SystemClock {
    /// As a [`SharedClock`], the default of every service.
    pub fn shared() -> SharedClock {
        Arc::new(SystemClock)
    }
}

impl Clock for SystemClock {
    fn now_ms(&self) -> Millis {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as Millis).unwrap_or(0)
    }
}

impl std::fmt::Debug for dyn Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Clock({})", self.now_ms())
    }
}

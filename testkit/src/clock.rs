//! A clock tests move by hand.

use std::sync::atomic::{AtomicU64, Ordering};

use fedfleet_protocol::{Clock, Millis};

#[derive(Debug, Default)]
pub struct FakeClock(AtomicU64);

impl FakeClock {
    pub fn new(start: Millis) -> Self {
        FakeClock(AtomicU64::new(start))
    }
    pub fn set(&self, t: Millis) {
        self.0.store(t, Ordering::SeqCst);
    }
    pub fn advance(&self, ms: u64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for FakeClock {
    fn now_ms(&self) -> Millis {
        self.0.load(Ordering::SeqCst)
    }
}

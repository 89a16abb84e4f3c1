//! How fast a round's devices are asked to arrive. A round opens with a start window over which its
//! devices spread their downloads and uploads (each at its own point in it); the window is the
//! expected participants over an arrival rate. A fresh service starts at a quarter of `[admission]
//! arrivals_per_second` and doubles it after each clean round its window held back (a slow start,
//! as TCP's: the first round of a big fleet must not be the one that finds the machine's limit by
//! overflowing it). Then the rate follows what the service took: after a round that turned devices
//! away as `overloaded`, the rate it accepted updates at (what this machine can take) or half the
//! rate asked, whichever is higher, and the doubling ends (the devices it refused came back after
//! their backoff, and the gaps they left make the rate taken an underestimate: halving, as TCP does
//! on a loss, bounds the fall per round); after a clean round its window held back, a quarter more;
//! after a round whose updates came in well under the rate asked (the service lost datagrams and
//! waited on retransmissions, or the devices were slow), the same rate, and the doubling ends.
//! Never above the configured rate.
//!
//! Why: devices that arrive faster than the service folds wait with their uploads in flight,
//! or are refused and come back; both cost memory and CPU and gain nothing (10,000 devices on
//! the 2-core VM at 500 a second: 247 MiB peak and 7,583 refusals in a round; at 200 a second,
//! the rate it took: 80 MiB and none, at the same CPU per update; benches/README.md).
//!
//! Pure: the service tells it what each round did. The rate is kept with each round boundary,
//! so a restarted service, or its next campaign, starts from what it learned (growing by
//! quarters: a rate once learned is not probed by doubling again).

/// Rounds with fewer updates teach the pacer nothing (too few to measure a rate by).
const MIN_SAMPLE: u64 = 100;
/// The lowest rate the pacer asks for, per second.
const MIN_RATE: u32 = 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArrivalPacer {
    /// `[admission] arrivals_per_second` (0: rounds open without a window).
    ceiling: u32,
    rate: u32,
    /// Whether the last round opened with a window: only then did the rate hold devices back,
    /// and a clean round says it could be higher.
    windowed: bool,
    /// Slow start: no round has been overloaded yet, so a clean one doubles the rate.
    probing: bool,
}

impl ArrivalPacer {
    /// A fresh service's pacer: a quarter of the configured rate, doubling from there.
    pub fn new(arrivals_per_second: u32) -> Self {
        let rate = (arrivals_per_second / 4).max(MIN_RATE.min(arrivals_per_second));
        ArrivalPacer { ceiling: arrivals_per_second, rate, windowed: false, probing: true }
    }

    /// A pacer that had learned `learned` (kept by the store), under the configured rate; a
    /// fresh one if it had learned nothing.
    pub fn resume(arrivals_per_second: u32, learned: Option<u32>) -> Self {
        match learned {
            Some(r) => ArrivalPacer {
                rate: r.clamp(MIN_RATE.min(arrivals_per_second), arrivals_per_second),
                probing: false,
                ..ArrivalPacer::new(arrivals_per_second)
            },
            None => ArrivalPacer::new(arrivals_per_second),
        }
    }

    /// The arrivals per second the next round asks for.
    pub fn rate(&self) -> u32 {
        self.rate
    }

    /// The rate worth keeping across a restart: none during the slow start (a restart then
    /// starts it again) unless it reached the configured rate.
    pub fn learned(&self) -> Option<u32> {
        (!self.probing || self.rate == self.ceiling).then_some(self.rate)
    }

    /// The start window of a round that opens expecting `participants` devices, `deadline_ms`
    /// from now: `participants / rate` seconds, at most half of `deadline_ms`; none under a
    /// second (a burst that small is taken in stride, and not worth a wait).
    pub fn open_round(&mut self, participants: u64, deadline_ms: u64) -> u64 {
        let window = match self.rate {
            0 => 0,
            rate => (participants.saturating_mul(1_000) / u64::from(rate)).min(deadline_ms / 2),
        };
        let window = if window < 1_000 { 0 } else { window };
        self.windowed = window > 0;
        window
    }

    /// What a round did: `accepted` updates, and `overloaded` refusals, over the `span_ms` from its
    /// first accepted update to its close. More than 1 % of its updates refused means the devices
    /// came faster than the service took them: ask for the rate it took, or half the rate asked if
    /// that is higher (the span includes the refused devices' backoffs). Updates taken at under
    /// three quarters of the rate asked: hold the rate (lowering it could be the slow devices'
    /// doing, not the service's). Otherwise ask for more: twice as much in the slow start, a
    /// quarter more after it.
    pub fn round_closed(&mut self, accepted: u64, overloaded: u64, span_ms: u64) {
        if self.ceiling == 0 || accepted < MIN_SAMPLE || span_ms == 0 {
            return;
        }
        let took = accepted.saturating_mul(1_000) / span_ms;
        if overloaded.saturating_mul(100) > accepted {
            let halved = u64::from(self.rate / 2);
            self.rate = took.max(halved).clamp(u64::from(MIN_RATE), u64::from(self.ceiling)) as u32;
            self.probing = false;
        } else if self.windowed {
            if took.saturating_mul(4) < u64::from(self.rate) * 3 {
                self.probing = false;
            } else {
                let more = if self.probing { self.rate } else { self.rate.div_ceil(4) };
                self.rate = self.rate.saturating_add(more).min(self.ceiling);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_spreads_the_expected_devices_at_the_rate_within_half_the_deadline() {
        let mut p = ArrivalPacer::resume(500, Some(500));
        assert_eq!(p.open_round(10_000, 600_000), 20_000);
        assert_eq!(p.open_round(10_000, 30_000), 15_000, "at most half the deadline");
        assert_eq!(p.open_round(400, 600_000), 0, "under a second: no window");
        assert_eq!(ArrivalPacer::new(0).open_round(10_000, 600_000), 0, "0: no window");
    }

    #[test]
    fn an_overloaded_round_sets_the_rate_it_took_and_clean_windowed_ones_raise_it_to_the_ceiling() {
        let mut p = ArrivalPacer::new(500);
        // 10,000 updates in 60 s with 7,583 refused: 166 a second is what the service took.
        p.open_round(10_000, 600_000);
        p.round_closed(10_000, 7_583, 60_000);
        assert_eq!(p.rate(), 166);
        assert_eq!(p.open_round(10_000, 600_000), 60_240);
        // Clean rounds held back by their window: a quarter more each, never past the
        // configured rate.
        p.round_closed(10_000, 0, 70_000);
        assert_eq!(p.rate(), 208);
        p.open_round(10_000, 600_000);
        p.round_closed(10_000, 100, 50_000);
        assert_eq!(p.rate(), 260, "1 % refused is still clean");
        for _ in 0..10 {
            p.open_round(10_000, 600_000);
            p.round_closed(10_000, 0, 30_000);
        }
        assert_eq!(p.rate(), 500);
        // Never above the ceiling, never under the floor.
        p.round_closed(10_000, 5_000, 1);
        assert_eq!(p.rate(), 500);
        for _ in 0..10 {
            p.round_closed(1_000, 5_000, 1_000_000);
        }
        assert_eq!(p.rate(), MIN_RATE);
    }

    #[test]
    fn an_overloaded_round_whose_refused_devices_came_back_late_halves_the_rate_at_most() {
        // Measured: 3,000 devices asked for at 1,000 a second, 112 refused, who came back after
        // their backoff: the round took 32 s (93 a second), in 3.5 s once nobody was refused.
        let mut p = ArrivalPacer::new(4_000);
        assert_eq!(p.open_round(3_000, 600_000), 3_000);
        p.round_closed(3_000, 112, 32_000);
        assert_eq!((p.rate(), p.learned()), (500, Some(500)), "half of 1,000, not 93");
        // A machine that truly takes only 93 a second gets there in a few overloaded rounds.
        for _ in 0..3 {
            p.open_round(3_000, 600_000);
            p.round_closed(3_000, 112, 32_000);
        }
        assert_eq!(p.rate(), 93);
    }

    #[test]
    fn a_fresh_pacer_starts_at_a_quarter_and_doubles_until_a_round_is_overloaded() {
        let mut p = ArrivalPacer::new(500);
        assert_eq!((p.rate(), p.open_round(10_000, 600_000)), (125, 80_000));
        p.round_closed(10_000, 0, 90_000);
        assert_eq!(p.rate(), 250);
        p.open_round(10_000, 600_000);
        // Overloaded at 250 a second, taking 200: that rate, and quarters from then on.
        p.round_closed(10_000, 2_000, 50_000);
        assert_eq!(p.rate(), 200);
        p.open_round(10_000, 600_000);
        p.round_closed(10_000, 0, 60_000);
        assert_eq!(p.rate(), 250);
        let mut clean = ArrivalPacer::new(500);
        for _ in 0..3 {
            clean.open_round(10_000, 600_000);
            clean.round_closed(10_000, 0, 20_000);
        }
        assert_eq!((clean.rate(), clean.learned()), (500, Some(500)), "doubling stops at the configured rate");
        assert_eq!(ArrivalPacer::new(500).learned(), None, "a slow start is not kept");
        assert_eq!(p.learned(), Some(250));
        assert_eq!((ArrivalPacer::new(20).rate(), ArrivalPacer::new(5).rate()), (10, 5), "the floor, under the setting");
    }

    #[test]
    fn a_round_that_took_its_updates_well_under_the_rate_asked_holds_the_rate_and_ends_the_doubling() {
        // Measured: 10,000 devices asked for at 250 a second came in over 120 s (83 a second)
        // with no refusal, the service losing datagrams; doubling again overloaded it.
        let mut p = ArrivalPacer::new(500);
        p.open_round(10_000, 600_000);
        p.round_closed(10_000, 0, 100_000);
        assert_eq!(p.rate(), 250, "100 a second is within a quarter of 125");
        p.open_round(10_000, 600_000);
        p.round_closed(10_000, 0, 120_000);
        assert_eq!((p.rate(), p.learned()), (250, Some(250)));
        p.open_round(10_000, 600_000);
        p.round_closed(10_000, 0, 45_000);
        assert_eq!(p.rate(), 313, "after the slow start, a quarter more");
    }

    #[test]
    fn a_resumed_pacer_starts_from_what_it_learned_under_the_configured_rate() {
        assert_eq!(ArrivalPacer::resume(500, Some(166)).rate(), 166);
        assert_eq!(ArrivalPacer::resume(500, None), ArrivalPacer::new(500), "nothing learned: a fresh start");
        assert_eq!(ArrivalPacer::resume(200, Some(400)).rate(), 200, "a lowered setting wins");
        assert_eq!(ArrivalPacer::resume(0, Some(166)).rate(), 0, "0 still turns the window off");
    }

    #[test]
    fn small_rounds_unwindowed_rounds_and_a_pacer_turned_off_learn_nothing_upward() {
        let mut p = ArrivalPacer::new(500);
        p.open_round(99, 600_000);
        p.round_closed(99, 1_000, 60_000);
        assert_eq!(p.rate(), 125);
        p.open_round(10_000, 600_000);
        p.round_closed(10_000, 7_583, 60_000);
        // A clean round that opened without a window (too few devices to need one) was not
        // held back by the rate: it says nothing about a higher one.
        assert_eq!((p.open_round(150, 600_000), p.rate()), (0, 166));
        p.round_closed(150, 0, 2_000);
        assert_eq!(p.rate(), 166);
        let mut off = ArrivalPacer::new(0);
        off.round_closed(10_000, 7_583, 60_000);
        assert_eq!((off.rate(), off.open_round(10_000, 600_000)), (0, 0));
    }
}

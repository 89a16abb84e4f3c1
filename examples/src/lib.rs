//! The `fedfleet` umbrella crate: the one-command fleet demo ([`demo`]), the in-process fleet
//! of real agents it drives ([`fleet`]), and the hostile agents of the `poisoned` example
//! ([`attack`]).

pub mod attack;
pub mod demo;
pub mod fleet;
pub mod scenarios;

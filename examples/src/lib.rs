//! The `fedfleet` umbrella crate: the one-command fleet demo ([`demo`]) and the in-process fleet
//! of real agents it drives ([`fleet`]).

pub mod demo;
pub mod fleet;

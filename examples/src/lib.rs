//! The `fedfleet` umbrella crate: the one-command fleet demo ([`demo`]), a ready local
//! deployment for the hand-run tour ([`local`], from `fedfleet-cli`: `fedfleet init-local`), the in-process fleet
//! of real agents it drives ([`fleet`]), and the hostile agents of the `poisoned` example
//! ([`attack`]).

pub mod attack;
pub mod datasets;
pub mod demo;
pub mod fleet;
/// `init-local` lives in `fedfleet-cli` (no test kit); re-exported for the tests and examples.
pub use fedfleet_cli::local;
pub mod scenarios;

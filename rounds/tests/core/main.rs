//! The round core, without I/O: the engine (campaigns, rounds, admission) and the strategies
//! (determinism, relay equivalence, optimizers, robust aggregation), with a fake clock.

mod buffer;
mod engine;
mod privacy;
mod relay;
mod strategies;

//! End-to-end tests over loopback: the real registry, aggregator and agents.

mod loopback;
mod multiprocess;
mod procs;
mod mqtt_fleet;

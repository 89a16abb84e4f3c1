//! End-to-end tests over loopback: the real registry, aggregator and agents.

mod inproc;
mod loopback;
mod multiprocess;
mod procs;
mod tour;
mod mqtt_fleet;

//! End-to-end tests over loopback: the real registry, aggregator and agents.

mod deployment;
mod inbox;
mod inproc;
mod loopback;
mod multiprocess;
mod netfaults;
mod procs;
mod renewal;
mod own_model;
mod tasks;
mod tour;
mod mqtt_fleet;

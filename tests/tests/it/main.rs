//! End-to-end tests over loopback: the real registry, aggregator and agents.

mod console;
mod deployment;
mod hosts;
mod inbox;
mod inproc;
mod loopback;
mod mqtt_fleet;
mod multiprocess;
mod netfaults;
mod object_store;
mod own_model;
mod procs;
mod relays;
mod renewal;
mod sampled;
mod secagg;
mod tasks;
mod tour;

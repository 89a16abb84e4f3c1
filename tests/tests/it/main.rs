//! End-to-end tests over loopback: the real registry, aggregator and agents.

mod loopback;

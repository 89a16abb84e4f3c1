//! fedfleet-aggregator: see the issue tracker; built in later slices.

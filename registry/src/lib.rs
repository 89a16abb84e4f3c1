//! fedfleet-registry: see the issue tracker; built in later slices.

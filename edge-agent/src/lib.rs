//! fedfleet-agent: see the issue tracker; built in later slices.

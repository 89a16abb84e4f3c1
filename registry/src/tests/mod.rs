//! In-crate tests (private API reachable; one test binary). The crash tests re-execute this
//! binary as a child process (see `store::crash_child`).

mod store;
mod tuf;

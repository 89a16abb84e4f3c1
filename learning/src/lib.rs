//! Learning.

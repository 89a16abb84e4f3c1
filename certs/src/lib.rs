//! Fleet PKI.

//! The one log setup of fedfleet's binaries.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Logs to stderr at `RUST_LOG`, or at `default` without it; coloured only when stderr is a
/// terminal, so logs redirected into files stay plain text. A second call does nothing.
pub fn init(default: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

//! One external server process (a broker) that a test starts, kills hard and starts again with
//! the same command line, its stdout and stderr appended to a log file.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// A server process run from `binary` with `args`; killed on drop.
pub struct Daemon {
    binary: PathBuf,
    args: Vec<String>,
    log: PathBuf,
    child: Option<Child>,
}

impl Daemon {
    /// Nothing runs until [`Daemon::spawn`].
    pub fn new(binary: PathBuf, args: Vec<String>, log: PathBuf) -> Daemon {
        Daemon { binary, args, log, child: None }
    }

    /// Starts the process (its output appended to the log).
    pub fn spawn(&mut self) -> std::io::Result<()> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let child = Command::new(&self.binary).args(&self.args).stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log).spawn()?;
        self.child = Some(child);
        Ok(())
    }

    /// The process id while it was started and not killed.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn is_running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// How it exited, once it has (the process is then forgotten); `None` while it runs.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        let status = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
        if status.is_some() {
            self.child = None;
        }
        status
    }

    /// Kills it (SIGKILL, as a crash) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// What it wrote so far (all its runs).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `name` on `PATH` or in the sbin directories (Debian installs brokers in `/usr/sbin`, which is
/// not on a normal user's `PATH`).
pub fn find_sbin(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/local/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Whether this process runs as root (brokers that drop privileges need telling).
pub fn running_as_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// Ports handed to daemons come from below Linux's ephemeral range (32768–60999): a port the
/// kernel picked for `bind(0)` is soon handed to someone's outgoing connection or another test's
/// socket, and a daemon started on it a moment later fails with "address already in use".
const DAEMON_PORTS: std::ops::Range<u16> = 20_000..32_000;

/// A port on `ip` free now for both TCP and UDP, that no other caller in this process has been
/// given (a process-wide counter from a per-process start; bound and released, so another
/// process may still take it in between, but nothing here hands it out twice).
pub fn free_port(ip: std::net::IpAddr) -> std::io::Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: std::sync::OnceLock<AtomicU32> = std::sync::OnceLock::new();
    let span = u32::from(DAEMON_PORTS.end - DAEMON_PORTS.start);
    // A random start (std's per-process hash keys), so concurrent test processes seldom meet.
    let next = NEXT.get_or_init(|| {
        let seed = std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), std::process::id());
        AtomicU32::new((seed % u64::from(span)) as u32)
    });
    for _ in 0..span {
        let offset = next.fetch_add(1, Ordering::Relaxed) % span;
        let port = DAEMON_PORTS.start + offset as u16;
        if std::net::TcpListener::bind((ip, port)).is_ok() && std::net::UdpSocket::bind((ip, port)).is_ok() {
            return Ok(port);
        }
    }
    Err(std::io::Error::new(std::io::ErrorKind::AddrInUse, format!("no free port on {ip} in {DAEMON_PORTS:?}")))
}

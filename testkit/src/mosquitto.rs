//! Runs Debian's `mosquitto` as the fleet's external broker: TLS with the fleet CA, client
//! certificates required, the certificate's CN as the MQTT user name, no anonymous clients, no
//! persistence. An operator helper ("run mosquitto for this fleet's PKI") and what the tests use
//! to run the control plane against a real external broker.
//!
//! [`Mosquitto::start`] writes `mosquitto.conf` and the broker key in the form Debian's OpenSSL
//! reads (PKCS#8 v1, see [`export_key_pkcs8_v1`]) into a work directory, starts the broker and
//! waits until it listens. [`Mosquitto::kill`] and [`Mosquitto::restart`] stop it hard and bring
//! a fresh process back on the same port (retained messages are lost, as after a crash). The
//! broker's stderr goes to `mosquitto.log` in the work directory ([`Mosquitto::log`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fedfleet_control::export_key_pkcs8_v1;

use crate::daemon::{Daemon, free_port, running_as_root};

/// How long a start or restart may take before it is an error.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Debug, thiserror::Error)]
pub enum MosquittoError {
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("broker key for mosquitto: {0}")]
    Key(fedfleet_certs::CertError),
    #[error("mosquitto exited ({status}); its log:\n{log}")]
    Exited { status: String, log: String },
    #[error("mosquitto did not listen on {addr} within {secs} s; its log:\n{log}")]
    NotListening { addr: SocketAddr, secs: u64, log: String },
}

// Printed in the message, so not also a `source`: a report of the chain would say it twice.
impl From<fedfleet_certs::CertError> for MosquittoError {
    fn from(e: fedfleet_certs::CertError) -> Self {
        MosquittoError::Key(e)
    }
}

/// The `mosquitto` binary on `PATH` or in the sbin directories (Debian installs it in
/// `/usr/sbin`, which is not on a normal user's `PATH`).
pub fn find_binary() -> Option<PathBuf> {
    crate::daemon::find_sbin("mosquitto")
}

/// What the broker serves with.
#[derive(Debug, Clone)]
pub struct MosquittoConfig {
    pub binary: PathBuf,
    /// Listener address; port 0 picks a free port (kept across restarts).
    pub listen: SocketAddr,
    /// The fleet CA certificate (clients must present a certificate it issued).
    pub ca_cert: PathBuf,
    /// The broker's server certificate and key, as `fedfleet-certs` writes them.
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Where the config, the exported key and the log go.
    pub work_dir: PathBuf,
    /// Largest MQTT packet accepted; the update chunks must fit.
    pub max_packet_size: u32,
    /// Access rules (`acl_file` text, e.g. `fedfleet_control::topics::mosquitto_acl`); `None`:
    /// every client may use every topic.
    pub acl: Option<String>,
    /// The fleet's CRL (`ca.crl`, `crlfile`): revoked devices are refused at the handshake. It is
    /// read at start and on SIGHUP ([`Mosquitto::pid`]).
    pub crl: Option<PathBuf>,
    /// QoS 1 messages the broker queues for one client beyond those in flight
    /// (`max_queued_messages`); past it, mosquitto drops them without a word. The aggregator's
    /// subscription takes every device's upload frames: a round's burst must fit.
    pub max_queued_messages: u32,
}

impl MosquittoConfig {
    pub fn new(binary: PathBuf, listen: SocketAddr, ca_cert: PathBuf, cert: PathBuf, key: PathBuf, work_dir: PathBuf) -> MosquittoConfig {
        MosquittoConfig {
            binary,
            listen,
            ca_cert,
            cert,
            key,
            work_dir,
            max_packet_size: 4 * 1024 * 1024,
            acl: None,
            crl: None,
            max_queued_messages: 1000,
        }
    }
}

/// A running (or killed, until [`Mosquitto::restart`]) mosquitto process; killed on drop.
pub struct Mosquitto {
    daemon: Daemon,
    addr: SocketAddr,
}

impl Mosquitto {
    /// Writes the config and key into `cfg.work_dir`, starts mosquitto and waits until it
    /// accepts connections.
    pub async fn start(cfg: MosquittoConfig) -> Result<Mosquitto, MosquittoError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |error| MosquittoError::Io { path, error }
        };
        std::fs::create_dir_all(&cfg.work_dir).map_err(io(&cfg.work_dir))?;
        let mut addr = cfg.listen;
        if addr.port() == 0 {
            addr.set_port(free_port(addr.ip()).map_err(io(&cfg.work_dir))?);
        }
        // Debian 12's OpenSSL 3.0 cannot read the PKCS#8 v2 keys fedfleet-certs writes.
        let key = cfg.work_dir.join("broker-v1.key");
        export_key_pkcs8_v1(&cfg.key, &key)?;
        if let Some(acl) = &cfg.acl {
            let path = cfg.work_dir.join("acl");
            std::fs::write(&path, acl).map_err(io(&path))?;
        }
        let conf = cfg.work_dir.join("mosquitto.conf");
        std::fs::write(&conf, config_text(&cfg, addr, &key)).map_err(io(&conf))?;
        let args = vec!["-c".to_owned(), conf.display().to_string()];
        let mut m = Mosquitto { daemon: Daemon::new(cfg.binary, args, cfg.work_dir.join("mosquitto.log")), addr };
        m.spawn_and_wait().await?;
        Ok(m)
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The running broker's process id (`kill -HUP` reloads the ACL and the CRL).
    pub fn pid(&self) -> Option<u32> {
        self.daemon.pid()
    }

    pub fn log_path(&self) -> &Path {
        self.daemon.log_path()
    }

    /// What the broker wrote to stderr so far (all its runs).
    pub fn log(&self) -> String {
        self.daemon.log()
    }

    pub fn is_running(&mut self) -> bool {
        self.daemon.is_running()
    }

    /// Kills the broker (SIGKILL, as a crash) and reaps it; every connection drops.
    pub fn kill(&mut self) {
        self.daemon.kill()
    }

    /// Kills the broker if it runs and starts a fresh one on the same address.
    pub async fn restart(&mut self) -> Result<(), MosquittoError> {
        self.kill();
        self.spawn_and_wait().await
    }

    async fn spawn_and_wait(&mut self) -> Result<(), MosquittoError> {
        let deadline = tokio::time::Instant::now() + LISTEN_TIMEOUT;
        loop {
            let log = self.daemon.log_path().to_path_buf();
            self.daemon.spawn().map_err(|error| MosquittoError::Io { path: log, error })?;
            // Listening, or exited (e.g. the port still held by a process just killed): retry.
            loop {
                if tokio::net::TcpStream::connect(self.addr).await.is_ok() {
                    return Ok(());
                }
                if let Some(status) = self.daemon.exited() {
                    if tokio::time::Instant::now() >= deadline {
                        return Err(MosquittoError::Exited { status: status.to_string(), log: self.log() });
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    break;
                }
                if tokio::time::Instant::now() >= deadline {
                    self.kill();
                    return Err(MosquittoError::NotListening { addr: self.addr, secs: LISTEN_TIMEOUT.as_secs(), log: self.log() });
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

fn config_text(cfg: &MosquittoConfig, addr: SocketAddr, key: &Path) -> String {
    let mut conf = format!(
        "per_listener_settings false\npersistence false\nlog_dest stderr\nlog_type error\nlog_type warning\n\
         listener {port} {ip}\ncafile {ca}\ncertfile {cert}\nkeyfile {key}\nrequire_certificate true\n\
         use_identity_as_username true\nallow_anonymous false\nmax_packet_size {max}\nmax_queued_messages {queued}\n",
        port = addr.port(),
        ip = addr.ip(),
        ca = cfg.ca_cert.display(),
        cert = cfg.cert.display(),
        key = key.display(),
        max = cfg.max_packet_size,
        queued = cfg.max_queued_messages,
    );
    if cfg.acl.is_some() {
        conf.push_str(&format!("acl_file {}\n", cfg.work_dir.join("acl").display()));
    }
    if let Some(crl) = &cfg.crl {
        conf.push_str(&format!("crlfile {}\n", crl.display()));
    }
    // As root, mosquitto drops to the `mosquitto` user, which cannot read the 0600 key.
    if running_as_root() {
        conf.push_str("user root\n");
    }
    conf
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_requires_client_certificates_and_names_the_v1_key() {
        let cfg = MosquittoConfig::new(
            "mosquitto".into(),
            ([127, 0, 0, 1], 18883).into(),
            "/pki/ca.crt".into(),
            "/pki/servers/broker.crt".into(),
            "/pki/servers/broker.key".into(),
            "/work".into(),
        );
        let text = config_text(&cfg, cfg.listen, Path::new("/work/broker-v1.key"));
        for line in [
            "listener 18883 127.0.0.1",
            "cafile /pki/ca.crt",
            "certfile /pki/servers/broker.crt",
            "keyfile /work/broker-v1.key",
            "require_certificate true",
            "use_identity_as_username true",
            "allow_anonymous false",
            "persistence false",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} missing from:\n{text}");
        }
    }
}

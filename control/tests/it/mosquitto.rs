//! The same flow against a real external broker: Debian's mosquitto, TLS with the fleet CA,
//! client certificates required. `.ci/run` installs it; the test fails (not skips) under `CI`
//! when it is missing.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::common::{self, Fleet};

fn find_mosquitto() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/local/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join("mosquitto"))
        .find(|p| p.is_file())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Mosquitto {
    bin: PathBuf,
    conf: PathBuf,
    log: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl Mosquitto {
    fn write_conf(dir: &Path, f: &Fleet, port: u16) -> PathBuf {
        let (crt, key) = f.server_files();
        // Debian's OpenSSL 3.0 cannot read the PKCS#8 v2 keys fedfleet-certs writes.
        let v1_key = dir.join("broker-v1.key");
        fedfleet_control::export_key_pkcs8_v1(&key, &v1_key).unwrap();
        let key = v1_key;
        let mut conf = format!(
            "per_listener_settings false\npersistence false\nlog_dest stderr\nlog_type error\nlog_type warning\n\
             listener {port} 127.0.0.1\ncafile {}\ncertfile {}\nkeyfile {}\nrequire_certificate true\n\
             use_identity_as_username true\nallow_anonymous false\nmax_packet_size 4194304\n",
            f.pki.ca_cert_path().display(),
            crt.display(),
            key.display()
        );
        // As root, mosquitto drops to the `mosquitto` user, which cannot read our 0600 key.
        if Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| o.stdout.starts_with(b"0\n"))
        {
            conf.push_str("user root\n");
        }
        let path = dir.join("mosquitto.conf");
        std::fs::write(&path, conf).unwrap();
        path
    }

    async fn start(bin: PathBuf, f: &Fleet) -> Mosquitto {
        let port = free_port();
        let conf = Self::write_conf(f.dir.path(), f, port);
        let log = f.dir.path().join("mosquitto.log");
        let mut m = Mosquitto {
            bin,
            conf,
            log,
            port,
            child: None,
        };
        m.spawn().await;
        m
    }

    async fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(&self.bin)
            .arg("-c")
            .arg(&self.conf)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start mosquitto");
        self.child = Some(child);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "mosquitto exited ({status}): {}",
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "mosquitto did not listen on {}",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Mosquitto {
    fn drop(&mut self) {
        self.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_flow_and_restart_over_mosquitto() {
    let Some(bin) = find_mosquitto() else {
        if std::env::var_os("CI").is_some() {
            panic!(
                "mosquitto is not installed; CI must install it (.ci/run does: apt-get install mosquitto)"
            );
        }
        eprintln!(
            "NOTE: mosquitto not found on PATH or in /usr/sbin; skipping the external-broker test outside CI"
        );
        return;
    };
    let f = Fleet::new(3);
    let mut broker = Mosquitto::start(bin, &f).await;
    let port = broker.port;
    let broker_ref = &mut broker;
    common::round_flow(&f, port, async || {
        broker_ref.stop();
        tokio::time::sleep(Duration::from_millis(300)).await;
        broker_ref.spawn().await;
        true
    })
    .await;
    broker.stop();
}

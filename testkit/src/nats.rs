//! Runs a cluster of `nats-server` processes (Debian's `nats-server`, 2.9) as the fleet's MQTT
//! broker: every node with its MQTT listener (TLS with the fleet CA, client certificates
//! required, `verify_and_map`: a client is the user named by its certificate's subject), JetStream
//! clustered (MQTT sessions and retained messages are replicated streams, so they outlive a
//! node), routes between the nodes on loopback under mutual TLS with the broker certificate (as
//! `deploy/nats/nats-node.conf` ships them), and the fleet's access rules
//! ([`fedfleet_control::topics::nats_authorization`]). What the tests use to run the control
//! plane on a broker cluster that loses a node.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::daemon::{Daemon, free_port};

/// How long the cluster may take to listen and elect its JetStream leader.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum NatsError {
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("nats-server node {node} exited ({status}); its log:\n{log}")]
    Exited { node: usize, status: String, log: String },
    #[error("the NATS cluster was not ready within {secs} s (MQTT listening, a JetStream leader); node logs:\n{logs}")]
    NotReady { secs: u64, logs: String },
}

/// The `nats-server` binary on `PATH` or in the sbin directories (Debian installs it in
/// `/usr/sbin`).
pub fn find_binary() -> Option<PathBuf> {
    crate::daemon::find_sbin("nats-server")
}

/// What the cluster serves with.
#[derive(Debug, Clone)]
pub struct NatsConfig {
    pub binary: PathBuf,
    pub nodes: usize,
    /// The fleet CA certificate (clients must present a certificate it issued).
    pub ca_cert: PathBuf,
    /// The broker's server certificate and key, as `fedfleet-certs` writes them (Go reads the
    /// ed25519 PKCS#8 key as it is).
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Where each node's config, JetStream store and log go.
    pub work_dir: PathBuf,
    /// Largest message (MQTT publish) accepted; the update chunks must fit.
    pub max_payload: u32,
    /// The `authorization` block (e.g. `fedfleet_control::topics::nats_authorization`).
    pub authorization: String,
}

impl NatsConfig {
    /// A 3-node cluster.
    pub fn new(binary: PathBuf, ca_cert: PathBuf, cert: PathBuf, key: PathBuf, work_dir: PathBuf, authorization: String) -> NatsConfig {
        NatsConfig { binary, nodes: 3, ca_cert, cert, key, work_dir, max_payload: 4 * 1024 * 1024, authorization }
    }
}

struct Node {
    daemon: Daemon,
    mqtt: SocketAddr,
    route: SocketAddr,
}

/// A running cluster; every node is killed on drop.
pub struct NatsCluster {
    nodes: Vec<Node>,
}

impl NatsCluster {
    /// Writes each node's config, starts every node and waits until each listens for MQTT and
    /// the cluster has a JetStream metadata leader.
    pub async fn start(cfg: NatsConfig) -> Result<NatsCluster, NatsError> {
        // The ports are picked free and released, so a test running beside this one may take
        // one first: then the node exits on "address already in use" and the cluster starts
        // again on other ports, from empty stores. The same for a cluster that did not form in
        // time: on two loaded cores nats-server 2.9's nodes can drop each other's routes as
        // duplicates over and over and elect no JetStream leader; a fresh start forms.
        let mut attempt = 1;
        loop {
            match Self::start_once(&cfg).await {
                Err(NatsError::NotReady { logs, .. }) if attempt < 3 => {
                    eprintln!("the NATS cluster did not form in time (attempt {attempt}); starting it again. Node logs:\n{logs}");
                }
                Err(NatsError::Exited { log, .. }) if attempt < 3 && log.contains("address already in use") => {}
                other => return other,
            }
            attempt += 1;
            for i in 1..=cfg.nodes {
                let _ = std::fs::remove_dir_all(cfg.work_dir.join(format!("n{i}")));
            }
        }
    }

    async fn start_once(cfg: &NatsConfig) -> Result<NatsCluster, NatsError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |error| NatsError::Io { path, error }
        };
        let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let mut ports = Vec::new();
        for _ in 0..cfg.nodes {
            let mut p = [0u16; 3]; // client, cluster route, MQTT
            for slot in &mut p {
                *slot = free_port(ip).map_err(io(&cfg.work_dir))?;
            }
            ports.push(p);
        }
        let mut nodes = Vec::new();
        for (i, [client, route, mqtt]) in ports.iter().copied().enumerate() {
            let dir = cfg.work_dir.join(format!("n{}", i + 1));
            std::fs::create_dir_all(&dir).map_err(io(&dir))?;
            let routes: Vec<String> =
                ports.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, p)| format!("nats-route://127.0.0.1:{}", p[1])).collect();
            let conf = dir.join("nats.conf");
            std::fs::write(&conf, config_text(cfg, i + 1, &dir, [client, route, mqtt], &routes)).map_err(io(&conf))?;
            let args = vec!["-c".to_owned(), conf.display().to_string()];
            let daemon = Daemon::new(cfg.binary.clone(), args, dir.join("nats.log"));
            nodes.push(Node { daemon, mqtt: SocketAddr::new(ip, mqtt), route: SocketAddr::new(ip, route) });
        }
        let mut cluster = NatsCluster { nodes };
        for i in 0..cluster.nodes.len() {
            cluster.spawn(i)?;
        }
        cluster.wait_ready().await?;
        Ok(cluster)
    }

    /// The process id of every running node (for a reload signal), node 0 first.
    pub fn pids(&self) -> Vec<u32> {
        self.nodes.iter().filter_map(|n| n.daemon.pid()).collect()
    }

    /// Every node's cluster route address, node 0 first.
    pub fn route_addrs(&self) -> Vec<SocketAddr> {
        self.nodes.iter().map(|n| n.route).collect()
    }

    /// Every node's MQTT address, node 0 first.
    pub fn mqtt_addrs(&self) -> Vec<SocketAddr> {
        self.nodes.iter().map(|n| n.mqtt).collect()
    }

    pub fn is_running(&mut self, node: usize) -> bool {
        self.nodes[node].daemon.is_running()
    }

    /// Kills one node (SIGKILL, as a crash); its clients' connections drop.
    pub fn kill(&mut self, node: usize) {
        self.nodes[node].daemon.kill();
    }

    /// Starts a killed node again (same config and store) and waits until it listens.
    pub async fn restart(&mut self, node: usize) -> Result<(), NatsError> {
        self.kill(node);
        self.spawn(node)?;
        self.wait_ready().await
    }

    /// The node that last said it became the JetStream metadata leader, if any did.
    pub fn meta_leader(&self) -> Option<usize> {
        const CLAIM: &str = "Self is new JetStream cluster metadata leader";
        self.nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| {
                let log = n.daemon.log();
                let line = log.lines().rfind(|l| l.contains(CLAIM))?;
                // "[pid] 2026/12/05 10:08:44.791061 [INF] ...": date and time order the claims.
                let stamp = line.split_whitespace().skip(1).take(2).collect::<Vec<_>>().join(" ");
                Some((stamp, i))
            })
            .max()
            .map(|(_, i)| i)
    }

    /// What each node wrote so far, headed by its name.
    pub fn logs(&self) -> String {
        self.nodes.iter().enumerate().map(|(i, n)| format!("--- n{}\n{}", i + 1, n.daemon.log())).collect()
    }

    fn spawn(&mut self, node: usize) -> Result<(), NatsError> {
        let d = &mut self.nodes[node].daemon;
        let path = d.log_path().to_path_buf();
        d.spawn().map_err(|error| NatsError::Io { path, error })
    }

    async fn wait_ready(&mut self) -> Result<(), NatsError> {
        let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
        loop {
            let mut ready = true;
            for (i, n) in self.nodes.iter_mut().enumerate() {
                if let Some(status) = n.daemon.exited() {
                    return Err(NatsError::Exited { node: i + 1, status: status.to_string(), log: n.daemon.log() });
                }
                if !n.daemon.is_running() {
                    continue; // killed on purpose
                }
                let leader = n.daemon.log().contains("metadata leader");
                ready &= leader && tokio::net::TcpStream::connect(n.mqtt).await.is_ok();
            }
            if ready {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(NatsError::NotReady { secs: READY_TIMEOUT.as_secs(), logs: self.logs() });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

fn config_text(cfg: &NatsConfig, n: usize, dir: &Path, [client, route, mqtt]: [u16; 3], routes: &[String]) -> String {
    let tls_with = |verify: &str| {
        format!(
            "tls {{ cert_file: \"{}\", key_file: \"{}\", ca_file: \"{}\", {verify}, timeout: 5 }}",
            cfg.cert.display(),
            cfg.key.display(),
            cfg.ca_cert.display()
        )
    };
    // The same TLS for NATS clients and MQTT clients: no one connects without a fleet
    // certificate, and the certificate's subject is the user.
    let tls = tls_with("verify_and_map: true");
    // Routes: each node is the other's client, both present the broker certificate.
    let route_tls = tls_with("verify: true");
    format!(
        "server_name: n{n}\nlisten: 127.0.0.1:{client}\nmax_payload: {max}\n{tls}\n\
         jetstream {{ store_dir: \"{store}\" }}\n\
         cluster {{ name: fedfleet, listen: 127.0.0.1:{route}, routes: [{routes}], {route_tls} }}\n\
         mqtt {{ listen: 127.0.0.1:{mqtt}, stream_replicas: {replicas}, consumer_replicas: 1, consumer_memory_storage: true, {tls} }}\n{auth}",
        // Left to itself a node sizes the MQTT streams by the peers it knows of at the first
        // connect (2 of 3 while the cluster forms), and an R2 stream stalls when a node dies.
        // The consumers behind QoS 1 subscriptions are per connection (sessions are clean):
        // replicated on disk, a fleet reconnecting after a node loss queues thousands of
        // JetStream requests (4 s time-outs on 2 cores); one copy in memory is what they need.
        replicas = cfg.nodes.min(3),
        max = cfg.max_payload,
        store = dir.join("js").display(),
        routes = routes.join(", "),
        auth = cfg.authorization,
    )
}

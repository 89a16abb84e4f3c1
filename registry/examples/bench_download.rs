//! N concurrent agents pulling one model from the registry over loopback QUIC (mTLS, per-chunk
//! BLAKE3 verification on both ends), beside a plain loopback TCP transfer of the same bytes to
//! the same number of concurrent readers, in the same run. Prints figures; asserts no times.
//!
//! ```text
//! cargo run --release -p fedfleet-registry --example bench_download -- [AGENTS] [SIZE_MB]
//! ```
//! (defaults: 100 agents, 100 MB, 1 MiB chunks)

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use fedfleet_certs::{ALPN_V1, DeviceIdentity, tls};
use fedfleet_protocol::{DeviceId, Digest, FleetId, ModelVersion};
use fedfleet_registry::client::{ChunkCache, DownloadReport, RegistryClient};
use fedfleet_registry::store::NewVersion;
use fedfleet_testkit::services::{RegistrySetup, RunningRegistry};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Verifies nothing itself (the client checked each digest on arrival); remembers which chunks
/// arrived and drops the bytes, so 100 agents do not hold 100 copies in memory.
#[derive(Default)]
struct Discard(HashSet<Digest>);

impl ChunkCache for Discard {
    fn contains(&self, d: &Digest) -> bool {
        self.0.contains(d)
    }
    fn get(&self, _: &Digest) -> std::io::Result<Option<Vec<u8>>> {
        Ok(None)
    }
    fn put(&mut self, d: &Digest, _: &[u8]) -> std::io::Result<()> {
        self.0.insert(*d);
        Ok(())
    }
    fn remove(&mut self, d: &Digest) -> std::io::Result<()> {
        self.0.remove(d);
        Ok(())
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let agents: usize = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(100);
    let size_mb: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(100);
    let size = size_mb * 1_000_000;
    let profile = if cfg!(debug_assertions) { "dev (debug assertions)" } else { "release" };
    println!(
        "command: cargo run {}-p fedfleet-registry --example bench_download -- {agents} {size_mb}",
        if cfg!(debug_assertions) { "" } else { "--release " }
    );
    println!(
        "profile: {profile}; cores: {}; agents: {agents}; model: {size_mb} MB; chunk: 1 MiB",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
    );

    let dir = tempfile::tempdir()?;
    let pki_dir = dir.path().join("pki");
    let fleet = FleetId::new("bench")?;
    let pki = fedfleet_testkit::services::fleet_pki(&pki_dir, &fleet, &["registry"], &[], 30)?;
    let running = RunningRegistry::start(&pki, &dir.path().join("data"), RegistrySetup::default())?;
    let (reg, addr) = (running.reg.clone(), running.addr);
    let mut model = vec![0u8; size];
    let mut h = blake3::Hasher::new();
    h.update(b"bench");
    h.finalize_xof().fill(&mut model);
    let model = Arc::new(model);
    let t = Instant::now();
    reg.publish(
        NewVersion {
            name: "bench".into(),
            spec: serde_json::json!({}).into(),
            parent: None,
            metrics: Default::default(),
            created_at_unix_ms: 0,
            publisher: "bench".into(),
            adapter: None,
        },
        model.as_slice(),
    )?;
    println!("publish: {:.2} s", t.elapsed().as_secs_f64());

    // Identities first (enrollment is not part of the transfer).
    let mut clients = Vec::new();
    for i in 0..agents {
        let id = DeviceId::new(format!("agent-{i:03}"))?;
        pki.enroll_device(&id, 30, false)?;
        let ident = DeviceIdentity::load(&pki_dir, &id)?;
        clients.push(RegistryClient::new(addr, "localhost", tls::client_config(pki.ca(), &ident, &[ALPN_V1])?)?);
    }

    // QUIC: every agent fetches the manifest and every chunk, verifying each digest.
    let t = Instant::now();
    let mut tasks = Vec::new();
    for c in clients {
        tasks.push(tokio::spawn(async move {
            let m = c.manifest("bench", ModelVersion(1)).await?;
            let mut cache = Discard::default();
            let mut r = DownloadReport::default();
            c.fetch_missing(&m, &mut cache, &mut r).await?;
            c.close().await;
            Ok::<_, anyhow::Error>(r.bytes_fetched)
        }));
    }
    let mut total = 0u64;
    for t in tasks {
        total += t.await??;
    }
    let quic_s = t.elapsed().as_secs_f64();
    assert_eq!(total, (agents * size) as u64);
    running.stop().await;

    // Plain TCP on loopback: the same bytes to the same number of concurrent readers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let taddr = listener.local_addr()?;
    let m2 = model.clone();
    let tsrv = tokio::spawn(async move {
        for _ in 0..agents {
            let (mut s, _) = listener.accept().await.expect("accept");
            let m = m2.clone();
            tokio::spawn(async move {
                for piece in m.chunks(1 << 20) {
                    s.write_all(piece).await.expect("write");
                }
                let _ = s.shutdown().await;
            });
        }
    });
    let t = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..agents {
        tasks.push(tokio::spawn(async move {
            let mut s = tokio::net::TcpStream::connect(taddr).await?;
            let mut buf = vec![0u8; 1 << 20];
            let mut n = 0u64;
            loop {
                let k = s.read(&mut buf).await?;
                if k == 0 {
                    break;
                }
                n += k as u64;
            }
            Ok::<_, std::io::Error>(n)
        }));
    }
    let mut ttotal = 0u64;
    for t in tasks {
        ttotal += t.await??;
    }
    let tcp_s = t.elapsed().as_secs_f64();
    tsrv.await?;
    assert_eq!(ttotal, (agents * size) as u64);

    let mb = (agents * size) as f64 / 1e6;
    println!(
        "QUIC registry (mTLS, chunk digests checked on both ends): {mb:.0} MB in {quic_s:.2} s = {:.0} MB/s aggregate, {:.1} MB/s per agent",
        mb / quic_s,
        mb / quic_s / agents as f64
    );
    println!("plain loopback TCP (no TLS, no hashing):                  {mb:.0} MB in {tcp_s:.2} s = {:.0} MB/s aggregate", mb / tcp_s);
    println!("ratio QUIC/TCP: {:.2}", tcp_s / quic_s);
    Ok(())
}

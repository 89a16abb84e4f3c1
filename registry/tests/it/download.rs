use std::sync::atomic::Ordering;

use crate::support::unix_ms;
use fedfleet_registry::client::{DirChunkCache, MemChunkCache};
use fedfleet_registry::tuf::Verifier;

use crate::support::{CHUNK, Harness, bytes, deadline, v};

const LEN: usize = 4 * 1024 * 1024 + 12_345; // 65 chunks, the last one short

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_at_random_offset_resumes_to_the_exact_artifact() {
    deadline(60, async {
        let h = Harness::start().await;
        let data = bytes(1, LEN);
        h.publish("m", &data);
        let mut off = [0u8; 8];
        rand_core::RngCore::fill_bytes(&mut rand_core::OsRng, &mut off);
        let offset = 1 + u64::from_le_bytes(off) % (LEN as u64 - 2);
        eprintln!("cutting the connection after {offset} bytes");
        h.faults.cut_after_bytes.store(offset, Ordering::Relaxed);

        let tmp = tempfile::tempdir().unwrap();
        let mut cache = DirChunkCache::open(tmp.path().join("chunks")).unwrap();
        let dest = tmp.path().join("model.bin");
        let c = h.device("dev-1");
        let r = c.download("m", v(1), &mut cache, &dest).await.unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), data, "exact artifact after the cut");
        assert!(r.reconnects >= 1, "{r:?}");
        assert_eq!(r.bytes_fetched, LEN as u64, "each chunk verified and stored once: {r:?}");
        assert!(r.wire_bytes >= LEN as u64);
        h.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_across_a_restart_fetches_only_the_rest() {
    deadline(60, async {
        let h = Harness::start().await;
        let data = bytes(2, LEN);
        h.publish("m", &data);
        let cut = 20 * CHUNK as u64 + 777;
        h.faults.cut_after_bytes.store(cut, Ordering::Relaxed);
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("model.bin");
        {
            // A client that does not retry: the "process" dies with the connection.
            let mut cache = DirChunkCache::open(tmp.path().join("chunks")).unwrap();
            let mut c = h.device("dev-1");
            c.max_retries = 0;
            let e = c.download("m", v(1), &mut cache, &dest).await.unwrap_err();
            assert!(e.is_transport(), "{e}");
            assert!(!dest.exists());
        }
        // Chunks delivered before the cut are in the cache (QUIC drops data in flight on close,
        // so that is up to 20 of them).
        let held = std::fs::read_dir(tmp.path().join("chunks")).unwrap().count() as u64;
        eprintln!("{held} chunks cached before the cut");
        assert!(held <= 20);
        // "Restart": a new client and cache handle over the same directory.
        let mut cache = DirChunkCache::open(tmp.path().join("chunks")).unwrap();
        let c = h.device("dev-1");
        let r = c.download("m", v(1), &mut cache, &dest).await.unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), data);
        assert_eq!(r.chunks_reused, held, "{r:?}");
        assert_eq!(r.bytes_fetched, LEN as u64 - held * CHUNK as u64, "{r:?}");
        h.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_chunks_are_detected_and_refetched() {
    deadline(60, async {
        let h = Harness::start().await;
        let data = bytes(3, LEN);
        h.publish("m", &data);
        let tmp = tempfile::tempdir().unwrap();
        let mut cache = DirChunkCache::open(tmp.path().join("chunks")).unwrap();
        let c = h.device("dev-1");

        // On the wire: the server flips a byte in the next 3 chunks it serves.
        h.faults.corrupt_chunks.store(3, Ordering::Relaxed);
        let dest = tmp.path().join("a.bin");
        let r = c.download("m", v(1), &mut cache, &dest).await.unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), data);
        assert_eq!(r.corrupt_on_arrival, 3, "{r:?}");
        assert_eq!(r.bytes_fetched, LEN as u64);
        let chunks = LEN.div_ceil(CHUNK as usize) as u64;
        assert_eq!(h.reg.metrics().chunks_served.get(), chunks + 3);

        // In the cache: a chunk file rots on disk; assembly notices and refetches just it.
        let m = c.manifest("m", v(1)).await.unwrap();
        let victim = cache.path_of(&m.chunks[7].digest);
        let mut b = std::fs::read(&victim).unwrap();
        b[100] ^= 1;
        std::fs::write(&victim, b).unwrap();
        let dest2 = tmp.path().join("b.bin");
        let r = c.download("m", v(1), &mut cache, &dest2).await.unwrap();
        assert_eq!(std::fs::read(&dest2).unwrap(), data);
        assert_eq!((r.corrupt_in_cache, r.chunks_fetched, r.bytes_fetched), (1, 1, CHUNK as u64), "{r:?}");
        h.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_download_moves_only_the_missing_chunks() {
    deadline(60, async {
        let h = Harness::start().await;
        let v1 = bytes(4, LEN);
        let mut v2 = v1.clone();
        for chunk in [3usize, 30, 60] {
            let at = chunk * CHUNK as usize + 5;
            v2[at..at + 10].copy_from_slice(b"new weight");
        }
        h.publish("m", &v1);
        h.publish("m", &v2);
        let tmp = tempfile::tempdir().unwrap();
        let mut cache = MemChunkCache::default();
        let c = h.device("dev-1");
        c.download("m", v(1), &mut cache, &tmp.path().join("v1")).await.unwrap();
        let served_before = h.reg.metrics().bytes_served.get();
        let wire_before = c.wire_bytes();

        let r = c.download("m", v(2), &mut cache, &tmp.path().join("v2")).await.unwrap();
        assert_eq!(std::fs::read(tmp.path().join("v2")).unwrap(), v2);
        let served = h.reg.metrics().bytes_served.get() - served_before;
        let wire = c.wire_bytes() - wire_before;
        eprintln!(
            "delta: v2 is {LEN} bytes; chunk payload served {served} B, read from streams {wire} B \
             (manifest included), chunks fetched {} of {}",
            r.chunks_fetched, r.chunks_total
        );
        assert_eq!(r.chunks_fetched, 3);
        assert_eq!(r.chunks_reused, r.chunks_total - 3);
        assert_eq!(served, 3 * CHUNK as u64, "only the 3 changed chunks moved");
        assert!(wire < 3 * CHUNK as u64 + 16 * 1024, "wire bytes {wire}");
        assert!(cache.chunks.len() as u64 == r.chunks_total + 3);
        h.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_agents_and_verified_metadata() {
    deadline(60, async {
        let h = Harness::start().await;
        let data = bytes(5, 2 * 1024 * 1024 + 1);
        h.publish("m", &data);
        let root = h.reg.signer().unwrap().root().clone();
        let mut tasks = Vec::new();
        for i in 0..8 {
            let c = h.device(&format!("dev-{i}"));
            let root = root.clone();
            let data = data.clone();
            tasks.push(tokio::spawn(async move {
                let now = unix_ms();
                let mut ver = Verifier::new(root).unwrap();
                let md = c.metadata(ver.root().version).await.unwrap();
                for r in &md.roots {
                    ver.update_root(r).unwrap();
                }
                ver.update_timestamp(&md.timestamp, now).unwrap();
                ver.update_targets(&md.targets, now).unwrap();
                let target = ver.target("m", v(1), now).unwrap().clone();
                let tmp = tempfile::tempdir().unwrap();
                let mut cache = MemChunkCache::default();
                let dest = tmp.path().join("m.bin");
                c.download_target(&target, &mut cache, &dest).await.unwrap();
                let got = std::fs::read(&dest).unwrap();
                ver.verify_artifact("m", v(1), &got, now).unwrap();
                assert_eq!(got, data);
                // The byte-range API the agent's trait uses.
                let part = c.read_range("m", v(1), 70_000, 100_000).await.unwrap();
                assert_eq!(part, data[70_000..170_000]);
                let tail = c.read_range("m", v(1), data.len() as u64 - 10, 100).await.unwrap();
                assert_eq!(tail, data[data.len() - 10..]);
                c.close().await;
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let text = h.reg.metrics().render();
        assert!(text.contains("fedfleet_registry_requests_total{kind=\"chunks\"}"), "{text}");
        h.stop().await;
    })
    .await;
}

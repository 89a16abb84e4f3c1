//! Aggregation benchmark: fold throughput beside `memcpy`, end-to-end ingest throughput
//! (signature verify + payload digest + safetensors decode/check + flatten + fold), and peak RSS.
//!
//! ```text
//! cargo run --release -p fedfleet-aggregator --example bench_aggregate -- [--params 1000000,10000000] [--updates 10,100,1000] [--e2e-max 1000] [--device cpu]
//! ```
//!
//! `tensor GB/s` is the `[compute] fold = "tensor"` path (`accel::TensorBackend`) on `--device`
//! (`cpu` = burn flex; `gpu` needs `--features wgpu`), including the host→device upload.
//! After each P's fold rows, one `step` row: a FedAdam server step (`AdaptiveOptimizer::step`:
//! upload of global, m, v; the Adam update; read-back) on the device beside the same step in the
//! exact CPU backend, the device's memory bandwidth (`a + b` on the device, synced: 12·P bytes)
//! and the host<->device transfer rate (upload P floats, add 1, read them back: 8·P bytes
//! across), which bounds the tensor fold since every update is uploaded.
//! `benches/gpu.sh` runs this with the GPU feature up to P = 100M, N = 1,000.
//!
//! Deltas are generated on the fly from a seeded xorshift into one reused buffer, so memory stays
//! flat whatever N is; the end-to-end part cycles through 4 pre-encoded, signed payloads (the
//! same bytes each time would be no cheaper: every step is done again). Peak RSS is the process's
//! VmHWM after each row: with FedAvg it must not grow with N (it grows with P: the i128 partial
//! sum is 16 B per parameter). Figures are printed, never asserted.

use std::time::Instant;

use ed25519_dalek::SigningKey;
use fedfleet_aggregator::accel::TensorBackend;
use fedfleet_aggregator::service::decode_update;
use fedfleet_aggregator::strategy::{
    AdaptiveOptimizer, Backend, ClientConfig, Exact, FedOptKind, FedOptParams, ServerOptimizer, ServerStrategy, Strategy, StrategyConfig,
};
use fedfleet_protocol::{BundleLimits, DType, DeviceId, Digest, FleetId, PayloadCheck, RoundId, Signed, TensorBundle, UpdateHeader};

fn fill(buf: &mut [f32], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for v in buf.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *v = ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.02;
    }
}

/// The value after `name` on the command line, or `default`.
fn arg_text(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned()).unwrap_or_else(|| default.to_owned())
}

fn arg(name: &str, default: &str) -> Vec<usize> {
    arg_text(name, default).split(',').map(|s| s.trim().parse().expect("a number")).collect()
}

fn gbps(bytes: f64, secs: f64) -> f64 {
    bytes / secs / 1e9
}

fn main() {
    let device_name = arg_text("--device", "cpu");
    let picked = fedfleet_aggregator::accel::select_device(&device_name).unwrap_or_else(|e| {
        eprintln!("--device {device_name}: {e}");
        std::process::exit(2)
    });
    let device = picked.device;
    let params = arg("--params", "1000000,10000000");
    let updates = arg("--updates", "10,100,1000");
    let e2e_max = arg("--e2e-max", "1000")[0];
    println!(
        "command: cargo run --release -p fedfleet-aggregator --example bench_aggregate -- --params {} --updates {} --e2e-max {e2e_max} --device {device_name}",
        params.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(","),
        updates.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(","),
    );
    println!("profile: {}", if cfg!(debug_assertions) { "debug" } else { "release" });
    println!("tensor device: {}", picked.adapter);
    println!(
        "{:>10} {:>6} {:>12} {:>12} {:>12} {:>14} {:>12}",
        "P", "N", "fold GB/s", "tensor GB/s", "memcpy GB/s", "ingest GB/s", "peak RSS MB"
    );
    let key = SigningKey::from_bytes(&[7; 32]);
    let vk = key.verifying_key();
    for &p in &params {
        let mut delta = vec![0f32; p];
        let mut dst = vec![0f32; p];
        // The model layout: one big tensor, as a flat 2-D weight.
        let mut layout = fedfleet_protocol::Layout::new();
        layout.insert("w".to_owned(), vec![p / 1000, 1000]);
        assert_eq!(p % 1000, 0, "P must be a multiple of 1000");
        // 4 signed, encoded updates for the end-to-end path.
        let pool: Vec<(Vec<u8>, Vec<u8>)> = (0..4)
            .map(|k| {
                fill(&mut delta, 1000 + k);
                let mut b = TensorBundle::new();
                b.insert_f32("w", vec![p / 1000, 1000], delta.clone()).unwrap();
                let payload = b.encode();
                let h = bench_header(k as usize, payload.len() as u64, Digest::of(&payload));
                (Signed::sign(h, &key).encode(), payload)
            })
            .collect();
        let limits = BundleLimits { max_bytes: p * 4 + 65536, max_tensors: 1, max_params: p };
        for &n in &updates {
            // Fold: FedAvg over N generated deltas (generation not timed).
            let mut s = ServerStrategy::new(&StrategyConfig::FedAvg { client: ClientConfig::default() }, p).unwrap();
            let backend = TensorBackend::new(&device);
            let mut tensor = backend.new_sum(p);
            let mut fold_secs = 0.0;
            let mut tensor_secs = 0.0;
            let mut copy_secs = 0.0;
            for i in 0..n {
                fill(&mut delta, i as u64);
                let t = Instant::now();
                s.fold(&delta, 1 + (i as u64 % 50)).unwrap();
                fold_secs += t.elapsed().as_secs_f64();
                let t = Instant::now();
                backend.fold(&mut tensor, &delta, 1 + (i as u64 % 50), 1.0).unwrap();
                tensor_secs += t.elapsed().as_secs_f64();
                let t = Instant::now();
                dst.copy_from_slice(&delta);
                std::hint::black_box(&mut dst);
                copy_secs += t.elapsed().as_secs_f64();
            }
            // The mean read back, so queued device work is inside the timing.
            let t = Instant::now();
            std::hint::black_box(backend.download(backend.mean(&tensor).unwrap()).unwrap());
            tensor_secs += t.elapsed().as_secs_f64();
            drop(tensor);
            let bytes = (n * p * 4) as f64;
            // End-to-end: verify + digest + decode/check + flatten + fold.
            let mut ingest_secs = None;
            let e2e = if n <= e2e_max {
                let mut s = ServerStrategy::new(&StrategyConfig::FedAvg { client: ClientConfig::default() }, p).unwrap();
                let t = Instant::now();
                for i in 0..n {
                    let (hdr, payload) = &pool[i % pool.len()];
                    let signed = fedfleet_protocol::SignedUpdate::decode(hdr).unwrap();
                    signed.verify(&vk).unwrap();
                    let mut check = PayloadCheck::new(signed.body());
                    for c in payload.chunks(1 << 20) {
                        check.update(c).unwrap();
                    }
                    check.finish().unwrap();
                    let flat = decode_update(payload, &layout, &limits, DType::F32, p).unwrap();
                    s.fold(&flat, 10).unwrap();
                }
                let secs = t.elapsed().as_secs_f64();
                ingest_secs = Some(secs);
                format!("{:.2}", gbps(bytes, secs))
            } else {
                "skipped".to_owned()
            };
            let (_, hwm) = fedfleet_aggregator::metrics::memory();
            println!(
                "{:>10} {:>6} {:>12.2} {:>12.2} {:>12.2} {:>14} {:>12.0}",
                p,
                n,
                gbps(bytes, fold_secs),
                gbps(bytes, tensor_secs),
                gbps(bytes, copy_secs),
                e2e,
                hwm as f64 / 1e6
            );
            // Machine-readable (benches/flower/compare.py reads it).
            println!(
                "RESULT fold params={p} updates={n} seconds={fold_secs:.6} tensor_seconds={tensor_secs:.6} peak_rss_kib={}{}",
                hwm / 1024,
                ingest_secs.map(|s| format!(" ingest_seconds={s:.6}")).unwrap_or_default()
            );
        }
        server_step_row(&device, p);
    }
    signature_rows();
}

/// Device `dev-{i}`'s header of an update of `payload_len` bytes.
fn bench_header(i: usize, payload_len: u64, payload_digest: Digest) -> UpdateHeader {
    UpdateHeader {
        device: DeviceId::new(format!("dev-{i}")).unwrap(),
        fleet: FleetId::new("bench").unwrap(),
        round: RoundId(1),
        base_model: Digest::of(b"base"),
        nonce: [i as u8; 16],
        sample_count: 10,
        payload_len,
        payload_digest,
        payload_dtype: DType::F32,
    }
}

/// The update header's Ed25519 check, one by one (`verify_strict`) and in the batches the
/// aggregator's fold thread takes (`fedfleet_protocol::verify_batch`), per signature.
fn signature_rows() {
    const N: usize = 1024;
    let headers: Vec<(fedfleet_protocol::SignedUpdate, ed25519_dalek::VerifyingKey)> = (0..N)
        .map(|i| {
            let key = SigningKey::from_bytes(&Digest::of(&(i as u64).to_le_bytes()).0);
            (Signed::sign(bench_header(i, 20_000, Digest::of(&i.to_le_bytes())), &key), key.verifying_key())
        })
        .collect();
    let one_by_one = time_once(&|| {
        for (signed, key) in &headers {
            signed.verify(key).unwrap();
        }
    }) / N as f64;
    let mut row = format!("ed25519 update header: one by one {:.1} us", one_by_one * 1e6);
    for batch in [2usize, 8, 64] {
        let secs = time_once(&|| {
            for group in headers.chunks(batch) {
                let items: Vec<_> = group.iter().map(|(s, k)| (s, k)).collect();
                assert!(fedfleet_protocol::verify_batch(&items).iter().all(Result::is_ok));
            }
        }) / N as f64;
        row += &format!("; batch of {batch} {:.1} us ({:.2}x)", secs * 1e6, one_by_one / secs);
        println!("RESULT signature batch={batch} seconds_per_signature={secs:.9} one_by_one={one_by_one:.9}");
    }
    println!("{row} (per signature, {N} signatures)");
}

/// Seconds for one call of `f`, after one warm-up call.
fn time_once(f: &dyn Fn()) -> f64 {
    f();
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

/// One FedAdam server step on the device and in the exact CPU backend, and the device's
/// host<->device transfer rate; each timed after one warm-up.
fn server_step_row(device: &burn::tensor::Device, p: usize) {
    let backend = TensorBackend::new(device);
    let mut global = vec![0f32; p];
    fill(&mut global, 77);
    let mut delta = vec![0f32; p];
    fill(&mut delta, 78);
    let opt = ServerOptimizer::Adaptive(AdaptiveOptimizer::new(FedOptKind::Adam, FedOptParams::adam(), p).unwrap());
    let on_device = backend.upload(&delta);
    let device_secs = time_once(&|| {
        std::hint::black_box(opt.clone().step(&backend, &global, &on_device).unwrap());
    });
    let exact_delta: Vec<f64> = delta.iter().map(|&x| x as f64).collect();
    let exact_secs = time_once(&|| {
        std::hint::black_box(opt.clone().step(&Exact, &global, &exact_delta).unwrap());
    });
    // Device memory: `a + b` kept alive, then a device sync (reads 8·P, writes 4·P bytes).
    // Reductions are no use here: burn's fusion answered repeated sums of an unchanged tensor,
    // and an `a + b` feeding a sum, faster than memory can be read.
    let a = backend.upload(&global);
    const ADDS: u32 = 5;
    let device_secs_per_add = time_once(&|| {
        let sums: Vec<_> = (0..ADDS).map(|_| backend.add(&a, &on_device)).collect();
        device.sync().expect("device sync");
        std::hint::black_box(sums);
    }) / ADDS as f64;
    // Host <-> device transfer, which bounds the tensor fold (every update is uploaded): upload
    // P floats, add 1 on the device, read all P back.
    const COPIES: u32 = 3;
    let transfer_secs = time_once(&|| {
        for _ in 0..COPIES {
            let on_device = backend.upload(&global).add_scalar(1.0);
            std::hint::black_box(backend.download(on_device).unwrap());
        }
    }) / COPIES as f64;
    println!(
        "{:>10} {:>6} fedadam step: device {:.1} ms, exact CPU {:.1} ms; device memory {:.2} GB/s, host<->device {:.2} GB/s",
        p,
        "step",
        device_secs * 1e3,
        exact_secs * 1e3,
        gbps(12.0 * p as f64, device_secs_per_add),
        gbps(8.0 * p as f64, transfer_secs)
    );
    println!(
        "RESULT step params={p} device_seconds={device_secs:.6} exact_seconds={exact_secs:.6} device_memory_gbps={:.3} transfer_gbps={:.3}",
        gbps(12.0 * p as f64, device_secs_per_add),
        gbps(8.0 * p as f64, transfer_secs)
    );
}

//! What SecAgg+ costs a round, per device and at the aggregator: compute per stage and bytes
//! each way, beside a plain upload of the same update (f32). Every device runs in this process,
//! one after the other, on the real cores (`fedfleet-secagg`): keys, encrypted shares, masked
//! input with a share of devices dropping out before it, unmasking. The unmasked sum is checked
//! against the plain sum of the survivors' quantized updates before a figure is printed.
//!
//!   cargo run --release -p fedfleet-secagg --example bench_secagg -- --devices 20,100,500 --dim 20000
//!
//! Degree (neighbours per device) is 2·⌈log₂ n⌉ rounded up to even, at most n − 1, and the
//! threshold half of it plus one, unless given.

use std::time::{Duration, Instant};

use clap::Parser;
use ed25519_dalek::SigningKey;
use fedfleet_protocol::{DeviceId, RoundId};
use fedfleet_secagg::{Client, Deadlines, Params, Roster, Server, Stage, encode, vector_bytes};

#[derive(Parser)]
struct Args {
    /// Devices per round (a comma-separated list runs each).
    #[arg(long, value_delimiter = ',', default_value = "20,100,500")]
    devices: Vec<usize>,
    /// Model coordinates (20,000 f32 = an 80 kB update).
    #[arg(long, default_value_t = 20_000)]
    dim: usize,
    /// Share of the devices that drop out after sending their shares.
    #[arg(long, default_value_t = 0.05)]
    dropout: f64,
    /// Neighbours per device (default: 2·⌈log₂ n⌉, even, at most n − 1).
    #[arg(long)]
    degree: Option<u16>,
}

struct Costs {
    client: [Duration; 4],
    server: Duration,
    sent: usize,
    received: usize,
}

fn run(n: usize, dim: usize, dropout: f64, degree: Option<u16>) -> Costs {
    let degree = degree.unwrap_or_else(|| {
        let d = 2 * (usize::BITS - (n - 1).leading_zeros()) as usize;
        let d = d.min(n - 1);
        (d - d % 2).max(2) as u16
    });
    let params = Params { threshold: degree / 2 + 1, degree, frac_bits: 24, clip: 1024.0 };
    let keys: Vec<SigningKey> = (0..n).map(|i| SigningKey::from_bytes(&blake3::hash(&i.to_le_bytes()).into())).collect();
    let ids: Vec<DeviceId> = (0..n).map(|i| DeviceId::new(format!("dev-{i:05}")).unwrap()).collect();
    let roster = Roster::new(
        RoundId(1),
        params,
        dim as u32,
        [9; 32],
        ids.iter().zip(&keys).map(|(d, k)| (d.clone(), k.verifying_key().to_bytes())).collect(),
    )
    .unwrap_or_else(|e| panic!("{n} devices: {e}"));
    let far = u64::MAX / 2;
    let mut server = Server::new(roster.clone(), Deadlines { keys: far, shares: far, masked: far, unmask: far });
    let updates: Vec<Vec<f32>> = (0..n).map(|i| (0..dim).map(|j| ((i * 31 + j * 7) % 1000) as f32 * 1e-5 - 0.005).collect()).collect();
    let dropped: Vec<bool> = (0..n).map(|i| (i as f64 + 0.5) / n as f64 <= dropout).collect();
    let mut c = Costs { client: [Duration::ZERO; 4], server: Duration::ZERO, sent: 0, received: 0 };

    let mut clients = Vec::new();
    for i in 0..n {
        let t = Instant::now();
        let (client, msg) = Client::new(roster.clone(), &ids[i], keys[i].clone(), [i as u8; 32]).unwrap();
        c.client[0] += t.elapsed();
        c.sent += msg.encode().len();
        timed(&mut c.server, || server.handle(&msg, None).unwrap());
        clients.push(client);
    }
    for i in 0..n {
        let adverts = server.keys_for(&ids[i]);
        c.received += adverts.iter().map(|a| a.encode().len()).sum::<usize>();
        let t = Instant::now();
        let msg = clients[i].on_keys(&adverts).unwrap();
        c.client[1] += t.elapsed();
        c.sent += msg.encode().len();
        timed(&mut c.server, || server.handle(&msg, None).unwrap());
    }
    for i in (0..n).filter(|&i| !dropped[i]) {
        let shares = server.shares_for(&ids[i]);
        c.received += shares.iter().map(|(_, ct)| ct.len() + 32).sum::<usize>();
        let t = Instant::now();
        let (msg, y) = clients[i].on_shares(&shares, &updates[i], 10).unwrap();
        c.client[2] += t.elapsed();
        c.sent += msg.encode().len() + vector_bytes(&y).len();
        timed(&mut c.server, || server.handle(&msg, Some(&y)).unwrap());
    }
    // The drop-outs never send: close the masked-input stage as its deadline would.
    if server.stage() == Stage::Masked {
        timed(&mut c.server, || server.handle_timeout(far));
    }
    for i in (0..n).filter(|&i| !dropped[i]) {
        let request = server.unmask_request_for(&ids[i]);
        c.received += request.survivors.len() * 12 + request.dropped.len() * 12;
        let t = Instant::now();
        let msg = clients[i].on_unmask(&request).unwrap();
        c.client[3] += t.elapsed();
        c.sent += msg.encode().len();
        timed(&mut c.server, || server.handle(&msg, None).unwrap());
    }
    assert_eq!(server.stage(), Stage::Done, "{:?}", server.failure());
    let agg = server.result().unwrap();
    let mut plain = vec![0i64; dim];
    for i in (0..n).filter(|&i| !dropped[i]) {
        for (s, q) in plain.iter_mut().zip(encode(&updates[i], 10, &params)) {
            *s += q as i64;
        }
    }
    assert_eq!(agg.sums, plain, "the unmasked sum is the survivors' exact sum");
    c
}

/// Runs `f`, adding its time to `acc`.
fn timed<T>(acc: &mut Duration, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let out = f();
    *acc += t.elapsed();
    out
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() {
    let a = Args::parse();
    println!(
        "SecAgg+ round, {} coordinates ({} kB as f32), {:.0} % drop out after sharing; every sum checked exact",
        a.dim,
        a.dim * 4 / 1000,
        a.dropout * 100.0
    );
    println!(
        "| devices | device ms, mean (keys / shares / mask / unmask) | aggregator ms, whole round | bytes sent per device | bytes received per device | sent vs plain f32 upload |"
    );
    println!("|---|---|---|---|---|---|");
    for &n in &a.devices {
        let c = run(n, a.dim, a.dropout, a.degree);
        let per = |d: Duration| ms(d) / n as f64;
        let plain = a.dim * 4;
        println!(
            "| {n} | {:.2} / {:.2} / {:.2} / {:.2} | {:.1} | {} | {} | {:.2}x |",
            per(c.client[0]),
            per(c.client[1]),
            per(c.client[2]),
            per(c.client[3]),
            ms(c.server),
            c.sent / n,
            c.received / n,
            (c.sent / n) as f64 / plain as f64
        );
    }
    let devices: Vec<String> = a.devices.iter().map(|n| n.to_string()).collect();
    println!("command: cargo run --release -p fedfleet-secagg --example bench_secagg -- --devices {} --dim {}", devices.join(","), a.dim);
}

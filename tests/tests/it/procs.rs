//! Child processes of the real binaries for the multi-process tests: locating the binaries,
//! a guard that kills and reaps a child (and prints its log tail when the test fails), one-shot
//! CLI runs, free loopback ports, polling, Prometheus text and a seeded RNG.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `target/<profile>/<name>`: the binaries `cargo test`/`cargo build --bins` put next to the
/// test executable's `deps/` directory.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("path of the test executable");
    let dir = exe.parent().and_then(Path::parent).expect("test executable lives in target/<profile>/deps");
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is missing: run `cargo build --workspace --bins` first (the multi-process tests start the real binaries)",
        path.display()
    );
    path
}

/// Longest a one-shot CLI command may run (coreutils `timeout` kills it): a `--wait` that
/// never ends fails the test instead of hanging the suite.
const CLI_TIMEOUT_SECS: &str = "300";

/// Runs a CLI command to completion; panics with its output unless it succeeds. Returns stdout.
pub fn cli(name: &str, args: &[&str], cwd: &Path) -> String {
    let out = Command::new("timeout")
        .arg(CLI_TIMEOUT_SECS)
        .arg(bin(name))
        .args(args)
        .current_dir(cwd)
        .env("NO_COLOR", "1")
        .env("RUST_LOG", "warn")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {name}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "`{name} {}` failed ({}):\nstdout: {stdout}\nstderr: {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// A long-running child. Dropping it kills (SIGKILL) and reaps it; during a panic it also
/// prints the tail of the child's log.
pub struct Proc {
    pub name: String,
    child: Option<Child>,
    pub log: PathBuf,
}

impl Proc {
    /// Starts `bin args` in `cwd` under `wrapper` (`wrapper... bin args`, e.g. `ip netns exec
    /// NS`, or nothing), stdout and stderr appended to `log` (kept across restarts), logging at
    /// `rust_log` (an `EnvFilter` directive). A wrapper must exec the binary, so the child's pid
    /// and signals are the binary's.
    pub fn spawn(wrapper: &[String], name: &str, binary: &str, args: &[&str], cwd: &Path, log: &Path, rust_log: &str) -> Proc {
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(log).expect("log file");
        let _ =
            writeln!(f, "===== {name}: {}{binary} {} =====", wrapper.iter().map(|w| format!("{w} ")).collect::<String>(), args.join(" "));
        let mut cmd = match wrapper.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(bin(binary));
                c
            }
            None => Command::new(bin(binary)),
        };
        let child = cmd
            .args(args)
            .current_dir(cwd)
            .env("NO_COLOR", "1")
            .env("RUST_LOG", rust_log)
            .stdin(Stdio::null())
            .stdout(f.try_clone().expect("log file"))
            .stderr(f)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Proc { name: name.into(), child: Some(child), log: log.to_owned() }
    }

    /// Panics (with the log tail) if the child has exited.
    pub fn assert_running(&mut self) {
        if let Some(c) = &mut self.child
            && let Ok(Some(status)) = c.try_wait()
        {
            panic!("{} exited ({status}):\n{}", self.name, tail(&self.log, 40));
        }
    }

    /// SIGKILL and reap.
    pub fn sigkill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then waits (up to 30 s, then SIGKILL); panics if it did not exit cleanly.
    pub fn stop(&mut self) {
        let Some(mut c) = self.child.take() else {
            return;
        };
        let _ = Command::new("kill").args(["-TERM", &c.id().to_string()]).status();
        let t0 = Instant::now();
        loop {
            match c.try_wait() {
                Ok(Some(status)) => {
                    assert!(status.success(), "{} did not stop cleanly ({status}):\n{}", self.name, tail(&self.log, 40));
                    return;
                }
                Ok(None) if t0.elapsed() < Duration::from_secs(30) => std::thread::sleep(Duration::from_millis(50)),
                _ => {
                    let _ = c.kill();
                    let _ = c.wait();
                    panic!("{} did not stop within 30 s of SIGTERM:\n{}", self.name, tail(&self.log, 40));
                }
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.sigkill();
        if std::thread::panicking() {
            eprintln!("----- {} ({}) -----\n{}", self.name, self.log.display(), tail(&self.log, 30));
        }
    }
}

/// The last `n` lines of a file.
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| format!("(cannot read {}: {e})", path.display()));
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A UDP port on 127.0.0.1 that was free a moment ago (for QUIC services restarted on the same
/// address, where the binary cannot be told port 0).
pub fn free_udp_port() -> u16 {
    fedfleet_testkit::daemon::free_port([127, 0, 0, 1].into()).expect("free UDP port")
}

/// A TCP port on 127.0.0.1 that was free a moment ago (metrics endpoints).
pub fn free_tcp_port() -> u16 {
    fedfleet_testkit::daemon::free_port([127, 0, 0, 1].into()).expect("free TCP port")
}

/// Polls `f` every 100 ms until it returns `Some`; panics after `timeout` with `what`.
pub fn wait_for<T>(what: &str, timeout: Duration, f: impl FnMut() -> Option<T>) -> T {
    poll_every(Duration::from_millis(100), what, timeout, f)
}

/// Polls `f` every `interval` until it returns `Some`; panics after `timeout` with `what`.
pub fn poll_every<T>(interval: Duration, what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(t0.elapsed() < timeout, "timed out after {timeout:?} waiting for {what}");
        std::thread::sleep(interval);
    }
}

/// `GET /metrics` of a service, with hyper (through `fedfleet_http::scrape`).
pub fn scrape(addr: SocketAddr) -> Option<String> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
    let (status, body) =
        rt.block_on(async { tokio::time::timeout(Duration::from_secs(5), fedfleet_http::scrape(addr, "/metrics")).await.ok()?.ok() })?;
    (status == 200).then_some(body)
}

/// Parses exposition text with a real Prometheus text-format parser (prometheus-parse); panics
/// on text it refuses, so every scrape in the tests also checks the format.
pub fn parse_metrics(text: &str) -> prometheus_parse::Scrape {
    prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))
        .unwrap_or_else(|e| panic!("metrics do not parse as Prometheus text: {e}\n{text}"))
}

/// The value of one sample, `name` or `name{label="value",...}`, in the parsed metrics.
pub fn sample(text: &str, selector: &str) -> Option<f64> {
    let (name, labels) = match selector.split_once('{') {
        Some((n, rest)) => (n, rest.trim_end_matches('}')),
        None => (selector, ""),
    };
    let wanted: Vec<(&str, &str)> =
        labels.split(',').filter(|l| !l.is_empty()).filter_map(|l| l.split_once('=')).map(|(k, v)| (k, v.trim_matches('"'))).collect();
    parse_metrics(text).samples.into_iter().find_map(|s| {
        let matches = s.metric == name && wanted.iter().all(|(k, v)| s.labels.get(k) == Some(*v));
        match (matches, s.value) {
            (true, prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Gauge(v) | prometheus_parse::Value::Untyped(v)) => {
                Some(v)
            }
            _ => None,
        }
    })
}

/// Lines of a log file that contain `needle`.
pub fn count_lines(path: &Path, needle: &str) -> usize {
    let Ok(f) = std::fs::File::open(path) else {
        return 0;
    };
    BufReader::new(f).lines().map_while(Result::ok).filter(|l| l.contains(needle)).count()
}

/// The tests' seeded generator for their "random points" (reproducible from the printed seed).
pub struct SeededRng(rand_chacha::ChaCha8Rng);

impl SeededRng {
    /// The seed from `FEDFLEET_TEST_SEED`, else from the clock; printed so a run can be repeated.
    pub fn from_env(test: &str) -> SeededRng {
        let seed = std::env::var("FEDFLEET_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
        });
        eprintln!("{test}: seed {seed} (rerun with FEDFLEET_TEST_SEED={seed})");
        SeededRng::new(seed)
    }

    pub fn new(seed: u64) -> SeededRng {
        SeededRng(rand::SeedableRng::seed_from_u64(seed))
    }

    pub fn next_u64(&mut self) -> u64 {
        rand::RngCore::next_u64(&mut self.0)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        rand::Rng::gen_range(&mut self.0, lo..=hi)
    }
}

/// What a [`Relay`] does to each datagram (each direction), in the manner of `tc netem`.
#[derive(Debug, Clone, Copy, Default)]
pub struct LinkFaults {
    /// Datagrams dropped, in percent.
    pub loss_pct: u64,
    /// Delay of each datagram: `delay_ms` ± `jitter_ms` (uniform), so later datagrams overtake.
    pub delay_ms: u64,
    pub jitter_ms: u64,
    /// Datagrams sent at once instead of delayed (overtaking those before them), in percent.
    pub reorder_pct: u64,
}

impl std::fmt::Display for LinkFaults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "loss {}% delay {}ms ± {}ms reorder {}%", self.loss_pct, self.delay_ms, self.jitter_ms, self.reorder_pct)
    }
}

/// Datagrams a relay holds back, sent when due by one thread.
struct Delayed {
    due: Instant,
    seq: u64,
    bytes: Vec<u8>,
    socket: std::sync::Arc<UdpSocket>,
    to: SocketAddr,
}

impl PartialEq for Delayed {
    fn eq(&self, o: &Self) -> bool {
        (self.due, self.seq) == (o.due, o.seq)
    }
}
impl Eq for Delayed {}
impl PartialOrd for Delayed {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Delayed {
    /// Reversed: the earliest is the greatest (the top of a `BinaryHeap`).
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (o.due, o.seq).cmp(&(self.due, self.seq))
    }
}

/// One direction's fault decisions: `None` drops the datagram, else its delay.
struct Impair {
    rng: SeededRng,
    faults: std::sync::Arc<std::sync::Mutex<LinkFaults>>,
}

impl Impair {
    fn decide(&mut self) -> Option<Duration> {
        let f = *self.faults.lock().unwrap_or_else(|p| p.into_inner());
        if f.loss_pct > 0 && self.rng.range(1, 100) <= f.loss_pct {
            return None;
        }
        if f.delay_ms == 0 || (f.reorder_pct > 0 && self.rng.range(1, 100) <= f.reorder_pct) {
            return Some(Duration::ZERO);
        }
        let lo = f.delay_ms.saturating_sub(f.jitter_ms);
        Some(Duration::from_millis(self.rng.range(lo, f.delay_ms + f.jitter_ms)))
    }
}

/// A UDP relay in front of one QUIC service, which the test can cut: while cut, datagrams in
/// both directions are dropped (a network partition, not a refusal), so a QUIC request in
/// flight neither completes nor fails until its idle timeout. It can also lose, delay and
/// reorder datagrams ([`Relay::set_faults`]).
pub struct Relay {
    pub addr: SocketAddr,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Client-to-service bytes still let through before the relay cuts itself (`i64::MAX`: no limit).
    budget: std::sync::Arc<std::sync::atomic::AtomicI64>,
    faults: std::sync::Arc<std::sync::Mutex<LinkFaults>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Relay {
    /// A relay on 127.0.0.1, without faults.
    pub fn start(upstream: SocketAddr) -> Relay {
        Relay::start_on([127, 0, 0, 1].into(), upstream, 0)
    }

    /// A relay listening on `front` (any free port), forwarding to `upstream` on loopback;
    /// `seed` seeds its fault decisions.
    pub fn start_on(front: std::net::IpAddr, upstream: SocketAddr, seed: u64) -> Relay {
        use std::collections::{BinaryHeap, HashMap};
        use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
        use std::sync::{Arc, Mutex, mpsc};
        let front = Arc::new(UdpSocket::bind((front, 0)).expect("relay socket"));
        front.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        let addr = front.local_addr().unwrap();
        let cut = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let budget = Arc::new(AtomicI64::new(i64::MAX));
        let faults = Arc::new(Mutex::new(LinkFaults::default()));

        // The delay line: datagrams with a delay wait here until due.
        let (delay_tx, delay_rx) = mpsc::channel::<Delayed>();
        let s = stop.clone();
        std::thread::spawn(move || {
            let mut heap: BinaryHeap<Delayed> = BinaryHeap::new();
            while !s.load(Ordering::Relaxed) {
                let now = Instant::now();
                while heap.peek().is_some_and(|d| d.due <= now) {
                    let d = heap.pop().unwrap();
                    let _ = d.socket.send_to(&d.bytes, d.to);
                }
                let wait = heap
                    .peek()
                    .map(|d| d.due.saturating_duration_since(now))
                    .unwrap_or(Duration::from_millis(100))
                    .min(Duration::from_millis(100));
                match delay_rx.recv_timeout(wait) {
                    Ok(d) => heap.push(d),
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                }
            }
        });
        let seq = Arc::new(std::sync::atomic::AtomicU64::new(0));
        // Sends `bytes` to `to` through `socket` now or after the delay the faults decide.
        let forward = {
            let (delay_tx, seq) = (Mutex::new(delay_tx), seq.clone());
            Arc::new(move |impair: &mut Impair, bytes: &[u8], socket: &Arc<UdpSocket>, to: SocketAddr| match impair.decide() {
                None => {}
                Some(d) if d.is_zero() => {
                    let _ = socket.send_to(bytes, to);
                }
                Some(d) => {
                    let _ = delay_tx.lock().unwrap_or_else(|p| p.into_inner()).send(Delayed {
                        due: Instant::now() + d,
                        seq: seq.fetch_add(1, Ordering::Relaxed),
                        bytes: bytes.to_vec(),
                        socket: socket.clone(),
                        to,
                    });
                }
            })
        };

        let (c, s, b, fl) = (cut.clone(), stop.clone(), budget.clone(), faults.clone());
        std::thread::spawn(move || {
            // One upstream socket per client address, with a thread carrying the answers back.
            let mut upstreams: HashMap<SocketAddr, Arc<UdpSocket>> = HashMap::new();
            let mut impair = Impair { rng: SeededRng::new(seed), faults: fl.clone() };
            let mut buf = vec![0u8; 65536];
            while !s.load(Ordering::Relaxed) {
                let Ok((n, client)) = front.recv_from(&mut buf) else {
                    continue;
                };
                if c.load(Ordering::Relaxed) {
                    continue;
                }
                if b.fetch_sub(n as i64, Ordering::Relaxed) < n as i64 {
                    c.store(true, Ordering::Relaxed);
                    continue;
                }
                let up = upstreams.entry(client).or_insert_with(|| {
                    let up = Arc::new(UdpSocket::bind("127.0.0.1:0").expect("relay upstream socket"));
                    up.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
                    let (up2, front2, c2, s2) = (up.clone(), front.clone(), c.clone(), s.clone());
                    let forward = forward.clone();
                    let mut impair =
                        Impair { rng: SeededRng::new(seed ^ (client.port() as u64).wrapping_mul(0x9E37_79B9)), faults: fl.clone() };
                    std::thread::spawn(move || {
                        let mut buf = vec![0u8; 65536];
                        while !s2.load(Ordering::Relaxed) {
                            let Ok((n, _)) = up2.recv_from(&mut buf) else {
                                continue;
                            };
                            if !c2.load(Ordering::Relaxed) {
                                forward(&mut impair, &buf[..n], &front2, client);
                            }
                        }
                    });
                    up
                });
                forward(&mut impair, &buf[..n], up, upstream);
            }
        });
        Relay { addr, cut, budget, faults, stop }
    }

    /// Loss, delay and reordering from now on, both directions (`LinkFaults::default()`: none).
    pub fn set_faults(&self, faults: LinkFaults) {
        *self.faults.lock().unwrap_or_else(|p| p.into_inner()) = faults;
    }

    /// Drops (true) or forwards (false, with no byte limit) every datagram from now on.
    pub fn set_cut(&self, cut: bool) {
        self.budget.store(i64::MAX, std::sync::atomic::Ordering::Relaxed);
        self.cut.store(cut, std::sync::atomic::Ordering::Relaxed);
    }

    /// Forwards `bytes` more from the client, then cuts itself.
    pub fn cut_after(&self, bytes: i64) {
        self.budget.store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn is_cut(&self) -> bool {
        self.cut.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

"""fedfleet's services vs Flower's deployment runtime, side by side, on loopback, in one
invocation. Run through deploy.sh (which makes the virtualenv); see README.md, section
"Deployment runtimes".

For every fleet size N (--nodes 10,50,100):
  1. `fl_digits --dump-partition` writes the task: the digits split, the Dirichlet(0.5)
     partition over N devices, the initial weights (seed 42).
  2. fedfleet: `fedfleet-certs` makes the fleet PKI (CA, registry/aggregator/operator, N
     devices), `fedfleet-registry serve`, `fedfleet-aggregator serve` (publishing every global
     model into the registry, embedded MQTT broker unless --fedfleet-no-mqtt) and N
     `fedfleet-agent run` processes, each with its partition as a CSV; the campaign is started
     with `fedfleet-aggregator campaign start`.
  3. Flower: a CA and a TLS server certificate, N SuperNode key pairs (EC P-384, OpenSSH),
     `flower-superlink` with TLS and `--enable-supernode-auth`, the N public keys registered
     through the Control API (what `flwr supernode register` does), N `flower-supernode`
     processes with `--root-certificates` and `--auth-supernode-private-key`, and `flwr run` of
     deploy_app/ (FedAvg ServerApp, numpy ClientApp).
  Both sides: same partition, initial weights, model, local training (plain SGD, lr, epochs,
  batch), rounds; at the start of round --kill-round device 0 (its whole process tree) is
  SIGKILLed and restarted --restart-delay seconds later with the same identity (and again
  --restart-delay s after any later exit, like a systemd unit with Restart=always).
Measured from outside: process trees' RSS and CPU time sampled from /proc, loopback bytes from
/proc/net/dev, round events from the aggregator's log and the ServerApp's event file.

Prints one table per N and writes `RESULT deploy ...` lines.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
PY = sys.executable
VENV_BIN = os.path.dirname(PY)
CLK = os.sysconf("SC_CLK_TCK")
PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024


# =============================================================================================
# /proc sampling
# =============================================================================================
def proc_table() -> dict[int, tuple[int, int, float, int]]:
    """pid -> (ppid, rss KiB, cpu seconds (utime+stime), starttime ticks)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                s = f.read().decode(errors="replace")
            rest = s[s.rindex(")") + 2 :].split()
            ppid = int(rest[1])
            cpu = (int(rest[11]) + int(rest[12])) / CLK
            start = int(rest[19])
            rss = int(rest[21]) * PAGE_KIB
            out[int(name)] = (ppid, rss, cpu, start)
        except (OSError, ValueError, IndexError):
            continue
    return out


def tree(table: dict, roots: list[int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_rest) in table.items():
        children.setdefault(ppid, []).append(pid)
    seen, stack = set(), [r for r in roots if r in table]
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        stack.extend(children.get(p, ()))
    return seen


def lo_bytes() -> int:
    """Bytes received on the loopback interface (each loopback packet counts once)."""
    with open("/proc/net/dev") as f:
        for line in f:
            if line.strip().startswith("lo:"):
                return int(line.split(":", 1)[1].split()[0])
    return 0


def mem_available_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    return 0


def check_memory(args, what: str) -> None:
    """Stops a side before the machine runs out of memory (the OOM killer would pick any
    process, other work on the machine included)."""
    avail = mem_available_kib() / 1024
    if avail < args.min_free_mib:
        raise RuntimeError(f"{what}: MemAvailable fell to {avail:.0f} MiB (< --min-free-mib {args.min_free_mib}); stopped")


def vm_hwm_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def pss_kib(pid: int) -> int:
    """Proportional set size: shared pages (the Python interpreter, numpy, ...) divided among
    the processes that map them, so a sum over processes is the memory they really take."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Sampler:
    """Every `period` s: RSS of each group's process trees (sum), the maximum over samples
    (every 4th sample also the PSS sums, per group and over all groups together);
    CPU seconds of each group (sum over every process ever seen in the group's trees of its
    last utime+stime, so exited children still count up to their last sample); a timeline of
    (t, server cpu, loopback bytes)."""

    def __init__(self, period: float) -> None:
        self.period = period
        self.groups: dict[str, list[int]] = {}  # name -> root pids (mutable: restarts)
        self.peak: dict[str, int] = {}
        self.peak_pss: dict[str, int] = {}
        self.peak_pss_total = 0
        self.n_samples = 0
        self.cpu_seen: dict[str, dict[tuple[int, int], float]] = {}
        self.timeline: list[tuple[float, float, int]] = []
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def set_roots(self, group: str, roots: list[int]) -> None:
        with self.lock:
            self.groups[group] = list(roots)
            self.peak.setdefault(group, 0)
            self.cpu_seen.setdefault(group, {})

    def group_cpu(self, group: str) -> float:
        with self.lock:
            return sum(self.cpu_seen.get(group, {}).values())

    def sample(self) -> None:
        table = proc_table()
        with_pss = self.n_samples % 4 == 0
        self.n_samples += 1
        total_pss = 0
        with self.lock:
            for g, roots in self.groups.items():
                pids = tree(table, roots)
                rss = sum(table[p][1] for p in pids)
                self.peak[g] = max(self.peak.get(g, 0), rss)
                if with_pss:
                    pss = sum(pss_kib(p) for p in pids)
                    self.peak_pss[g] = max(self.peak_pss.get(g, 0), pss)
                    total_pss += pss
                seen = self.cpu_seen[g]
                for p in pids:
                    seen[(p, table[p][3])] = table[p][2]
            self.peak_pss_total = max(self.peak_pss_total, total_pss)
            scpu = sum(self.cpu_seen.get("server", {}).values())
        self.timeline.append((time.time(), scpu, lo_bytes()))

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.time()
            self.sample()
            self._stop.wait(max(0.0, self.period - (time.time() - t)))

    def start(self) -> "Sampler":
        self._t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._t.join()
        self.sample()

    def at(self, t: float) -> tuple[float, int]:
        """(server cpu, loopback bytes) of the sample nearest to wall time t."""
        best = min(self.timeline, key=lambda x: abs(x[0] - t))
        return best[1], best[2]


# =============================================================================================
# helpers
# =============================================================================================
def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port(kind=socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(k: int) -> list[int]:
    """k distinct ports free for both TCP and UDP right now."""
    out: set[int] = set()
    while len(out) < k:
        p = free_port()
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                u.bind(("127.0.0.1", p))
        except OSError:
            continue
        out.add(p)
    return sorted(out)


def wait_tcp(port: int, timeout: float, proc: subprocess.Popen | None = None, what: str = "") -> None:
    t = time.time()
    while time.time() - t < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what}: port {port} not open after {timeout} s")


def http_get(port: int, path: str = "/metrics", timeout: float = 2.0) -> str | None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode())
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        return body.decode(errors="replace") if b" 200 " in head.split(b"\r\n")[0] else None
    except OSError:
        return None


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{}"):
            try:
                return float(line.split()[-1])
            except ValueError:
                return None
    return None


def spawn(cmd: list[str], logpath: str, env: dict | None = None, cwd: str | None = None,
          nice: int = 0) -> subprocess.Popen:
    f = open(logpath, "ab")
    return subprocess.Popen(
        cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True,
        preexec_fn=(lambda: os.nice(nice)) if nice else None,
    )


def kill_tree(p: subprocess.Popen | None, sig=signal.SIGKILL) -> None:
    """Signals the process and everything below it (own session, so also its process group)."""
    if p is None:
        return
    pids = tree(proc_table(), [p.pid])
    try:
        os.killpg(p.pid, sig)
    except OSError:
        pass
    for q in pids:
        try:
            os.kill(q, sig)
        except OSError:
            pass


def stop_all(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    for p in procs:
        kill_tree(p, signal.SIGTERM)
    t = time.time()
    for p in procs:
        try:
            p.wait(timeout=max(0.1, grace - (time.time() - t)))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        kill_tree(p, signal.SIGKILL)
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def run_cli(cmd: list[str], cwd: str, env: dict | None = None, timeout: float = 120) -> str:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {p.returncode}: {p.stderr.strip()[-800:] or p.stdout.strip()[-800:]}")
    return p.stdout


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class KillRestart:
    """Device 0's fate: SIGKILLed (its whole process tree) at the start of round --kill-round,
    started again --restart-delay s later with the same identity, and, like a systemd unit with
    Restart=always and RestartSec=<delay>, started again <delay> s after every later exit
    (a restarted Flower SuperNode exits, status 1, Flower exit code 305 "Failed to activate
    SuperNode", while the SuperLink still counts the killed node as online, i.e. until its
    heartbeat lapses: 2 x 30 s after the last one)."""

    def __init__(self, delay: float, start, label: str) -> None:
        self.delay, self.start, self.label = delay, start, label
        self.killed_at: float | None = None
        self.down_since: float | None = None
        self.starts: list[float] = []
        self.exits: list[int] = []

    def kill(self, p: subprocess.Popen) -> None:
        kill_tree(p, signal.SIGKILL)
        p.wait()
        self.killed_at = self.down_since = time.time()
        log(f"{self.label}: SIGKILLed device 0 and its children")

    def tick(self, p: subprocess.Popen) -> subprocess.Popen:
        if self.killed_at is None:
            return p
        now = time.time()
        if self.down_since is None and p.poll() is not None:
            self.exits.append(p.returncode)
            kill_tree(p, signal.SIGKILL)  # what it left behind (its process group)
            self.down_since = now
            log(f"{self.label}: restarted device 0 exited with {p.returncode}")
        if self.down_since is not None and now - self.down_since >= self.delay:
            self.down_since = None
            self.starts.append(now)
            log(f"{self.label}: started device 0 again (start {len(self.starts)})")
            return self.start()
        return p


def digits_rows() -> list[list[str]]:
    import gzip

    with gzip.open(os.path.join(REPO, "learning", "data", "digits.csv.gz"), "rt") as f:
        return [line.strip().split(",") for line in f if line.strip()]


# =============================================================================================
# the task
# =============================================================================================
def make_task(bin_dir: str, n: int, seed: int, alpha: float, path: str) -> dict:
    exe = os.path.join(bin_dir, "examples", "fl_digits")
    if not os.path.exists(exe):
        raise SystemExit(f"{exe} is missing: build it with `cargo build --release -p fedfleet-learning --example fl_digits`")
    if os.path.exists(path):
        os.remove(path)
    # One round: only the dump is used (the in-process simulation is benches/flower/run.sh's).
    run_cli([exe, "--clients", str(n), "--alpha", str(alpha), "--rounds", "1", "--seed", str(seed),
             "--dump-partition", path], cwd=REPO, timeout=600)
    with open(path) as f:
        return json.load(f)


# =============================================================================================
# results of one side at one N
# =============================================================================================
class Side:
    def __init__(self, name: str) -> None:
        self.name = name
        self.t_spawn = None  # first server process spawned (wall clock)
        self.setup_excluded = 0.0  # provisioning inside the start window (Flower: node registration)
        self.round_start: dict[int, float] = {}
        self.round_end: dict[int, float] = {}
        self.accuracy: dict[int, float] = {}
        self.contrib: dict[int, set[int]] = {}  # round -> device indices whose update counted
        self.payload_bytes: float | None = None
        self.server_peak_kib = 0
        self.device_peaks_kib: list[int] = []
        self.server_peak_pss_kib = 0
        self.device_peaks_pss_kib: list[int] = []
        self.total_peak_pss_kib = 0
        self.server_cpu_per_round: float | None = None
        self.lo_bytes_per_device_round: float | None = None
        self.kill_note = ""
        self.kill: dict = {}
        self.error: str | None = None
        self.notes: list[str] = []

    def round_times(self, skip: set[int]) -> list[float]:
        return [self.round_end[r] - self.round_start[r] for r in sorted(self.round_end)
                if r in self.round_start and r not in skip]


def finish_measurements(side: Side, sampler: Sampler, groups_dev: list[str], rounds: int, n: int) -> None:
    side.server_peak_kib = sampler.peak.get("server", 0)
    side.device_peaks_kib = [sampler.peak.get(g, 0) for g in groups_dev]
    side.server_peak_pss_kib = sampler.peak_pss.get("server", 0)
    side.device_peaks_pss_kib = [sampler.peak_pss.get(g, 0) for g in groups_dev]
    side.total_peak_pss_kib = sampler.peak_pss_total
    if 1 in side.round_start and rounds in side.round_end:
        c0, b0 = sampler.at(side.round_start[1])
        c1, b1 = sampler.at(side.round_end[rounds])
        side.server_cpu_per_round = (c1 - c0) / rounds
        side.lo_bytes_per_device_round = (b1 - b0) / (rounds * n)


def judge_kill(side: Side, k: int, rounds: int, killed: int, kr: "KillRestart") -> None:
    """Did round k complete, with whom; did the killed device contribute again later, when."""
    d = side.kill
    d["round_completed"] = k in side.round_end
    d["round_updates"] = len(side.contrib.get(k, ()))
    d["killed_in_round"] = killed in side.contrib.get(k, set())
    later = [r for r in range(k + 1, rounds + 1) if killed in side.contrib.get(r, set())]
    d["rejoined_round"] = later[0] if later else None
    if later and later[0] in side.round_end and kr.killed_at:
        d["rejoined_after_s"] = side.round_end[later[0]] - kr.killed_at
    if k in side.round_end and k in side.round_start:
        d["round_seconds"] = side.round_end[k] - side.round_start[k]
    d["killed_at"] = kr.killed_at
    d["starts"] = len(kr.starts)
    d["exits_after_restart"] = kr.exits


# =============================================================================================
# fedfleet
# =============================================================================================
ANSI = re.compile(r"\x1b\[[0-9;]*m")
TS = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)Z")
KVS = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def parse_ts(s: str) -> float | None:
    m = TS.match(s)
    if not m:
        return None
    base, _, frac = m.group(1).partition(".")
    t = dt.datetime.strptime(base, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=dt.timezone.utc).timestamp()
    return t + (float("0." + frac) if frac else 0.0)


def write_csv_partition(rows: list[list[str]], train_idx: list[int], part: list[int], path: str) -> None:
    with open(path, "w") as f:
        for i in part:
            f.write(",".join(rows[train_idx[i]]) + "\n")


def write_safetensors_check(path: str, task: dict) -> str:
    """Compares the aggregator's initial model (init-model --seed S) with the dump's init."""
    import numpy as np

    with open(path, "rb") as f:
        data = f.read()
    hlen = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + hlen])
    body = data[8 + hlen :]
    worst = 0.0
    for name in task["param_order"]:
        h = header.get(name)
        if h is None or h["dtype"] != "F32":
            return f"initial model: tensor {name} missing or not F32"
        a, b = h["data_offsets"]
        got = np.frombuffer(body[a:b], dtype="<f4")
        want = np.array(task["init"][name]["values"], dtype=np.float32)
        if got.shape != want.shape:
            return f"initial model: {name} has {got.shape}, dump {want.shape}"
        worst = max(worst, float(np.abs(got - want).max()))
    return "" if worst == 0.0 else f"initial model differs from the dump's init by up to {worst}"


def run_fedfleet(args, n: int, task: dict, work: str) -> Side:
    side = Side("fedfleet")
    bins = args.bin_dir
    exe = lambda name: os.path.join(bins, name)  # noqa: E731
    for b in ("fedfleet-certs", "fedfleet-registry", "fedfleet-aggregator", "fedfleet-agent"):
        if not os.path.exists(exe(b)):
            side.error = f"{exe(b)} missing (build: see README)"
            return side
    shutil.rmtree(work, ignore_errors=True)
    for d in ("logs", "agents", "data"):
        os.makedirs(os.path.join(work, d))
    env = dict(os.environ, NO_COLOR="1", RUST_LOG=os.environ.get("FEDFLEET_BENCH_LOG", "info"))
    devices = [f"dev-{i:03d}" for i in range(n)]
    fleet = "bench"

    # ---- provisioning (offline, before any service starts; not timed) ----
    log(f"fedfleet N={n}: PKI, configs, partitions")
    certs = lambda *a: run_cli([exe("fedfleet-certs"), "--dir", "pki", *a], cwd=work)  # noqa: E731
    certs("init", "--fleet", fleet)
    for name in ("registry", "aggregator", "operator"):
        certs("issue-server", "--name", name, "--san", "localhost", "--san", "127.0.0.1")
    for d in devices:
        certs("enroll-device", "--id", d)
    reg_port, agg_port, mqtt_port, reg_m, agg_m = free_ports(5)
    w = work
    with open(os.path.join(w, "registry.toml"), "w") as f:
        f.write(
            f'listen = "127.0.0.1:{reg_port}"\ndata_dir = "{w}/registry"\npki_dir = "{w}/pki"\n'
            f'metrics = "127.0.0.1:{reg_m}"\noperators = ["operator", "aggregator"]\n'
        )
    run_cli([exe("fedfleet-registry"), "--config", "registry.toml", "init-keys"], cwd=w)
    rounds, k = args.rounds, args.kill_round
    quorum = max(1, math.ceil(n / 2))
    mqtt = "" if args.fedfleet_no_mqtt else f'[mqtt]\nmode = "embedded"\nlisten = "127.0.0.1:{mqtt_port}"\n'
    with open(os.path.join(w, "aggregator.toml"), "w") as f:
        f.write(
            f'listen = "127.0.0.1:{agg_port}"\npki_dir = "{w}/pki"\nserver_name = "aggregator"\n'
            f'data_dir = "{w}/aggregator"\nmetrics_addr = "127.0.0.1:{agg_m}"\noperators = ["operator"]\n'
            f'[publish]\nregistry = "127.0.0.1:{reg_port}"\nserver_name = "localhost"\n'
            f'[model]\nname = "digits"\nspec = {{ arch = "mlp", input = [64], hidden = [64], classes = 10 }}\n'
            f'initial = "{w}/initial.safetensors"\nvalidation = "digits"\n'
            f"[campaign]\nrounds = {rounds}\nstrategy = \"fedavg\"\ntarget = {n}\nquorum = {quorum}\n"
            f"deadline_secs = {int(args.round_timeout)}\nextension_secs = 0\nsampling_rate = 1.0\n"
            f"local_epochs = {args.epochs}\nbatch_size = {args.batch}\nlr = {args.lr}\nmu = 0.0\n"
            f'quantization = "f32"\n'
            + mqtt
        )
    run_cli([exe("fedfleet-aggregator"), "init-model", "--config", "aggregator.toml", "--seed", str(args.seed)], cwd=w)
    mismatch = write_safetensors_check(os.path.join(w, "initial.safetensors"), task)
    if mismatch:
        side.notes.append(mismatch)
    rows = digits_rows()
    train_idx = task["split"]["train"]
    for i, d in enumerate(devices):
        state = os.path.join(w, "agents", d)
        csv = os.path.join(w, "data", f"{d}.csv")
        write_csv_partition(rows, train_idx, task["partition"][i], csv)
        run_cli([exe("fedfleet-agent"), "enroll", "--cert", f"{w}/pki/devices/{d}.crt", "--key",
                 f"{w}/pki/devices/{d}.key", "--ca", f"{w}/pki/ca.crt", "--root", f"{w}/registry/root.json",
                 "--state-dir", state], cwd=w)
        agent_mqtt = "" if args.fedfleet_no_mqtt else (
            f'[mqtt]\nhost = "127.0.0.1"\nport = {mqtt_port}\nupload = "quic"\nheartbeat_interval_ms = 0\n'
        )
        with open(os.path.join(w, "agents", f"{d}.toml"), "w") as f:
            f.write(
                f'fleet = "{fleet}"\nstate_dir = "{state}"\npoll_interval_ms = {args.poll_ms}\n'
                f'[data]\ncsv = "{csv}"\ncsv_scale = 0.0625\nholdout_fraction = 0.0\n'
                f"[participation]\nrequire_idle = false\n"
                f"[health]\nmax_latency_ms = 10000.0\n[backoff]\nbase_ms = 500\nmax_ms = 5000\n"
                f'[aggregator]\naddr = "127.0.0.1:{agg_port}"\nserver_name = "localhost"\n'
                f'receipt_key = "{w}/aggregator/receipt.pub"\n'
                f'[registry]\naddr = "127.0.0.1:{reg_port}"\nserver_name = "localhost"\nmodel = "digits"\n'
                + agent_mqtt
            )

    # ---- the measured run ----
    sampler = Sampler(args.sample_period).start()
    procs: list[subprocess.Popen] = []
    agents: list[subprocess.Popen | None] = [None] * n
    logs = os.path.join(w, "logs")

    def start_agent(i: int) -> subprocess.Popen:
        p = spawn([exe("fedfleet-agent"), "run", "--config", os.path.join(w, "agents", f"{devices[i]}.toml")],
                  os.path.join(logs, f"{devices[i]}.log"), env=env, cwd=w)
        sampler.set_roots(f"dev{i}", [p.pid])
        return p

    try:
        side.t_spawn = time.time()
        reg = spawn([exe("fedfleet-registry"), "--config", "registry.toml", "serve"], os.path.join(logs, "registry.log"), env=env, cwd=w)
        procs.append(reg)
        sampler.set_roots("server", [reg.pid])
        wait_tcp(reg_m, 60, reg, "fedfleet-registry")
        agg = spawn([exe("fedfleet-aggregator"), "serve", "--config", "aggregator.toml"], os.path.join(logs, "aggregator.log"), env=env, cwd=w)
        procs.append(agg)
        sampler.set_roots("server", [reg.pid, agg.pid])
        wait_tcp(agg_m, 60, agg, "fedfleet-aggregator")
        for i in range(n):
            check_memory(args, f"fedfleet N={n}")
            agents[i] = start_agent(i)
        run_cli([exe("fedfleet-aggregator"), "campaign", "start", "--config", "aggregator.toml", "--seed", str(args.seed)], cwd=w, env=env)
        log(f"fedfleet N={n}: services and {n} agents started, campaign started")

        # Follow the aggregator's log.
        agg_log = os.path.join(logs, "aggregator.log")
        pos, buf = 0, ""
        deadline = time.time() + args.campaign_timeout
        kr = KillRestart(args.restart_delay, lambda: start_agent(0), f"fedfleet N={n}")
        done = False
        dev_index = {d: i for i, d in enumerate(devices)}
        while time.time() < deadline and not done:
            check_memory(args, f"fedfleet N={n}")
            if agg.poll() is not None:
                raise RuntimeError(f"fedfleet-aggregator exited {agg.returncode}")
            with open(agg_log, "rb") as f:
                f.seek(pos)
                chunk = f.read()
                pos += len(chunk)
            buf += chunk.decode(errors="replace")
            lines = buf.split("\n")
            buf = lines.pop()
            for raw in lines:
                line = ANSI.sub("", raw)
                t = parse_ts(line)
                kv = dict(KVS.findall(line))
                if t is None:
                    continue
                if "round opened" in line and "round" in kv:
                    r = int(kv["round"])
                    side.round_start.setdefault(r, t)
                elif "update accepted" in line and "round" in kv and "device" in kv:
                    side.contrib.setdefault(int(kv["round"]), set()).add(dev_index.get(kv["device"].strip('"'), -1))
                elif "global model published" in line and "round" in kv:
                    r = int(kv["round"])
                    side.round_end[r] = t
                    m = re.search(r'"accuracy"[,:] ([0-9.eE+-]+)', line)  # Debug of a map or of (name, value) pairs
                    if m:
                        side.accuracy[r] = float(m.group(1))
                elif "campaign finished" in line:
                    done = True
            if k and kr.killed_at is None and k in side.round_start:
                kr.kill(agents[0])
            agents[0] = kr.tick(agents[0])
            time.sleep(0.02)
        if not done:
            side.error = f"campaign did not finish within {args.campaign_timeout} s ({len(side.round_end)} rounds done)"
        text = http_get(agg_m) or ""
        acc = metric(text, "fedfleet_aggregator_updates_accepted_total")
        byt = metric(text, "fedfleet_aggregator_update_bytes_total")
        if acc and byt:
            side.payload_bytes = byt / acc
        sampler.stop()
        finish_measurements(side, sampler, [f"dev{i}" for i in range(n)], rounds, n)
        if k:
            judge_kill(side, k, rounds, 0, kr)
        side.notes.append(
            f"server = fedfleet-registry VmHWM {vm_hwm_kib(reg.pid) / 1024:.1f} MiB + fedfleet-aggregator VmHWM "
            f"{vm_hwm_kib(agg.pid) / 1024:.1f} MiB (the table's figure is the sampled sum of both)"
        )
    except Exception as e:  # noqa: BLE001
        side.error = f"{type(e).__name__}: {e}"
        sampler.stop()
        finish_measurements(side, sampler, [f"dev{i}" for i in range(n)], rounds, n)  # peaks so far
    finally:
        stop_all([a for a in agents if a] + procs[::-1])
    return side


# =============================================================================================
# Flower
# =============================================================================================
def flower_credentials(work: str, n: int) -> None:
    """TLS: a CA and a server certificate for 127.0.0.1/localhost. Node auth: one EC P-384 key
    pair per SuperNode in OpenSSH format (what Flower's generate_auth_keys.sh makes)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.timezone.utc)
    cdir = os.path.join(work, "certificates")
    kdir = os.path.join(work, "keys")
    os.makedirs(cdir)
    os.makedirs(kdir)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench-flower-ca")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    srv_key = ec.generate_private_key(ec.SECP256R1())
    srv = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name).public_key(srv_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    with open(os.path.join(cdir, "ca.crt"), "wb") as f:
        f.write(ca.public_bytes(pem))
    with open(os.path.join(cdir, "server.pem"), "wb") as f:
        f.write(srv.public_bytes(pem))
    with open(os.path.join(cdir, "server.key"), "wb") as f:
        f.write(srv_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    for i in range(n):
        k = ec.generate_private_key(ec.SECP384R1())
        with open(os.path.join(kdir, f"node_{i}"), "wb") as f:
            f.write(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                    serialization.NoEncryption()))
        with open(os.path.join(kdir, f"node_{i}.pub"), "wb") as f:
            f.write(k.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))


def cmd_register(a: argparse.Namespace) -> None:
    """Internal: registers the public keys with the running SuperLink's Control API, in one
    process (what `flwr supernode register KEY <superlink>` does once per key)."""
    from pathlib import Path

    from flwr.cli.flower_config import read_superlink_connection
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.cli.utils import init_http_client_from_connection
    from flwr.proto.control_pb2 import RegisterNodeRequest  # pylint: disable=E0611

    conn = read_superlink_connection(a.superlink)
    client = init_http_client_from_connection(conn)
    try:
        for path in a.keys:
            res = client.RegisterNode(request=RegisterNodeRequest(public_key=try_load_public_key(Path(path))))
            if not res.node_id:
                raise SystemExit(f"{path}: not registered")
            print(f"REGISTERED {path} {res.node_id}", flush=True)
    finally:
        client.close()


def run_flower(args, n: int, task_path: str, work: str) -> Side:
    side = Side("flower")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.join(work, "logs"))
    logs = os.path.join(work, "logs")
    flwr_home = os.path.join(work, "flwr-home")
    os.makedirs(flwr_home)
    log(f"flower N={n}: certificates and node keys")
    flower_credentials(work, n)
    port = free_ports(1)[0]
    rt_ports = free_ports(n)
    ca = os.path.join(work, "certificates", "ca.crt")
    with open(os.path.join(flwr_home, "config.toml"), "w") as f:
        f.write(f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\naddress = "127.0.0.1:{port}"\n'
                f'root-certificates = "{ca}"\n')
    env = dict(os.environ, FLWR_HOME=flwr_home, FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1",
               FEDFLEET_BENCH_DIR=HERE, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1")
    env["PATH"] = VENV_BIN + os.pathsep + env.get("PATH", "")
    events = os.path.join(work, "events.jsonl")
    rounds, k = args.rounds, args.kill_round
    sampler = Sampler(args.sample_period).start()
    procs: list[subprocess.Popen] = []
    nodes: list[subprocess.Popen | None] = [None] * n
    bin_ = lambda name: os.path.join(VENV_BIN, name)  # noqa: E731

    def start_node(i: int) -> subprocess.Popen:
        p = spawn([bin_("flower-supernode"), "--root-certificates", ca, "--superlink", f"127.0.0.1:{port}",
                   "--auth-supernode-private-key", os.path.join(work, "keys", f"node_{i}"),
                   "--node-config", f"partition-id={i} num-partitions={n}",
                   "--host", "127.0.0.1", "--port", str(rt_ports[i])],
                  os.path.join(logs, f"supernode-{i:03d}.log"), env=env, cwd=work, nice=args.flower_nice)
        sampler.set_roots(f"dev{i}", [p.pid])
        return p

    try:
        side.t_spawn = time.time()
        sl = spawn([bin_("flower-superlink"), "--ssl-ca-certfile", ca,
                    "--ssl-certfile", os.path.join(work, "certificates", "server.pem"),
                    "--ssl-keyfile", os.path.join(work, "certificates", "server.key"),
                    "--enable-supernode-auth", "--disable-runtime-dependency-installation",
                    "--host", "127.0.0.1", "--port", str(port)],
                   os.path.join(logs, "superlink.log"), env=env, cwd=work, nice=args.flower_nice)
        procs.append(sl)
        sampler.set_roots("server", [sl.pid])
        wait_tcp(port, 120, sl, "flower-superlink")
        # Registration of the N public keys (an operator step fedfleet does offline with
        # fedfleet-certs before any service starts): timed and excluded from time-to-first-round.
        t_reg = time.time()
        run_cli([PY, os.path.abspath(__file__), "register", "--superlink", "bench", "--keys",
                 *[os.path.join(work, "keys", f"node_{i}.pub") for i in range(n)]], cwd=work, env=env, timeout=600)
        side.setup_excluded = time.time() - t_reg
        for i in range(n):
            check_memory(args, f"flower N={n}")
            nodes[i] = start_node(i)
        rc = {
            "bench-dir": HERE, "dump": task_path, "events": events, "num-server-rounds": rounds,
            "num-nodes": n, "lr": args.lr, "momentum": 0.0, "local-epochs": args.epochs,
            "batch-size": args.batch, "seed": args.seed, "round-timeout": float(args.round_timeout),
        }
        rc_path = os.path.join(work, "run-config.toml")
        with open(rc_path, "w") as f:
            for kk, v in rc.items():
                f.write(f"{kk} = {json.dumps(v)}\n")
        out = run_cli([bin_("flwr"), "run", os.path.join(HERE, "deploy_app"), "bench", "--run-config", rc_path,
                       "--format", "json"], cwd=work, env=env, timeout=300)
        side.notes.append(f"flwr run: {' '.join(out.split())[:200]}")
        log(f"flower N={n}: SuperLink and {n} SuperNodes started, run submitted")

        pos = 0
        deadline = time.time() + args.campaign_timeout
        kr = KillRestart(args.restart_delay, lambda: start_node(0), f"flower N={n}")
        done = False
        while time.time() < deadline and not done:
            check_memory(args, f"flower N={n}")
            if sl.poll() is not None:
                raise RuntimeError(f"flower-superlink exited {sl.returncode}")
            if os.path.exists(events):
                with open(events) as f:
                    f.seek(pos)
                    chunk = f.read()
                    pos += len(chunk)
                for line in chunk.splitlines():
                    ev = json.loads(line)
                    r = ev.get("round")
                    if ev["ev"] == "round_start":
                        side.round_start.setdefault(r, ev["t"])
                    elif ev["ev"] == "replies":
                        side.contrib[r] = set(ev["partitions"])
                        if ev.get("payload_bytes"):
                            side.payload_bytes = ev["payload_bytes"][0]
                        if ev.get("errors"):
                            side.notes.append(f"round {r}: {ev['errors']} error replies, {ev['ok']} updates")
                    elif ev["ev"] == "round_end" and r and r > 0:
                        side.round_end[r] = ev["t"]
                        side.accuracy[r] = ev["accuracy"]
                    elif ev["ev"] == "serverapp_done":
                        done = True
            if k and kr.killed_at is None and k in side.round_start:
                kr.kill(nodes[0])
            nodes[0] = kr.tick(nodes[0])
            time.sleep(0.05)
        if not done:
            side.error = f"run did not finish within {args.campaign_timeout} s ({len(side.round_end)} rounds done)"
        sampler.stop()
        finish_measurements(side, sampler, [f"dev{i}" for i in range(n)], rounds, n)
        if k:
            judge_kill(side, k, rounds, 0, kr)
    except Exception as e:  # noqa: BLE001
        side.error = f"{type(e).__name__}: {e}"
        sampler.stop()
        finish_measurements(side, sampler, [f"dev{i}" for i in range(n)], rounds, n)  # peaks so far
    finally:
        stop_all([x for x in nodes if x] + procs)
    return side


# =============================================================================================
# the table
# =============================================================================================
def fmt(v, d=3) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.{d}f}"


def ratio(a, b) -> str:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not a:
        return "n/a"
    return f"{b / a:.2f}x"


def kill_text(s: Side, k: int, rounds: int) -> str:
    d = s.kill
    if not d:
        return "n/a"
    parts = []
    if d.get("round_completed"):
        parts.append(f"round {k} completed in {d.get('round_seconds', 0):.1f} s with {d['round_updates']} updates"
                     + (" (incl. device 0's)" if d.get("killed_in_round") else ""))
    else:
        parts.append(f"round {k} did not complete")
    if d.get("rejoined_round"):
        after = f", {d['rejoined_after_s']:.0f} s after the kill" if d.get("rejoined_after_s") is not None else ""
        parts.append(f"device 0 rejoined: its update counted again in round {d['rejoined_round']}{after}")
    elif d.get("killed_in_round"):
        parts.append("device 0 rejoined within the same round")
    else:
        parts.append("device 0 did not rejoin")
    starts = d.get("starts", 0)
    ex = d.get("exits_after_restart") or []
    if starts > 1 or ex:
        parts.append(f"{starts} starts needed ({len(ex)} exited: codes {', '.join(map(str, ex))})")
    return "; ".join(parts)


def rows_for(n: int, ff: Side, fl: Side, args) -> list[tuple[str, object, object, str]]:
    k, R = args.kill_round, args.rounds
    skip = {k} if k else set()
    rows = []
    rows.append(("final accuracy (digits test split)", ff.accuracy.get(R), fl.accuracy.get(R), ""))
    ta, tb = ff.round_times(skip), fl.round_times(skip)
    rows.append(("round wall time mean, s", statistics.mean(ta) if ta else None,
                 statistics.mean(tb) if tb else None, ""))
    rows.append(("round wall time p95, s", pct(ta, 0.95), pct(tb, 0.95), ""))
    rows.append(("server peak RSS, MiB", ff.server_peak_kib / 1024 or None, fl.server_peak_kib / 1024 or None, ""))
    da, db = ff.device_peaks_kib, fl.device_peaks_kib
    rows.append(("per-device peak RSS mean, MiB", statistics.mean(da) / 1024 if da and any(da) else None,
                 statistics.mean(db) / 1024 if db and any(db) else None, ""))
    rows.append(("per-device peak RSS max, MiB", max(da) / 1024 if da and any(da) else None,
                 max(db) / 1024 if db and any(db) else None, ""))
    mib = lambda k: k / 1024 if k else None  # noqa: E731
    rows.append(("server peak PSS, MiB", mib(ff.server_peak_pss_kib), mib(fl.server_peak_pss_kib), ""))
    pa, pb = ff.device_peaks_pss_kib, fl.device_peaks_pss_kib
    rows.append(("per-device peak PSS mean, MiB", statistics.mean(pa) / 1024 if pa and any(pa) else None,
                 statistics.mean(pb) / 1024 if pb and any(pb) else None, ""))
    rows.append(("whole deployment peak PSS, MiB", mib(ff.total_peak_pss_kib), mib(fl.total_peak_pss_kib), ""))
    rows.append(("server CPU s per round", ff.server_cpu_per_round, fl.server_cpu_per_round, ""))
    rows.append(("update payload bytes", ff.payload_bytes, fl.payload_bytes, ""))
    rows.append(("loopback bytes per device per round", ff.lo_bytes_per_device_round, fl.lo_bytes_per_device_round, ""))
    t1a = (ff.round_end[1] - ff.t_spawn - ff.setup_excluded) if 1 in ff.round_end and ff.t_spawn else None
    t1b = (fl.round_end[1] - fl.t_spawn - fl.setup_excluded) if 1 in fl.round_end and fl.t_spawn else None
    rows.append(("process start -> round 1 done, s", t1a, t1b, ""))
    if k:
        rows.append((f"device 0 SIGKILLed at round {k} start, restarted after {args.restart_delay:g} s",
                     kill_text(ff, k, R), kill_text(fl, k, R), "text"))
    return rows


def print_table(title: str, rows) -> list[str]:
    out = [title, "", "| metric | fedfleet | Flower | ratio (Flower / fedfleet) |", "|---|---|---|---|"]
    for name, a, b, kind in rows:
        out.append(f"| {name} | {fmt(a)} | {fmt(b)} | {'' if kind == 'text' else ratio(a, b)} |")
    print("\n".join(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    r = sub.add_parser("register")
    r.add_argument("--superlink", required=True)
    r.add_argument("--keys", nargs="+", required=True)
    ap.add_argument("--nodes", default="10,50,100", help="fleet sizes N, comma-separated")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--kill-round", type=int, default=None, help="round at whose start device 0 is killed (default rounds/2; 0: never)")
    ap.add_argument("--restart-delay", type=float, default=5.0)
    ap.add_argument("--lr", type=float, default=0.3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--round-timeout", type=float, default=60.0,
                    help="fedfleet round deadline / Flower per-round reply timeout, s")
    ap.add_argument("--campaign-timeout", type=float, default=1800.0)
    ap.add_argument("--poll-ms", type=int, default=3000, help="fedfleet agents' poll interval (Flower's SuperNode: 3 s when idle)")
    ap.add_argument("--fedfleet-no-mqtt", action="store_true", help="agents learn rounds by QUIC polling only")
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "target", "release"),
                    help="fedfleet binaries (fedfleet-*, examples/fl_digits)")
    ap.add_argument("--skip-fedfleet", action="store_true")
    ap.add_argument("--skip-flower", action="store_true")
    ap.add_argument("--flower-max-nodes", type=int, default=0, help="skip the Flower side above this N (0: no limit)")
    ap.add_argument("--flower-nice", type=int, default=0, help="nice increment for Flower processes")
    ap.add_argument("--min-free-mib", type=int, default=1536,
                    help="stop a side when MemAvailable falls below this (protects the machine)")
    ap.add_argument("--mem-fraction", type=float, default=0.7,
                    help="skip a side at N when its estimated memory (per-device peak x N + server, from the "
                         "previous N, or a first guess) exceeds this fraction of MemAvailable")
    ap.add_argument("--sample-period", type=float, default=0.5)
    ap.add_argument("--out-dir", default=os.path.join(HERE, "out", "deploy"))
    args = ap.parse_args()
    if args.cmd == "register":
        return cmd_register(args)
    if args.kill_round is None:
        args.kill_round = max(1, args.rounds // 2)
    args.bin_dir = os.path.abspath(args.bin_dir)
    args.out_dir = os.path.abspath(args.out_dir)
    ns = [int(x) for x in args.nodes.split(",") if x]
    os.makedirs(args.out_dir, exist_ok=True)
    invocation = "bash benches/flower/deploy.sh" + "".join(" " + shlex.quote(a) for a in sys.argv[1:])
    summary = []
    # Memory estimates (MiB, PSS): server, per device; first guesses (a little above what N=10
    # and 25 measured on a 2-core x86_64 VM), then what the previous N measured.
    est = {"fedfleet": [150.0, 30.0], "flower": [500.0, 250.0]}

    def too_big(name: str, n: int) -> str:
        srv, dev = est[name]
        need = srv + n * dev
        avail = mem_available_kib() / 1024
        if need > args.mem_fraction * avail:
            return (f"skipped: needs ~{need / 1024:.1f} GiB ({srv:.0f} MiB server + {n} x {dev:.0f} MiB per device, PSS, "
                    f"from the previous N or a first guess), more than {args.mem_fraction:.0%} "
                    f"of MemAvailable {avail / 1024:.1f} GiB")
        return ""

    for n in ns:
        base = os.path.join(args.out_dir, f"n{n}")
        os.makedirs(base, exist_ok=True)
        task_path = os.path.join(base, "task.json")
        log(f"== N={n}: task dump ==")
        task = make_task(args.bin_dir, n, args.seed, args.alpha, task_path)
        empty = sum(1 for p in task["partition"] if not p)
        ff = Side("fedfleet")
        fl = Side("flower")
        if args.skip_fedfleet:
            ff.error = "skipped (--skip-fedfleet)"
        elif why := too_big("fedfleet", n):
            ff.error = why
        else:
            ff = run_fedfleet(args, n, task, os.path.join(base, "fedfleet"))
        if args.skip_flower:
            fl.error = "skipped (--skip-flower)"
        elif args.flower_max_nodes and n > args.flower_max_nodes:
            fl.error = f"skipped (--flower-max-nodes {args.flower_max_nodes})"
        elif why := too_big("flower", n):
            fl.error = why
        else:
            fl = run_flower(args, n, task_path, os.path.join(base, "flower"))
        for s in (ff, fl):
            if s.device_peaks_pss_kib and any(s.device_peaks_pss_kib):
                est[s.name] = [s.server_peak_pss_kib / 1024 * 1.2, max(s.device_peaks_pss_kib) / 1024 * 1.2]
        rows = rows_for(n, ff, fl, args)
        print()
        print_table(f"N = {n} devices, {args.rounds} rounds", rows)
        notes = []
        if empty:
            notes.append(f"{empty} of {n} partitions are empty (Dirichlet({args.alpha}) over 1,438 examples)")
        for s in (ff, fl):
            if s.error:
                notes.append(f"{s.name}: {s.error}")
            notes += [f"{s.name}: {x}" for x in s.notes]
            if s.setup_excluded:
                notes.append(f"{s.name}: {s.setup_excluded:.1f} s of registering {n} node keys excluded from start -> round 1")
            missing = [r for r in range(1, args.rounds + 1) if r not in s.round_end]
            if not s.error and missing:
                notes.append(f"{s.name}: rounds without a result: {missing}")
        for x in notes:
            print(f"  - {x}")
        print(flush=True)
        for name, a, b, kind in rows:
            key = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")[:48]
            if kind != "text":
                print(f"RESULT deploy n={n} metric={key} fedfleet={a if a is not None else 'nan'} flower={b if b is not None else 'nan'}")
        summary.append((n, rows, notes))
        with open(os.path.join(base, "result.json"), "w") as f:
            json.dump({"n": n, "rows": [(a, str(b), str(c), d) for a, b, c, d in rows], "notes": notes,
                       "fedfleet": {"round_start": ff.round_start, "round_end": ff.round_end, "accuracy": ff.accuracy,
                                    "contrib": {r: sorted(v) for r, v in ff.contrib.items()}, "kill": ff.kill},
                       "flower": {"round_start": fl.round_start, "round_end": fl.round_end, "accuracy": fl.accuracy,
                                  "contrib": {r: sorted(v) for r, v in fl.contrib.items()}, "kill": fl.kill}},
                      f, indent=1, default=str)
    print(f"produced by: {invocation}")
    print(f"machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()

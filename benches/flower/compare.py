"""fedfleet vs Flower, side by side, in one invocation. Run through run.sh (which makes the
virtualenv); see README.md.

Runs, in this order:
  1. fedfleet's digits FedAvg simulation (`fl_digits` example), which also dumps the split,
     partition and initial weights to a JSON file;
  2. the Flower simulation of the same task from that dump (flower_bench.py sim);
  3. for every (P, N): fedfleet's aggregation bench (bench_aggregate example, if it exists)
     and Flower's FedAvg aggregation (flower_bench.py agg), each in its own process;
then prints one table: metric | fedfleet | flower | ratio (flower / fedfleet).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
PY = sys.executable

KV = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(\S+)")


def kv(line: str) -> dict[str, str]:
    return dict(KV.findall(line))


def result_lines(text: str) -> list[str]:
    return [l.strip()[len("RESULT ") :] for l in text.splitlines() if l.strip().startswith("RESULT ")]


def run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str, str, float]:
    print(f"$ {shlex.join(cmd)}", flush=True)
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc = 124
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")) + "\n(timed out)"
    dt = time.perf_counter() - t
    print(f"  -> exit {rc} after {dt:.1f} s", flush=True)
    return rc, out, err, dt


def tail(s: str, n: int = 3) -> str:
    lines = [l for l in s.strip().splitlines() if l.strip()]
    return " | ".join(lines[-n:])


# =============================================================================================
# fedfleet aggregation bench: the ONE place that knows bench_aggregate's command line and
# output format. Two formats are accepted:
#
# 1. (proposed, preferred) one machine-readable line per (P, N):
#      RESULT fold params=<P> updates=<N> seconds=<s> peak_rss_kib=<k> [ingest_seconds=<s>]
#    extra key=value pairs and other RESULT lines are ignored; the line whose params/updates
#    match is used.
# 2. (what aggregator/examples/bench_aggregate.rs prints as of a0a5d60) its human table:
#      "         P      N    fold GB/s  memcpy GB/s    ingest GB/s  peak RSS MB"
#      "   1000000     10        12.34        20.00           1.23          123"
#    seconds = N*P*4 bytes / (GB/s * 1e9) (fold GB/s has 2 decimals, so ~1 % resolution at
#    the fastest rows); ingest GB/s may read "skipped"; peak RSS MB is 1e6 bytes.
# =============================================================================================
AGG_EXAMPLE = os.path.join(REPO, "aggregator", "examples", "bench_aggregate.rs")


def fedfleet_aggregate_cmd(p: int, n: int) -> list[str]:
    return [
        "cargo", "run", "--release", "-q", "-p", "fedfleet-aggregator", "--example", "bench_aggregate",
        "--", "--params", str(p), "--updates", str(n),
    ]


def parse_fedfleet_aggregate(out: str, p: int, n: int) -> dict | None:
    """{seconds, peak_rss_kib?, ingest_seconds?} for (p, n) from bench_aggregate's stdout."""
    for line in result_lines(out):
        if not line.startswith("fold "):
            continue
        d = kv(line)
        if d.get("params") == str(p) and d.get("updates") == str(n) and "seconds" in d:
            r = {"seconds": float(d["seconds"])}
            if "peak_rss_kib" in d:
                r["peak_rss_kib"] = float(d["peak_rss_kib"])
            if "ingest_seconds" in d:
                r["ingest_seconds"] = float(d["ingest_seconds"])
            return r
    in_table = False
    for line in out.splitlines():
        if "fold GB/s" in line:
            in_table = True
            continue
        f = line.split()
        # Older tables had no "tensor GB/s" column: ingest and RSS are the last two cells.
        if not in_table or len(f) not in (6, 7) or f[0] != str(p) or f[1] != str(n):
            continue
        try:
            bytes_ = n * p * 4
            r = {"seconds": bytes_ / (float(f[2]) * 1e9), "peak_rss_kib": float(f[-1]) * 1e6 / 1024}
            if f[-2] != "skipped" and float(f[-2]) > 0:
                r["ingest_seconds"] = bytes_ / (float(f[-2]) * 1e9)
            return r
        except ValueError:
            continue
    return None


def run_fedfleet_aggregate(p: int, n: int, timeout: float) -> tuple[dict | None, str]:
    """Returns ({seconds, peak_rss_kib, ingest_seconds}, note)."""
    if not os.path.exists(AGG_EXAMPLE):
        return None, "aggregator/examples/bench_aggregate.rs does not exist yet"
    rc, out, err, _ = run(fedfleet_aggregate_cmd(p, n), timeout)
    if rc != 0:
        return None, f"bench_aggregate exited {rc}: {tail(err or out)}"
    r = parse_fedfleet_aggregate(out, p, n)
    if r is None:
        return None, (
            f"bench_aggregate printed neither 'RESULT fold params={p} updates={n} seconds=..' nor a "
            f"table row for P={p} N={n} (stdout tail: {tail(out)})"
        )
    return r, ""


# =============================================================================================
# fedfleet digits simulation (learning/examples/fl_digits.rs)
# =============================================================================================
def fedfleet_sim_cmd(clients, alpha, rounds, seed, dump) -> list[str]:
    return [
        "cargo", "run", "--release", "-q", "-p", "fedfleet-learning", "--example", "fl_digits", "--",
        "--clients", str(clients), "--alpha", str(alpha), "--rounds", str(rounds), "--seed", str(seed),
        "--dump-partition", dump,
    ]


def parse_sim(out: str, prefix: str) -> dict:
    """prefix '' for fedfleet (`round=`, `wall_seconds=`), 'flower_' for Flower."""
    res: dict = {"curve": {}}
    for line in result_lines(out):
        d = kv(line)
        if f"{prefix}round" in d and "accuracy" in d:
            res["curve"][int(d[f"{prefix}round"])] = float(d["accuracy"])
        for k in ("wall_seconds", "rounds_wall_seconds", "peak_rss_kib", "tree_peak_rss_kib", "client_train_seconds"):
            if f"{prefix}{k}" in d:
                res[k] = float(d[f"{prefix}{k}"])
    return res


# =============================================================================================
def mem_available_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    return 0


def human_p(p: int) -> str:
    return f"{p // 1_000_000}M" if p % 1_000_000 == 0 else (f"{p // 1000}k" if p % 1000 == 0 else str(p))


def fmt(v, digits=3) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    if abs(v) >= 100:
        return f"{v:.1f}"
    return f"{v:.{digits}f}" if abs(v) >= 0.01 or v == 0 else f"{v:.2e}"


def ratio(a, b) -> str:
    if a is None or b is None or isinstance(a, str) or isinstance(b, str) or a == 0:
        return "n/a"
    return f"{b / a:.2f}x"


def first_round_at(curve: dict, thr: float):
    for r in sorted(curve):
        if curve[r] >= thr:
            return float(r)
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small config: 5 rounds, P=1M, N in {10,100}")
    ap.add_argument("--skip-sim", action="store_true")
    ap.add_argument("--skip-agg", action="store_true")
    ap.add_argument("--actors", type=int, default=1, help="Flower simulation: parallel Ray actors (default 1)")
    ap.add_argument("--flower-mem-gib", type=float, default=None,
                    help="skip Flower aggregation configs whose N*P*4 bytes exceed this (default: 60%% of MemAvailable)")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "out"))
    args = ap.parse_args()

    invocation = "bash benches/flower/run.sh" + ("".join(" " + a for a in sys.argv[1:]))
    os.makedirs(args.out_dir, exist_ok=True)
    clients, alpha, seed = 20, 0.5, 42
    rounds = 5 if args.quick else 30
    ps = [1_000_000] if args.quick else [1_000_000, 10_000_000]
    ns = [10, 100] if args.quick else [10, 100, 1000]
    budget_kib = (args.flower_mem_gib * 1024 * 1024) if args.flower_mem_gib else 0.6 * mem_available_kib()

    rows: list[tuple[str, object, object, str]] = []
    notes: list[str] = []
    curves = {}
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", HERE)

    # ---------------------------------------------------------------- (b) simulation
    if not args.skip_sim:
        dump = os.path.join(args.out_dir, "fl_digits_task.json")
        if os.path.exists(dump):
            os.remove(dump)
        rc, out, err, proc_wall = run(fedfleet_sim_cmd(clients, alpha, rounds, seed, dump), 3600)
        ours = parse_sim(out, "") if rc == 0 else None
        if rc != 0 or not ours["curve"]:
            notes.append(f"fedfleet fl_digits failed (rc {rc}): {tail(err or out)}")
            ours = None
        theirs = None
        if os.path.exists(dump):
            rc2, out2, err2, proc_wall2 = run([PY, os.path.join(HERE, "flower_bench.py"), "sim", "--dump", dump,
                                               "--actors", str(args.actors)], 3600, env=env)
            theirs = parse_sim(out2, "flower_") if rc2 == 0 else None
            if rc2 != 0 or not theirs["curve"]:
                notes.append(f"Flower simulation failed (rc {rc2}): {tail(err2 or out2, 6)}")
                theirs = None
            else:
                theirs["process_wall"] = proc_wall2
                if "client_train_seconds" in theirs and "rounds_wall_seconds" in theirs:
                    notes.append(
                        f"Flower simulation: {theirs['client_train_seconds']:.1f} s of its "
                        f"{theirs['rounds_wall_seconds']:.1f} s of rounds were spent inside ClientApp train() "
                        f"(numpy local training, summed over clients); the rest is the simulation engine "
                        f"(Ray actors, message passing, polling), aggregation and evaluation"
                    )
        else:
            notes.append("no task dump from fl_digits, so the Flower simulation was not run")
        o = ours or {"curve": {}}
        t = theirs or {"curve": {}}
        curves = {"fedfleet": o["curve"], "flower": t["curve"]}
        last = rounds
        tag = f"sim ({clients} clients, Dir({alpha}), {rounds} rounds)"
        rows.append((f"{tag} final accuracy", o["curve"].get(last), t["curve"].get(last), ""))
        rows.append((f"{tag} best accuracy", max(o["curve"].values(), default=None),
                     max(t["curve"].values(), default=None), ""))
        rows.append((f"{tag} first round >= 90% acc", first_round_at(o["curve"], 0.9) if o["curve"] else None,
                     first_round_at(t["curve"], 0.9) if t["curve"] else None, ""))
        rows.append((f"{tag} wall seconds (rounds)", o.get("wall_seconds"), t.get("rounds_wall_seconds"), ""))
        rows.append((f"{tag} wall seconds (Flower incl. Ray start/stop)", o.get("wall_seconds"), t.get("wall_seconds"), ""))
        rows.append((f"{tag} peak RSS MiB (Flower: driver+Ray tree)",
                     o["peak_rss_kib"] / 1024 if "peak_rss_kib" in o else None,
                     t["tree_peak_rss_kib"] / 1024 if "tree_peak_rss_kib" in t else None, ""))

    # ---------------------------------------------------------------- (a) aggregation
    if not args.skip_agg:
        for p in ps:
            for n in ns:
                ours, note = run_fedfleet_aggregate(p, n, 1800)
                if note:
                    notes.append(f"fedfleet fold N={n} P={human_p(p)}: n/a ({note})")
                need_kib = (n * p * 4 + 3 * p * 4) / 1024 + 200 * 1024
                theirs = None
                if need_kib > budget_kib:
                    notes.append(
                        f"Flower fold N={n} P={human_p(p)}: skipped, Flower's aggregate_train takes all N "
                        f"replies at once (~{need_kib / 1024 / 1024:.1f} GiB resident) > budget "
                        f"{budget_kib / 1024 / 1024:.1f} GiB (--flower-mem-gib)"
                    )
                else:
                    rc, out, err, _ = run([PY, os.path.join(HERE, "flower_bench.py"), "agg",
                                           "--params", str(p), "--updates", str(n)], 1800, env=env)
                    for line in result_lines(out):
                        if line.startswith("flower_fold "):
                            d = kv(line)
                            theirs = {"seconds": float(d["seconds"]), "peak_rss_kib": float(d["peak_rss_kib"])}
                    if theirs is None:
                        notes.append(f"Flower fold N={n} P={human_p(p)} failed (rc {rc}): {tail(err or out)}")
                label = f"fold N={n} P={human_p(p)}"
                rows.append((f"{label} seconds (fedfleet: fold only)", ours and ours.get("seconds"),
                             theirs and theirs["seconds"], ""))
                rows.append((f"{label} seconds (fedfleet: verify+digest+decode+fold)",
                             ours and ours.get("ingest_seconds"), theirs and theirs["seconds"], ""))
                rows.append((f"{label} peak RSS MiB",
                             ours["peak_rss_kib"] / 1024 if ours and "peak_rss_kib" in ours else None,
                             theirs["peak_rss_kib"] / 1024 if theirs else None, ""))

    # ---------------------------------------------------------------- table
    lines = []
    w = max([len(r[0]) for r in rows] + [6])
    lines.append(f"{'metric':<{w}} | {'fedfleet':>10} | {'flower':>10} | {'ratio':>8}")
    lines.append(f"{'-' * w}-+-{'-' * 10}-+-{'-' * 10}-+-{'-' * 8}")
    for name, a, b, _ in rows:
        lines.append(f"{name:<{w}} | {fmt(a):>10} | {fmt(b):>10} | {ratio(a, b):>8}")
    try:
        import flwr  # noqa: F401
        import numpy

        versions = f"flwr {flwr.__version__}, numpy {numpy.__version__}"
    except Exception:  # pragma: no cover
        versions = "flwr ?"
    rustc = shutil.which("rustc") and subprocess.run(["rustc", "--version"], capture_output=True, text=True).stdout.strip()
    print()
    print(f"fedfleet vs Flower ({versions}; {rustc}; Python {sys.version.split()[0]}; "
          f"{os.cpu_count()} CPUs) -- ratio = flower / fedfleet")
    print("\n".join(lines))
    if curves and (curves["fedfleet"] or curves["flower"]):
        print()
        print("per-round test accuracy (same test set, same split/partition/init):")
        print(f"{'round':>5} | {'fedfleet':>8} | {'flower':>8}")
        for r in sorted(set(curves["fedfleet"]) | set(curves["flower"])):
            print(f"{r:>5} | {fmt(curves['fedfleet'].get(r), 4):>8} | {fmt(curves['flower'].get(r), 4):>8}")
    if notes:
        print()
        print("notes:")
        for n_ in notes:
            print(f"  - {n_}")
    print()
    print("Flower side: flwr.serverapp.strategy.FedAvg (Message API); simulation via "
          "flwr.simulation.run_simulation on the Ray backend, "
          f"{args.actors} client actor(s); clients train the MLP in numpy.")
    print(f"produced by: {invocation}")


if __name__ == "__main__":
    main()

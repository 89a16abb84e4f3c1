"""fedfleet's SecAgg+ beside Flower's, with and without it, at the same N, in one invocation.
Run by secagg.sh (which builds fedfleet's binaries and the Flower virtualenv first).

fedfleet: `bench_rounds --agents N --rounds R --no-daemon --light [--secure-aggregation]` (real
aggregator and registry processes, N light agents over QUIC with mTLS, degree 16) for the round
wall, and `bench_secagg --devices N --dim 4810 --degree D --dropout 0` (the same protocol cores
in one process) for the bytes of protocol messages a device sends and receives.
Flower: flower_secagg.py (simulation, Ray, SecAggPlusWorkflow with D+1 shares).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DIGITS_MLP_BYTES = 19_560  # the f32 update / global model bundle of the digits MLP (bench_rounds header)


def run(cmd: list[str], timeout: int) -> str:
    print("$ " + " ".join(cmd), flush=True)
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        sys.exit(f"{cmd[0]} failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    return out.stdout + out.stderr


def fedfleet_rounds(bench: str, n: int, rounds: int, secure: bool) -> list[float]:
    cmd = [bench, "--agents", str(n), "--rounds", str(rounds), "--no-daemon", "--light"]
    out = run(cmd + (["--secure-aggregation"] if secure else []), timeout=1800)
    walls = []
    for m in re.finditer(r"^\s*round (\d+): (\{.*\})$", out, re.M):
        r = json.loads(m.group(2))
        if r["accepted"] != n:
            sys.exit(f"fedfleet round {m.group(1)} accepted {r['accepted']} of {n}")
        walls.append(float(r["wall_s"]))
    if len(walls) != rounds:
        sys.exit(f"bench_rounds printed {len(walls)} rounds, expected {rounds}:\n{out[-3000:]}")
    return walls


def fedfleet_bytes(bench: str, n: int, degree: int) -> tuple[int, int]:
    d = min(degree, n - 1)
    out = run([bench, "--devices", str(n), "--dim", "4810", "--degree", str(d - d % 2), "--dropout", "0"], timeout=600)
    row = re.search(rf"^\| {n} \| [^|]+\| [^|]+\| (\d+) \| (\d+) \|", out, re.M)
    if not row:
        sys.exit(f"bench_secagg printed no row for {n}:\n{out}")
    return int(row.group(1)), int(row.group(2))


def flower(python: str, n: int, rounds: int, secure: bool, degree: int) -> tuple[list[float], int, int]:
    cmd = [python, os.path.join(HERE, "flower_secagg.py"), "--clients", str(n), "--rounds", str(rounds), "--degree", str(degree)]
    out = run(cmd + (["--secagg"] if secure else []), timeout=3600)
    walls = [float(m.group(2)) for m in re.finditer(r"RESULT flower_secagg_round=(\d+) wall_s=([\d.]+)", out)]
    b = re.search(r"RESULT flower_secagg_bytes sent_per_client_round=(\d+) received_per_client_round=(\d+)", out)
    if len(walls) != rounds or not b:
        sys.exit(f"flower_secagg.py printed {len(walls)} rounds:\n{out[-3000:]}")
    return walls, int(b.group(1)), int(b.group(2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="20,100,500", help="comma-separated N")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per run; the table reads the last")
    ap.add_argument("--degree", type=int, default=16)
    ap.add_argument("--bench-rounds", default="target/debug/examples/bench_rounds")
    ap.add_argument("--bench-secagg", default="target/debug/examples/bench_secagg")
    args = ap.parse_args()
    python = sys.executable
    rows = []
    for n in [int(x) for x in args.clients.split(",")]:
        ff_plain = fedfleet_rounds(args.bench_rounds, n, args.rounds, False)[-1]
        ff_secure = fedfleet_rounds(args.bench_rounds, n, args.rounds, True)[-1]
        ff_sent, ff_got = fedfleet_bytes(args.bench_secagg, n, args.degree)
        fl_plain, fl_plain_sent, fl_plain_got = flower(python, n, args.rounds, False, args.degree)
        fl_secure, fl_sent, fl_got = flower(python, n, args.rounds, True, args.degree)
        rows.append((n, ff_plain, ff_secure, fl_plain[-1], fl_secure[-1], ff_sent, ff_got, fl_plain_sent, fl_sent, fl_got))

    print()
    print(f"# SecAgg+ cost, fedfleet vs Flower {args.rounds} rounds each, last round's wall; degree {args.degree} (Flower: {args.degree}+1 shares), threshold half")
    print("# fedfleet: real services over QUIC+mTLS, light agents; Flower: simulation (Ray, in-process messages)")
    print(
        "N | fedfleet plain s | fedfleet SecAgg+ s | x | Flower plain s | Flower SecAgg+ s | x | Flower/fedfleet (SecAgg+) "
        "| fedfleet sent B | Flower sent B | fedfleet recv B (msgs + model) | Flower recv B"
    )
    for n, fp, fs, lp, ls, fsent, fgot, lpsent, lsent, lgot in rows:
        print(
            f"{n} | {fp:.3f} | {fs:.3f} | {fs / fp:.1f}x | {lp:.3f} | {ls:.3f} | {ls / lp:.1f}x | {ls / fs:.2f}x "
            f"| {fsent} | {lsent} | {fgot} + {DIGITS_MLP_BYTES} | {lgot}"
        )
    print("command: bash benches/flower/secagg.sh " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()

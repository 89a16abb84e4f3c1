"""Flower's SecAgg+ workflow beside fedfleet's, one configuration per process. Prints `RESULT ...`
lines (key=value) that secagg_compare.py parses.

    flower_secagg.py --clients N --params-shape mlp --rounds R [--secagg] [--degree D]

Flower simulation (flwr.simulation.run_simulation, Ray backend, one actor with every CPU) of N
clients over R rounds of Flower's legacy FedAvg under `DefaultWorkflow`, with
`SecAggPlusWorkflow(num_shares=D+1, reconstruction_threshold=ceil(D/2))` as its fit workflow when
--secagg is given (the client keeps one share, so D+1 shares is D neighbours, fedfleet's
`degree`; the threshold is fedfleet's default `threshold_fraction = 0.5`), and the ClientApp
wrapped in `secaggplus_mod`. Every client answers `fit` with the global weights plus a fixed,
seeded perturbation of the digits MLP's shapes (64-64-10, 4,810 f32): no training, so the
figures are the protocol's and the runtime's, not numpy's.

Round wall: from one centralised evaluation to the next (the evaluation is a no-op), i.e. the
fit workflow's four SecAgg+ stages, or the plain fit round, and the aggregation. Bytes: a client
mod outside `secaggplus_mod` serialises every message's content (RecordDict protobuf) in and
out of the ClientApp; each Ray worker appends its counts to a file, summed here per client.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SHAPES = [(64, 64), (64,), (10, 64), (10,)]  # fc1.weight, fc1.bias, fc2.weight, fc2.bias


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--secagg", action="store_true")
    ap.add_argument("--degree", type=int, default=16, help="neighbours per client (fedfleet's [secure_aggregation] degree)")
    args = ap.parse_args()

    import flwr
    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common import Context, ndarrays_to_parameters
    from flwr.common.serde import recorddict_to_proto
    from flwr.server import Grid, LegacyContext, ServerApp, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.simulation import run_simulation
    import logging

    logging.getLogger("flwr").setLevel(logging.WARNING)
    n, rounds = args.clients, args.rounds
    params = sum(int(np.prod(s)) for s in SHAPES)
    neighbours = min(args.degree, n - 1)
    num_shares = neighbours + 1
    threshold = max(2, math.ceil(neighbours / 2))
    count_dir = tempfile.mkdtemp(prefix="flower-secagg-bytes-")
    os.environ["FLOWER_SECAGG_BYTES_DIR"] = count_dir  # Ray workers inherit it
    print(
        f"RESULT flower_secagg_config clients={n} rounds={rounds} secagg={int(args.secagg)} params={params} "
        f"num_shares={num_shares} threshold={threshold} flwr={flwr.__version__}",
        flush=True,
    )

    class Client(NumPyClient):
        def __init__(self, seed: int) -> None:
            self.seed = seed

        def fit(self, parameters, config):  # noqa: ANN001
            rng = np.random.default_rng(self.seed)
            return [p + 0.01 * rng.standard_normal(p.shape).astype(np.float32) for p in parameters], 10, {}

    def client_fn(context: Context):  # noqa: ANN202
        return Client(int(context.node_config["partition-id"])).to_client()

    def count_bytes(msg, ctx, call_next):  # noqa: ANN001, ANN202
        got = recorddict_to_proto(msg.content).ByteSize()
        out = call_next(msg, ctx)
        sent = recorddict_to_proto(out.content).ByteSize() if out.has_content() else 0
        path = os.path.join(os.environ["FLOWER_SECAGG_BYTES_DIR"], f"{os.getpid()}.txt")
        with open(path, "a") as f:
            f.write(f"{ctx.node_config['partition-id']} {sent} {got}\n")
        return out

    mods = [count_bytes, secaggplus_mod] if args.secagg else [count_bytes]
    client_app = ClientApp(client_fn=client_fn, mods=mods)

    stamps: list[float] = []

    def central_eval(server_round, parameters, config):  # noqa: ANN001, ANN202
        stamps.append(time.perf_counter())
        return 0.0, {}

    server_app = ServerApp()

    @server_app.main()
    def server(grid: Grid, context: Context) -> None:
        rng = np.random.default_rng(42)
        init = [rng.standard_normal(s).astype(np.float32) * 0.1 for s in SHAPES]
        strategy = FedAvg(
            fraction_fit=1.0,
            fraction_evaluate=0.0,
            min_fit_clients=n,
            min_available_clients=n,
            initial_parameters=ndarrays_to_parameters(init),
            evaluate_fn=central_eval,
        )
        legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=rounds), strategy=strategy)
        fit = SecAggPlusWorkflow(num_shares=num_shares, reconstruction_threshold=threshold) if args.secagg else None
        workflow = DefaultWorkflow(fit_workflow=fit) if fit else DefaultWorkflow()
        workflow(grid, legacy)

    ncpu = os.cpu_count() or 1
    backend_config = {
        "client_resources": {"num_cpus": ncpu, "num_gpus": 0.0},
        "init_args": {"num_cpus": ncpu, "num_gpus": 0, "include_dashboard": False},
    }
    t0 = time.perf_counter()
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=n, backend_config=backend_config)
    wall = time.perf_counter() - t0
    if len(stamps) != rounds + 1:
        raise SystemExit(f"simulation produced {len(stamps) - 1} rounds, expected {rounds}")
    for r in range(1, rounds + 1):
        print(f"RESULT flower_secagg_round={r} wall_s={stamps[r] - stamps[r - 1]:.3f}", flush=True)

    sent: dict[str, int] = {}
    got: dict[str, int] = {}
    for path in glob.glob(os.path.join(count_dir, "*.txt")):
        with open(path) as f:
            for line in f:
                cid, s, g = line.split()
                sent[cid] = sent.get(cid, 0) + int(s)
                got[cid] = got.get(cid, 0) + int(g)
    if len(sent) != n:
        raise SystemExit(f"byte counts from {len(sent)} clients, expected {n}")
    per_round = lambda d: sum(d.values()) / n / rounds  # noqa: E731
    print(
        f"RESULT flower_secagg_bytes sent_per_client_round={per_round(sent):.0f} "
        f"received_per_client_round={per_round(got):.0f} plain_f32={params * 4} wall_s={wall:.3f}",
        flush=True,
    )


if __name__ == "__main__":
    main()

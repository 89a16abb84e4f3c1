"""Flower's half of the side-by-side comparison. Two sub-commands, each printing `RESULT ...`
lines (key=value) that compare.py parses:

  agg --params P --updates N
      Flower's FedAvg aggregation (flwr.serverapp.strategy.FedAvg.aggregate_train, the
      Message-API strategy of flwr >= 1.21; it calls strategy_utils.aggregate_arrayrecords)
      of N reply Messages, each carrying an ArrayRecord of one f32 tensor of P values and a
      MetricRecord {"num-examples": k}. Times aggregate_train only (this includes Flower's
      per-array deserialisation, Array.numpy()); building the N replies is timed apart.
      Peak RSS is this process's VmHWM: Flower's API takes every reply at once, so the N
      serialised updates are resident by construction. Run one config per process.

  sim --dump PATH [--actors K]
      Flower simulation (flwr.simulation.run_simulation, Ray backend) of the digits task with
      the split, Dirichlet partition, initial weights and hyper-parameters that fedfleet's
      fl_digits example dumped to PATH. Clients train the same MLP in numpy (fl_numpy.py);
      the server runs Flower's FedAvg (fraction_train=1, every client every round) and a
      centralised evaluate_fn on the same test set after every round.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def peak_rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return -1


def tree_rss_kib(root: int) -> int:
    """Sum of VmRSS over `root` and all its descendants (Ray's raylet, GCS and workers)."""
    parent: dict[int, int] = {}
    rss: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                ppid, kib = -1, 0
                for line in f:
                    if line.startswith("PPid:"):
                        ppid = int(line.split()[1])
                    elif line.startswith("VmRSS:"):
                        kib = int(line.split()[1])
            parent[int(name)], rss[int(name)] = ppid, kib
        except (OSError, ValueError):
            continue
    total = 0
    for pid in rss:
        q, hops = pid, 0
        while q > 0 and q != root and hops < 64:
            q, hops = parent.get(q, -1), hops + 1
        if q == root:
            total += rss[pid]
    return total


class TreeRssSampler:
    """Samples tree_rss_kib(self) every `period` seconds in a thread; keeps the maximum."""

    def __init__(self, period: float = 0.25) -> None:
        import threading

        self.peak, self.period = 0, period
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = os.getpid()
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss_kib(me))
            self._stop.wait(self.period)

    def __enter__(self) -> "TreeRssSampler":
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def quiet_flwr() -> None:
    logging.getLogger("flwr").setLevel(logging.WARNING)


# ---------------------------------------------------------------------------------------------
# (a) aggregation
# ---------------------------------------------------------------------------------------------


def cmd_agg(args: argparse.Namespace) -> None:
    import flwr
    from flwr.app import Array, ArrayRecord, Message, MessageType, MetricRecord, RecordDict
    from flwr.serverapp.strategy import FedAvg

    quiet_flwr()
    try:  # what a running ServerApp has set; Message() reads it for the metadata
        from flwr.supercore.task_identity import TaskIdentity

        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    except ImportError:
        pass
    p, n = args.params, args.updates
    rng = np.random.default_rng(7)
    base = rng.standard_normal(p, dtype=np.float32)
    rss_before = peak_rss_kib()
    t0 = time.perf_counter()
    replies = []
    for i in range(n):
        upd = base + np.float32(i * 1e-3)  # distinct contents, cheap to generate
        content = RecordDict(
            {
                "arrays": ArrayRecord({"w": Array(upd)}),
                "metrics": MetricRecord({"num-examples": int(10 + i % 50)}),
            }
        )
        ins = Message(RecordDict(), dst_node_id=i + 1, message_type=MessageType.TRAIN)
        replies.append(Message(content, reply_to=ins))
        del upd
    build_s = time.perf_counter() - t0
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=n)
    t1 = time.perf_counter()
    arrays, _metrics = strategy.aggregate_train(1, replies)
    agg_s = time.perf_counter() - t1
    out = arrays["w"].numpy()
    assert out.shape == (p,) and out.dtype == np.float32
    print(
        f"RESULT flower_fold params={p} updates={n} seconds={agg_s:.6f} "
        f"peak_rss_kib={peak_rss_kib()} build_seconds={build_s:.3f} "
        f"rss_before_inputs_kib={rss_before} flwr={flwr.__version__} numpy={np.__version__}",
        flush=True,
    )


# ---------------------------------------------------------------------------------------------
# (b) simulation
# ---------------------------------------------------------------------------------------------


def cmd_sim(args: argparse.Namespace) -> None:
    import flwr
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
    from flwr.simulation import run_simulation

    import fl_numpy

    dump = os.path.abspath(args.dump)
    os.environ["FL_DIGITS_DUMP"] = dump  # inherited by Ray's workers
    task = fl_numpy.load_task(dump)
    meta = task["meta"]
    tc = meta["train_config"]
    opt = tc["optimizer"]
    if opt.get("kind") != "sgd" or tc.get("prox_mu", 0) != 0 or tc.get("max_steps") is not None:
        raise SystemExit(f"unsupported train config {tc}")
    clients, rounds = int(meta["clients"]), int(meta["rounds"])
    if float(meta.get("server_lr", 1.0)) != 1.0:
        raise SystemExit("server_lr != 1 is not FedAvg")
    print(
        f"RESULT flower_sim_config clients={clients} rounds={rounds} epochs={tc['epochs']} "
        f"batch={tc['batch_size']} lr={tc['lr']} momentum={opt.get('momentum', 0.0)} "
        f"train={len(task['y_train'])} test={len(task['y_test'])} "
        f"flwr={flwr.__version__} numpy={np.__version__} actors={args.actors}",
        flush=True,
    )

    # ---- ClientApp: local training in numpy -------------------------------------------------
    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        import fl_numpy as fn  # resolved inside the Ray worker

        t = fn.load_task(os.environ["FL_DIGITS_DUMP"])
        cfg = t["meta"]["train_config"]
        cid = int(context.node_config["partition-id"])
        rnd = int(msg.content["config"]["server-round"])
        idx = t["parts"][cid]
        t0 = time.perf_counter()
        params = msg.content["arrays"].to_numpy_ndarrays()
        new, n, loss = fn.train_local(
            params,
            t["x_train"][idx],
            t["y_train"][idx],
            epochs=int(cfg["epochs"]),
            batch=int(cfg["batch_size"]),
            lr=float(cfg["lr"]),
            momentum=float(cfg["optimizer"].get("momentum", 0.0)),
            seed=(int(t["meta"]["seed"]) * 1_000_003 + rnd * 10_007 + cid),
        )
        return Message(
            RecordDict(
                {
                    "arrays": ArrayRecord(new),
                    "metrics": MetricRecord(
                        {
                            "num-examples": int(n),
                            "train_loss": float(loss),
                            "train_seconds": time.perf_counter() - t0,
                        }
                    ),
                }
            ),
            reply_to=msg,
        )

    # ---- ServerApp: Flower's FedAvg + centralised evaluation ------------------------------
    curve: list[tuple[int, float, float, float]] = []
    client_seconds = [0.0]  # sum over rounds and clients of ClientApp train() time

    def train_metrics(records: list[RecordDict], key: str) -> MetricRecord:
        for r in records:
            client_seconds[0] += float(next(iter(r.metric_records.values()))["train_seconds"])
        return aggregate_metricrecords(records, key)

    def central_eval(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        loss, acc = fl_numpy.evaluate(arrays.to_numpy_ndarrays(), task["x_test"], task["y_test"])
        curve.append((server_round, acc, loss, time.perf_counter()))
        if server_round > 0:
            print(f"RESULT flower_round={server_round} accuracy={acc:.6f} loss={loss:.6f}", flush=True)
        return MetricRecord({"accuracy": acc, "loss": loss})

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(
            fraction_train=1.0,
            fraction_evaluate=0.0,
            min_train_nodes=clients,
            min_available_nodes=clients,
            train_metrics_aggr_fn=train_metrics,
        )
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord([a.copy() for a in task["init"]]),
            num_rounds=rounds,
            evaluate_fn=central_eval,
        )

    # One actor with all the CPUs (clients run one after another, as fedfleet's run_fedavg
    # does) unless --actors says otherwise.
    ncpu = os.cpu_count() or 1
    per_actor = max(1, ncpu // max(1, args.actors))
    backend_config = {
        "client_resources": {"num_cpus": per_actor, "num_gpus": 0.0},
        "init_args": {"num_cpus": ncpu, "num_gpus": 0, "include_dashboard": False},
    }
    quiet_flwr()
    t0 = time.perf_counter()
    with TreeRssSampler() as sampler:
        run_simulation(
            server_app=server_app,
            client_app=client_app,
            num_supernodes=clients,
            backend_config=backend_config,
        )
    wall = time.perf_counter() - t0
    if len(curve) != rounds + 1:
        raise SystemExit(f"simulation produced {len(curve) - 1} rounds, expected {rounds}")
    rounds_wall = curve[-1][3] - curve[0][3]  # from the initial evaluation to the last round's
    print(f"RESULT flower_wall_seconds={wall:.3f}", flush=True)
    print(f"RESULT flower_rounds_wall_seconds={rounds_wall:.3f}", flush=True)
    print(f"RESULT flower_client_train_seconds={client_seconds[0]:.3f}", flush=True)
    print(f"RESULT flower_peak_rss_kib={peak_rss_kib()}", flush=True)
    print(f"RESULT flower_tree_peak_rss_kib={sampler.peak}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("agg")
    a.add_argument("--params", type=int, required=True)
    a.add_argument("--updates", type=int, required=True)
    s = sub.add_parser("sim")
    s.add_argument("--dump", required=True)
    s.add_argument("--actors", type=int, default=1)
    args = ap.parse_args()
    {"agg": cmd_agg, "sim": cmd_sim}[args.cmd](args)


if __name__ == "__main__":
    main()

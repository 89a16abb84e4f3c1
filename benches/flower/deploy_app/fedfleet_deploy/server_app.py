"""ServerApp: Flower's FedAvg (Message API, every connected node every round) from the initial
weights of the task dump, with a centralised evaluation on the digits test split after every
round. Appends one JSON line per event to the run config's `events` file (wall-clock times), which
deploy_bench.py reads: round_start, replies (which partitions answered, errors), round_end
(accuracy after the round)."""

from __future__ import annotations

import json
import math
import time

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedfleet_deploy.common import fl_numpy

app = ServerApp()


def _emit(path: str, **ev) -> None:
    ev["t"] = time.time()
    with open(path, "a") as f:
        f.write(json.dumps(ev) + "\n")


class TimedFedAvg(FedAvg):
    """FedAvg that records when each round is configured and what each round's replies were."""

    def __init__(self, events: str, **kw) -> None:
        super().__init__(**kw)
        self.events = events

    def configure_train(self, server_round, arrays, config, grid):
        msgs = list(super().configure_train(server_round, arrays, config, grid))
        _emit(self.events, ev="round_start", round=server_round, sent=len(msgs))
        return msgs

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        parts, errors, payload = [], 0, []
        for m in replies:
            if m.has_error():
                errors += 1
                continue
            mr = m.content["metrics"]
            parts.append(int(mr["partition"]))
            payload.append(int(mr["payload_bytes"]))
        _emit(self.events, ev="replies", round=server_round, ok=len(parts), errors=errors,
              partitions=sorted(parts), payload_bytes=payload[:1])
        return super().aggregate_train(server_round, replies)


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    fn = fl_numpy(rc)
    task = fn.load_task(str(rc["dump"]))
    events = str(rc["events"])
    n = int(rc["num-nodes"])
    _emit(events, ev="serverapp_start", nodes=n)
    # Round 1 starts when the whole fleet is connected (fedfleet's campaign is also started with
    # every agent running). Later rounds train every node connected at that moment; a round
    # needs at least half the fleet connected to start (fedfleet's quorum is the same ceil(N/2)).
    while len(list(grid.get_node_ids())) < n:
        time.sleep(0.2)
    _emit(events, ev="fleet_connected", nodes=n)

    def central_eval(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        loss, acc = fn.evaluate(arrays.to_numpy_ndarrays(), task["x_test"], task["y_test"])
        _emit(events, ev="round_end", round=server_round, accuracy=acc, loss=loss)
        return MetricRecord({"accuracy": acc, "loss": loss})

    strategy = TimedFedAvg(
        events,
        fraction_train=1.0,
        fraction_evaluate=0.0,
        min_train_nodes=1,
        min_available_nodes=max(1, math.ceil(n / 2)),
    )
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord([a.copy() for a in task["init"]]),
        num_rounds=int(rc["num-server-rounds"]),
        timeout=float(rc["round-timeout"]),
        evaluate_fn=central_eval,
    )
    _emit(events, ev="serverapp_done")

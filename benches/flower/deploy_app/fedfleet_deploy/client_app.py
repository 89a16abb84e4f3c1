"""ClientApp: local training of the digits MLP in numpy (fl_numpy.train_local) on this
SuperNode's partition (`--node-config partition-id=<i>`), the same partition, initial weights and
hyper-parameters as fedfleet's agents (the run config carries them)."""

from __future__ import annotations

import time

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedfleet_deploy.common import fl_numpy

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    rc = context.run_config
    fn = fl_numpy(rc)
    task = fn.load_task(str(rc["dump"]))
    cid = int(context.node_config["partition-id"])
    rnd = int(msg.content["config"]["server-round"])
    idx = task["parts"][cid]
    t0 = time.perf_counter()
    params = msg.content["arrays"].to_numpy_ndarrays()
    new, n, loss = fn.train_local(
        params,
        task["x_train"][idx],
        task["y_train"][idx],
        epochs=int(rc["local-epochs"]),
        batch=int(rc["batch-size"]),
        lr=float(rc["lr"]),
        momentum=float(rc["momentum"]),
        seed=int(rc["seed"]) * 1_000_003 + rnd * 10_007 + cid,
    )
    arrays = ArrayRecord(new)
    # The serialised size of the update's tensors (what the SuperNode pushes as objects, before
    # protobuf/HTTP/TLS framing).
    payload = sum(len(a.data) for a in arrays.values())
    return Message(
        RecordDict(
            {
                "arrays": arrays,
                "metrics": MetricRecord(
                    {
                        "num-examples": int(n),
                        "train_loss": float(loss),
                        "train_seconds": time.perf_counter() - t0,
                        "partition": cid,
                        "payload_bytes": int(payload),
                    }
                ),
            }
        ),
        reply_to=msg,
    )

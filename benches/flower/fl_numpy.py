"""The digits task in plain numpy: data (same split/partition/initial weights as fedfleet, read
from the JSON that `fl_digits --dump-partition` writes), the MLP 64-64-10 (ReLU, softmax
cross-entropy), local SGD with PyTorch-semantics momentum, and evaluation.

Used by the Flower ClientApp / ServerApp in flower_bench.py. Kept in its own module so Ray's
worker processes can import it (run.sh puts this directory on PYTHONPATH).
"""

from __future__ import annotations

import gzip
import json
import os
from functools import lru_cache

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))


@lru_cache(maxsize=4)
def load_task(dump_path: str) -> dict:
    """Loads the dump, reads digits.csv.gz itself, and rebuilds train/test/partitions."""
    with open(dump_path) as f:
        d = json.load(f)
    csv_path = os.path.join(REPO, d["data"])
    with gzip.open(csv_path, "rt") as f:
        rows = [line.strip().split(",") for line in f if line.strip()]
    raw = np.array(rows, dtype=np.float32)
    x_all = raw[:, :-1] * np.float32(1.0 / 16.0)  # CsvOptions::digits(): Scale(1/16), f32
    y_all = raw[:, -1].astype(np.int64)
    tr = np.array(d["split"]["train"], dtype=np.int64)
    te = np.array(d["split"]["test"], dtype=np.int64)
    x_tr, y_tr, x_te, y_te = x_all[tr], y_all[tr], x_all[te], y_all[te]
    # Same data as fedfleet's digits_split(): compare the checksums it wrote.
    for name, x in (("train_features", x_tr), ("test_features", x_te)):
        want = d["checksum"][name]
        got = float(x.astype(np.float64).sum())
        if abs(got - want) > 1e-6 * max(1.0, abs(want)):
            raise SystemExit(f"digits {name} checksum mismatch: {got} vs fedfleet {want}")
    parts = [np.array(p, dtype=np.int64) for p in d["partition"]]
    init = [
        np.array(d["init"][n]["values"], dtype=np.float32).reshape(d["init"][n]["shape"])
        for n in d["param_order"]
    ]
    return {
        "meta": d,
        "x_train": x_tr,
        "y_train": y_tr,
        "x_test": x_te,
        "y_test": y_te,
        "parts": parts,
        "init": init,
        "param_order": d["param_order"],
    }


def forward(params, x):
    w1, b1, w2, b2 = params  # PyTorch layouts: fc.weight is [out, in]
    h_pre = x @ w1.T + b1
    h = np.maximum(h_pre, np.float32(0))
    logits = h @ w2.T + b2
    return h_pre, h, logits


def log_softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def evaluate(params, x, y):
    _, _, logits = forward(params, x)
    lp = log_softmax(logits)
    loss = float(-lp[np.arange(len(y)), y].mean())
    acc = float((np.argmax(logits, axis=1) == y).mean())
    return loss, acc


def train_local(params, x, y, epochs, batch, lr, momentum, seed):
    """Mini-batch SGD (momentum without dampening, PyTorch/burn semantics; fresh optimizer
    state per call, as fedfleet's train_local), mean cross-entropy over the batch, the last
    batch of an epoch may be smaller. Returns (new params, examples, last-epoch mean loss)."""
    p = [a.astype(np.float32, copy=True) for a in params]
    vel = [None] * len(p)
    rng = np.random.default_rng(seed)
    n = len(y)
    lr32, mom32 = np.float32(lr), np.float32(momentum)
    last_loss = 0.0
    for _ in range(epochs):
        order = rng.permutation(n)
        loss_sum = 0.0
        for s in range(0, n, batch):
            idx = order[s : s + batch]
            xb, yb = x[idx], y[idx]
            b = len(idx)
            h_pre, h, logits = forward(p, xb)
            lp = log_softmax(logits)
            loss_sum += float(-lp[np.arange(b), yb].sum())
            g_logits = np.exp(lp)
            g_logits[np.arange(b), yb] -= np.float32(1)
            g_logits /= np.float32(b)
            g_w2 = g_logits.T @ h
            g_b2 = g_logits.sum(axis=0)
            g_h = g_logits @ p[2]
            g_h[h_pre <= 0] = 0
            g_w1 = g_h.T @ xb
            g_b1 = g_h.sum(axis=0)
            grads = (g_w1, g_b1, g_w2, g_b2)
            for i, g in enumerate(grads):
                g = g.astype(np.float32, copy=False)
                if mom32 > 0:
                    vel[i] = g.copy() if vel[i] is None else mom32 * vel[i] + g
                    step = vel[i]
                else:
                    step = g
                p[i] -= lr32 * step
        last_loss = loss_sum / max(n, 1)
    return p, n, last_loss

#!/usr/bin/env python3
"""PyTorch (CPU, one thread) side-by-side for `examples/bench_finetune.rs`.

Builds the same models as bench_finetune's presets (same layer sizes, input shapes and
fine-tuning mode), trains each on the same data shape with batch 32, SGD lr 0.05 momentum 0.9
(`TrainConfig::default()`), 40 optimizer steps after a few warm-up steps on a throw-away copy,
one thread, each preset in its own child process, and prints: preset, trainable parameters,
examples/s and the child's peak RSS: ru_maxrss from wait4 (whole life, including interpreter
shutdown, which with torch 2.15 adds ~100 MiB) and VmHWM read by the child right after training
(the point where bench_finetune reads its own VmHWM).

Run (needs only torch; numpy is not used):

    python3 -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch
    /tmp/torchvenv/bin/python learning/benches/torch_finetune.py            # every preset
    /tmp/torchvenv/bin/python learning/benches/torch_finetune.py cnn gru    # some presets
    /tmp/torchvenv/bin/python learning/benches/torch_finetune.py --repeat 3 # median of 3 runs

Prints figures only; asserts nothing (neither about time nor about matching the Rust numbers).

What is timed mirrors `train_local`: the loop over the 40 steps (shuffle each epoch, gather the
batch, forward, loss, read back logits/loss, backward, optimizer step); building the model and
the optimizer is outside it. Notes on the mapping from bench_finetune's JSON graphs:
- mlp / mlp-freeze-head: fc1 64->64, ReLU, fc2 64->10; freeze = only fc2.* trains.
- mlp-lora4: fc1/fc2 frozen, rank-4 adapters lora_A [4, in] (PyTorch Linear init), lora_B
  [out, 4] (zeros), weight used = W + (alpha/rank)·B·A with alpha 8 (merged, as fedfleet does).
- cnn: conv3x3(1->16)+ReLU+maxpool2, conv3x3(16->32)+ReLU+maxpool2, fc 128->64->10.
- resnet-bn: tests/fixtures/example_model.json; only head.* and block1.* train; stem_bn is frozen,
  so (as in fedfleet) it uses its running statistics; dropout p=0.1 is active.
- gru: GRU(8 -> 32) over 8 steps, last output, linear 32->10.
- attention: linear 8->32 per step, MultiheadAttention(32, 4 heads, batch_first,
  need_weights=False), LayerNorm(32), global_avg_pool over the last dim ([8, 32] -> [8]),
  linear 8->10.
- autoencoder: 64->16, ReLU, 16->64, MSE against the input.
Data: digits (learning/data/digits.csv.gz, /16, an 80 % stratified train part, 1,438 examples)
for every preset but resnet-bn, which gets 1,280 uniform [0, 1) 3x16x16 examples, 4 classes.
"""

import json
import math
import os
import statistics
import subprocess
import sys

PRESETS = ["mlp", "cnn", "mlp-freeze-head", "mlp-lora4", "resnet-bn", "gru", "attention", "autoencoder"]
STEPS = 40
WARMUP_STEPS = 3
BATCH = 32
LR = 0.05
MOMENTUM = 0.9
DIGITS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "digits.csv.gz")


def vm_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


# ----------------------------------------------------------------------------------------------
# child: one preset


def run_child(name):
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    rss_python = vm_kib("VmRSS")
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    rss_torch = vm_kib("VmRSS")
    import collections
    import copy
    import csv
    import gzip
    import time

    class LoraLinear(nn.Module):
        """nn.Linear with a frozen base and a trainable rank-r adapter (peft layout)."""

        def __init__(self, fan_in, fan_out, rank, alpha):
            super().__init__()
            base = nn.Linear(fan_in, fan_out)
            self.weight = nn.Parameter(base.weight.detach().clone(), requires_grad=False)
            self.bias = nn.Parameter(base.bias.detach().clone(), requires_grad=False)
            bound = 1.0 / math.sqrt(fan_in)  # "PyTorch init of the layer": U(±1/√fan_in)
            self.lora_A = nn.Parameter(torch.empty(rank, fan_in).uniform_(-bound, bound))
            self.lora_B = nn.Parameter(torch.zeros(fan_out, rank))
            self.scale = alpha / rank

        def forward(self, x):
            w = self.weight + self.scale * (self.lora_B @ self.lora_A)
            return F.linear(x, w, self.bias)

    def mlp(lora=False):
        if lora:
            return nn.Sequential(collections.OrderedDict(
                fc1=LoraLinear(64, 64, 4, 8.0), relu=nn.ReLU(), fc2=LoraLinear(64, 10, 4, 8.0)))
        return nn.Sequential(collections.OrderedDict(fc1=nn.Linear(64, 64), relu=nn.ReLU(), fc2=nn.Linear(64, 10)))

    class ResnetBn(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
            self.stem_bn = nn.BatchNorm2d(8)
            self.block1 = nn.Sequential(
                nn.Conv2d(8, 8, 3, padding=1, groups=8),  # separable: depthwise
                nn.Conv2d(8, 8, 1),  # separable: pointwise
                nn.BatchNorm2d(8),
                nn.GELU(),
            )
            self.conv1d = nn.Conv1d(8, 8, 3, padding=1)
            self.dropout = nn.Dropout(0.1)
            self.head = nn.Linear(8, 4)

        def train(self, mode=True):
            super().train(mode)
            self.stem_bn.eval()  # frozen batch norm: running statistics, as fedfleet
            return self

        def forward(self, x):
            x = F.relu(self.stem_bn(self.stem(x)))
            x = x + self.block1(x)
            x = F.max_pool2d(x, 2)  # [8, 8, 8]
            x = x.reshape(x.shape[0], 8, 64)
            x = F.avg_pool1d(self.conv1d(x), 2)  # [8, 32]
            x = x.mean(dim=-1)  # global_avg_pool -> [8]
            return self.head(self.dropout(x))

    class Gru(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = nn.GRU(8, 32, batch_first=True)
            self.fc = nn.Linear(32, 10)

        def forward(self, x):
            out, _ = self.gru(x)
            return self.fc(out[:, -1])

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 32)
            self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
            self.norm = nn.LayerNorm(32)
            self.fc = nn.Linear(8, 10)

        def forward(self, x):
            x = self.proj(x)
            x, _ = self.mha(x, x, x, need_weights=False)
            x = self.norm(x).mean(dim=-1)  # [L, E] -> [L]
            return self.fc(x)

    torch.manual_seed(1)
    task = "classification"
    shape = (64,)
    if name in ("mlp", "mlp-freeze-head"):
        model = mlp()
        if name == "mlp-freeze-head":
            for p in model.fc1.parameters():
                p.requires_grad_(False)
    elif name == "mlp-lora4":
        model = mlp(lora=True)
    elif name == "cnn":
        shape = (1, 8, 8)
        model = nn.Sequential(collections.OrderedDict(
            conv1=nn.Conv2d(1, 16, 3, padding=1), relu1=nn.ReLU(), pool1=nn.MaxPool2d(2),
            conv2=nn.Conv2d(16, 32, 3, padding=1), relu2=nn.ReLU(), pool2=nn.MaxPool2d(2),
            flatten=nn.Flatten(), fc1=nn.Linear(128, 64), relu3=nn.ReLU(), fc2=nn.Linear(64, 10)))
    elif name == "resnet-bn":
        shape = (3, 16, 16)
        model = ResnetBn()
        trainable = ("head.", "block1.")
        for n, p in model.named_parameters():
            p.requires_grad_(n.startswith(trainable))
    elif name == "gru":
        shape = (8, 8)
        model = Gru()
    elif name == "attention":
        shape = (8, 8)
        model = Attention()
    elif name == "autoencoder":
        task = "reconstruction"
        model = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 64))
    else:
        raise SystemExit(f"unknown preset {name}; one of {PRESETS}")

    # data
    if name == "resnet-bn":
        g = torch.Generator().manual_seed(99)
        x = torch.rand((1280,) + shape, generator=g)
        y = torch.arange(1280) % 4
    else:
        with gzip.open(DIGITS, "rt") as f:
            rows = [r for r in csv.reader(f) if r]
        feats = torch.tensor([[float(v) for v in r[:-1]] for r in rows]) / 16.0
        labels = torch.tensor([int(r[-1]) for r in rows])
        g = torch.Generator().manual_seed(20240917)
        keep = []
        for c in range(10):  # stratified 80 % train part
            idx = (labels == c).nonzero().flatten()
            idx = idx[torch.randperm(len(idx), generator=g)]
            keep.append(idx[: len(idx) - round(0.2 * len(idx))])
        keep = torch.cat(keep).sort().values
        x = feats[keep].reshape((-1,) + shape).contiguous()
        y = labels[keep]

    params = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in params)
    n_values = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())

    def train(net, steps, seed):
        net.train()
        ps = [p for p in net.parameters() if p.requires_grad]
        opt = torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM)
        gen = torch.Generator().manual_seed(seed)
        n = x.shape[0]
        done = processed = correct = 0
        t0 = time.perf_counter()
        while done < steps:
            order = torch.randperm(n, generator=gen)
            for i in range(0, n, BATCH):
                if done >= steps:
                    break
                idx = order[i : i + BATCH]
                xb = x[idx]
                out = net(xb)
                if task == "classification":
                    yb = y[idx]
                    correct += int((out.detach().argmax(1) == yb).sum())
                    loss = F.cross_entropy(out, yb)
                else:
                    loss = F.mse_loss(out, xb)
                if not math.isfinite(loss.item()):
                    raise SystemExit(f"{name}: non-finite loss at step {done}")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                done += 1
                processed += xb.shape[0]
        return processed / (time.perf_counter() - t0)

    warm = copy.deepcopy(model)
    train(warm, WARMUP_STEPS, 0)  # warm-up (allocator, first-call costs) on a throw-away copy
    del warm
    eps = train(model, STEPS, 1)
    print(json.dumps({
        "preset": name, "values": n_values, "trainable": n_trainable, "examples_per_sec": eps,
        "rss_python_kib": rss_python, "rss_after_import_torch_kib": rss_torch, "vmhwm_kib": vm_kib("VmHWM"),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }))


# ----------------------------------------------------------------------------------------------
# parent: one child process per preset (and per repetition)


def run_parent(names, repeat):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    print(f"torch_finetune: batch {BATCH}, {STEPS} optimizer steps (after {WARMUP_STEPS} warm-up) per preset, "
          f"SGD lr {LR} momentum {MOMENTUM}, one thread, one process per preset, repeat {repeat}")
    rows = []
    for name in names:
        runs = []
        for _ in range(repeat):
            p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", name],
                                 stdout=subprocess.PIPE, env=env)
            out = p.stdout.read()
            _, status, ru = os.wait4(p.pid, 0)
            p.returncode = os.waitstatus_to_exitcode(status)
            if p.returncode != 0:
                print(f"{name}: failed (exit {p.returncode})", file=sys.stderr)
                break
            r = json.loads(out.decode().strip().splitlines()[-1])
            r["ru_maxrss_kib"] = ru.ru_maxrss  # KiB on Linux
            runs.append(r)
        if not runs:
            continue
        r = dict(runs[0])
        r["examples_per_sec"] = statistics.median(x["examples_per_sec"] for x in runs)
        r["ru_maxrss_kib"] = max(x["ru_maxrss_kib"] for x in runs)
        r["vmhwm_kib"] = max(x["vmhwm_kib"] for x in runs)
        rows.append(r)
        print(f"{name:<16} values {r['values']:>7}  trainable {r['trainable']:>7}  {r['examples_per_sec']:>9.0f} examples/s"
              f"  peak RSS {r['ru_maxrss_kib']:>7} KiB (VmHWM after training {r['vmhwm_kib']} KiB;"
              f" {r['rss_after_import_torch_kib']} KiB right after import torch)", flush=True)
    if rows:
        print(f"\ntorch {rows[0]['torch']}, {rows[0]['threads']} thread(s)\n")
        print("| preset | trainable | examples/s | peak RSS (ru_maxrss) | VmHWM after training | RSS after `import torch` |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| `{r['preset']}` | {r['trainable']:,} | {r['examples_per_sec']:,.0f} | "
                  f"{r['ru_maxrss_kib'] / 1024:.1f} MiB | {r['vmhwm_kib'] / 1024:.1f} MiB | "
                  f"{r['rss_after_import_torch_kib'] / 1024:.1f} MiB |")


def main():
    args = sys.argv[1:]
    if args[:1] == ["--child"]:
        run_child(args[1])
        return
    repeat = 1
    if "--repeat" in args:
        i = args.index("--repeat")
        repeat = int(args[i + 1])
        del args[i : i + 2]
    names = args or PRESETS
    for n in names:
        if n not in PRESETS:
            raise SystemExit(f"unknown preset {n}; one of {PRESETS}")
    run_parent(names, repeat)


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# A tiny-size run of every benchmark, so that none of them rots (bench_rounds and the Flower
# deployment bench both stopped running once without anyone noticing). Figures printed here
# mean nothing (debug build, tiny sizes, a shared CI machine); what is checked is that each
# benchmark runs to the end and exits 0.
#
#   bash benches/smoke.sh     # after `cargo test --workspace` (it reuses that build's binaries)
#
# Runs: bench_aggregate (exact fold, ingest path, tensor fold on the CPU and, where a wgpu
# adapter exists, the GPU: the code path of benches/gpu.sh), bench_download, bench_agent,
# bench_learning --quick, fl_digits (the fedfleet side of benches/flower/run.sh), bench_async
# (FedBuff against rounds, simulated time), bench_secagg (SecAgg+ cores, one round), bench_dp (DP-FedAvg accuracy against ε), bench_rounds (real aggregator and agent processes; over mosquitto; and its sampled fleet). The Flower sides of benches/flower/*.sh need
# flwr[simulation] and ray from PyPI and are not run here; their fedfleet sides are
# (fl_digits, bench_rounds' deployment path, bench_rounds --secure-aggregation and bench_secagg
# for secagg.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/debug
examples=$bin/examples
for b in bench_aggregate bench_download bench_agent bench_learning fl_digits bench_async bench_rounds bench_secagg bench_dp; do
    [ -x "$examples/$b" ] || { echo "benches/smoke.sh: $examples/$b is missing; run cargo test --workspace first" >&2; exit 2; }
done

step() {
    echo "== $*"
    local t0=$SECONDS
    "$@" > target/bench-smoke.log 2>&1 || { cat target/bench-smoke.log; echo "benches/smoke.sh: FAILED: $*" >&2; exit 1; }
    tail -n 4 target/bench-smoke.log
    echo "   ($((SECONDS - t0)) s)"
}

step "$examples/bench_aggregate" --params 1000 --updates 2,4 --e2e-max 4 --device cpu
if "$examples/bench_aggregate" --params 1000 --updates 2 --e2e-max 2 --device gpu > target/bench-smoke.log 2>&1; then
    echo "== bench_aggregate --device gpu (benches/gpu.sh's code path)"; tail -n 3 target/bench-smoke.log
else
    echo "== bench_aggregate --device gpu: no wgpu adapter here ($(tail -n 1 target/bench-smoke.log))"
fi
step "$examples/bench_download" 2 1
step "$examples/bench_agent"
step "$examples/bench_learning" --quick
step "$examples/fl_digits" --clients 4 --rounds 1 --epochs 1
step "$examples/bench_async" --devices 8 --buffer 2 --max-versions 3
step "$examples/bench_secagg" --devices 8,12 --dim 100
step "$examples/bench_dp" --devices 20 --rounds 3 --epsilons 8
step "$examples/bench_rounds" --agents 3 --rounds 1 --aggregator-bin "$bin/fedfleet-aggregator" --no-daemon --rollout --pushed-rounds
step "$examples/bench_rounds" --agents 3 --rounds 1 --aggregator-bin "$bin/fedfleet-aggregator" --no-daemon --light --rollout --mirror
step "$examples/bench_rounds" --agents 5 --rounds 1 --aggregator-bin "$bin/fedfleet-aggregator" --no-daemon --light --secure-aggregation
step "$examples/bench_rounds" --agents 5 --rounds 1 --aggregator-bin "$bin/fedfleet-aggregator" --no-daemon --light --mqtt-uploads --upload-burst
step "$examples/bench_rounds" --agents 5 --rounds 1 --aggregator-bin "$bin/fedfleet-aggregator" --no-daemon --light --mqtt-uploads --embedded-broker
step "$examples/bench_rounds" --agents 5 --rounds 1 --aggregator-bin "$bin/fedfleet-aggregator" --no-daemon --light --relays 2 --aggregator-workers 1 --round-bases-from-aggregator --upload-burst
step "$examples/bench_rounds" --agents 200 --rounds 2 --aggregator-bin "$bin/fedfleet-aggregator" --no-daemon --sampled \
    --sampling-rate 0.2 --train-median-ms 50 --availability 1 --diurnal 0 --dropout 0 --timeout-secs 300
echo "benches/smoke.sh: every benchmark ran"

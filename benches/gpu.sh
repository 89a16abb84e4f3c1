#!/usr/bin/env bash
# The GPU benchmark, ready for the day a real GPU is available: builds the aggregator with
# burn's wgpu backend and prints, in one run, the exact CPU fold (the service's default), the
# tensor fold on the GPU (host->device upload included), one FedAdam server step on the GPU
# beside the same step in the exact CPU backend, the GPU's memory bandwidth (an `a + b` on the
# device, synced) and the host<->device transfer rate, for P up to 100M parameters and N up to
# 1,000 updates.
#
#   bash benches/gpu.sh            # P = 1M,10M,100M; N = 10,100,1000
#   bash benches/gpu.sh --quick    # P = 1M,10M;      N = 10,100
#
# On a machine that cannot build (a lent GPU machine with no registry access), build here with
# the line below, carry the binary and point BENCH_BIN at it: the build step is skipped.
#   CARGO_TARGET_DIR=target/gpu cargo build --release -p fedfleet-aggregator --features wgpu --example bench_aggregate
#   BENCH_BIN=target/gpu/release/examples/bench_aggregate bash benches/gpu.sh
#
# Needs a wgpu adapter (Vulkan, Metal, DX12 or GL); with none it stops with one line saying
# what it looked for. On a machine without a GPU, Mesa's software Vulkan driver (Debian
# package mesa-vulkan-drivers: lavapipe) makes it run on the CPU: the figures are then not GPU
# speed. The build goes to target/gpu so the default (CPU-only) build is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."

params=1000000,10000000,100000000
updates=10,100,1000
e2e_max=100
if [ "${1:-}" = "--quick" ]; then
    params=1000000,10000000
    updates=10,100
    shift
fi
if [ "$#" -gt 0 ]; then
    echo "usage: bash benches/gpu.sh [--quick]" >&2
    exit 2
fi

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/gpu}"
bin="${BENCH_BIN:-$CARGO_TARGET_DIR/release/examples/bench_aggregate}"
if [ -z "${BENCH_BIN:-}" ]; then
    cargo build --release -p fedfleet-aggregator --features wgpu --example bench_aggregate
fi
echo "machine: $(nproc) CPU cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
exec "$bin" \
    --params "$params" --updates "$updates" --e2e-max "$e2e_max" --device gpu

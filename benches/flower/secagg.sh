#!/usr/bin/env bash
# SecAgg+ cost: fedfleet's services and protocol cores beside Flower's SecAggPlusWorkflow, with
# and without secure aggregation, at the same N, in one invocation. See benches/flower/README.md,
# section "Secure aggregation".
#
#   bash benches/flower/secagg.sh [--clients 20,100,500] [--rounds 2] [--degree 16]
#
# Builds fedfleet's dev-profile binaries (optimized; what bench_rounds' secure figures in
# benches/README.md use), creates benches/flower/.venv with the pinned flwr[simulation] on first
# use, then runs secagg_compare.py. The output is also written to benches/flower/out/secagg-last-run.txt.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
ensure_venv "flwr, numpy, ray"
export RAY_DEDUP_LOGS=0 RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0
cd "$REPO"
cargo build -q -p fedfleet-aggregator -p fedfleet-registry -p fedfleet-agent -p fedfleet-certs --bins
cargo build -q -p fedfleet --example bench_rounds
cargo build -q -p fedfleet-secagg --example bench_secagg
ulimit -n 20000 2>/dev/null || true
"$VENV/bin/python" "$HERE/secagg_compare.py" "$@" 2>&1 | tee "$HERE/out/secagg-last-run.txt"
exit "${PIPESTATUS[0]}"

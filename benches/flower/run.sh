#!/usr/bin/env bash
# fedfleet vs Flower (flwr), side by side. See benches/flower/README.md.
#
#   bash benches/flower/run.sh [--quick] [--skip-sim] [--skip-agg] [--actors K] [--flower-mem-gib G]
#
# Creates benches/flower/.venv (python3 -m venv) with the pinned flwr[simulation] + numpy on
# first use, then runs compare.py, which runs both sides in this one invocation and prints the
# table. The full output is also written to benches/flower/out/last-run.txt.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
ensure_venv "flwr, numpy, ray"
export RAY_DEDUP_LOGS=0 RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0
cd "$REPO"
"$VENV/bin/python" "$HERE/compare.py" "$@" 2>&1 | tee "$HERE/out/last-run.txt"
exit "${PIPESTATUS[0]}"

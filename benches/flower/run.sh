#!/usr/bin/env bash
# fedfleet vs Flower (flwr), side by side. See benches/flower/README.md.
#
#   bash benches/flower/run.sh [--quick] [--skip-sim] [--skip-agg] [--actors K] [--flower-mem-gib G]
#
# Creates benches/flower/.venv (python3 -m venv) with the pinned flwr[simulation] + numpy on
# first use, then runs compare.py, which runs both sides in this one invocation and prints the
# table. The full output is also written to benches/flower/out/last-run.txt.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENV="$HERE/.venv"
PYTHON="${PYTHON:-python3}"

if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c 'import flwr, numpy, ray' 2>/dev/null; then
    echo "setting up $VENV (flwr[simulation], numpy from PyPI) ..." >&2
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q -r "$HERE/requirements.txt"
fi

# Same conditions for both sides: fedfleet's burn/flex backend is single-threaded, so keep
# numpy's BLAS single-threaded too. Ray workers inherit this environment.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
export RAY_DEDUP_LOGS=0 RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0
mkdir -p "$HERE/out"
cd "$REPO"
"$VENV/bin/python" "$HERE/compare.py" "$@" 2>&1 | tee "$HERE/out/last-run.txt"
exit "${PIPESTATUS[0]}"

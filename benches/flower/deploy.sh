#!/usr/bin/env bash
# fedfleet's services vs Flower's deployment runtime, side by side on loopback, in one
# invocation. See benches/flower/README.md, section "Deployment runtimes".
#
#   bash benches/flower/deploy.sh [--nodes 10,50,100] [--rounds 20] [--bin-dir DIR]
#                                 [--skip-fedfleet] [--skip-flower] [--flower-max-nodes N] ...
#   bash benches/flower/deploy.sh --help      # every flag
#
# Creates benches/flower/.venv (python3 -m venv) with the pinned flwr + numpy on first use (the
# same venv as run.sh), then runs deploy_bench.py, which starts both deployments for every N and
# prints the tables. fedfleet's release binaries must be built first (default --bin-dir
# target/release; set CARGO_TARGET_DIR's release directory otherwise):
#
#   cargo build --release -p fedfleet-certs -p fedfleet-registry -p fedfleet-aggregator \
#       -p fedfleet-agent -p fedfleet-learning --bins --example fl_digits
#
# The full output is also written to benches/flower/out/deploy-last-run.txt; logs, PKI, configs
# and the raw results of each N stay in benches/flower/out/deploy/n<N>/.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
ensure_venv "flwr, numpy, cryptography" flower-superlink
cd "$REPO"
"$VENV/bin/python" "$HERE/deploy_bench.py" "$@" 2>&1 | tee "$HERE/out/deploy-last-run.txt"
exit "${PIPESTATUS[0]}"

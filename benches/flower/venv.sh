# Sourced by run.sh and deploy.sh: the bench's virtualenv and the environment both sides run in.
#
#   ensure_venv "flwr, numpy, ray" [EXECUTABLE]
# (re)creates $VENV from requirements.txt (pinned, PyPI) unless it imports those modules and
# has EXECUTABLE in its bin/.

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENV="$HERE/.venv"
PYTHON="${PYTHON:-python3}"

ensure_venv() {
    local modules="$1" executable="${2:-python}"
    if [[ ! -x "$VENV/bin/$executable" ]] || ! "$VENV/bin/python" -c "import $modules" 2>/dev/null; then
        echo "setting up $VENV ($modules from PyPI) ..." >&2
        "$PYTHON" -m venv "$VENV"
        "$VENV/bin/pip" install -q --upgrade pip
        "$VENV/bin/pip" install -q -r "$HERE/requirements.txt"
    fi
}

# Same conditions for both sides: fedfleet's burn/flex training is single-threaded, so keep
# numpy's BLAS single-threaded too (Ray workers and SuperNodes' ClientApps inherit this).
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$HERE/out"

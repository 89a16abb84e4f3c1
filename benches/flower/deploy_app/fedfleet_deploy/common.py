"""Shared by the ClientApp and the ServerApp: finds fl_numpy (benches/flower) from the run config."""

from __future__ import annotations

import os
import sys


def fl_numpy(run_config):
    bench = str(run_config.get("bench-dir", "") or os.environ.get("FEDFLEET_BENCH_DIR", ""))
    if bench and bench not in sys.path:
        sys.path.insert(0, bench)
    import fl_numpy as fn  # noqa: PLC0415

    return fn

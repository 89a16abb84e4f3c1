#!/usr/bin/env python3
"""Cuts a fuzz corpus down to at most CAP files / MAX_BYTES bytes, keeping as much coverage as fits.

    python3 pick_subset.py target/x86_64-unknown-linux-gnu/release/<target> corpus/<target> [CAP] [MAX_BYTES]

`cargo fuzz cmin` keeps one input per new feature, which for these decoders is often thousands of
files. This script runs the built fuzz target on each corpus file alone (libFuzzer's
`-merge_inner` step, so it gets each file's full edge and feature sets), then greedily picks files:
first to cover every edge, then every feature, until the cap. Files not picked are deleted. It
prints how many edges and features the kept files cover, out of all of them.
"""

import os
import subprocess
import sys
import tempfile

binary, corpus = sys.argv[1], sys.argv[2]
cap = int(sys.argv[3]) if len(sys.argv) > 3 else 300
max_bytes = int(sys.argv[4]) if len(sys.argv) > 4 else 2_000_000

files = sorted(os.listdir(corpus))
features, edges, size = {}, {}, {}
fd, control = tempfile.mkstemp()
os.close(fd)
for name in files:
    path = os.path.join(corpus, name)
    size[name] = os.path.getsize(path)
    with open(control, "w") as f:
        f.write(f"1\n0\n{path}\n")
    subprocess.run(
        [binary, "-merge_inner=1", f"-merge_control_file={control}", "-rss_limit_mb=2048", "-timeout=10"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    features[name], edges[name] = set(), set()
    with open(control) as f:
        for line in f:
            words = line.split()
            if words and words[0] == "FT":
                features[name] = set(map(int, words[2:]))
            elif words and words[0] == "COV":
                edges[name] = set(map(int, words[2:]))
os.remove(control)

chosen, total = [], 0


def greedy(sets):
    global total
    covered = set().union(*(sets[n] for n in chosen))
    while len(chosen) < cap:
        best, gain = None, 0
        for n in files:
            if n in chosen or total + size[n] > max_bytes:
                continue
            g = len(sets[n] - covered)
            if g > gain or (g == gain and g > 0 and size[n] < size[best]):
                best, gain = n, g
        if best is None:
            break
        chosen.append(best)
        covered |= sets[best]
        total += size[best]


greedy(edges)
greedy(features)
all_edges = set().union(*edges.values())
all_features = set().union(*features.values())
kept_edges = set().union(*(edges[n] for n in chosen))
kept_features = set().union(*(features[n] for n in chosen))
print(
    f"{os.path.basename(corpus.rstrip('/'))}: files {len(files)} -> {len(chosen)}, bytes {total}, "
    f"edges {len(kept_edges)}/{len(all_edges)}, features {len(kept_features)}/{len(all_features)}"
)
if len(files) > cap:
    for n in files:
        if n not in chosen:
            os.remove(os.path.join(corpus, n))

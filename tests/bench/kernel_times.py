#!/usr/bin/env python3
"""Sums the kernel times of an `ncu --csv --metrics gpu__time_duration.sum` log per kernel name.

Usage: kernel_times.py NCU_CSV STEPS LAYERS
Prints, per kernel name (templates cut at "<" or "("), the launches per step, the microseconds
per step and per layer, and the share of the step's kernel time; then the total per step.
"""
import csv
import sys
from collections import defaultdict


def main() -> int:
    path, steps, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rows = []
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "nsecond")
        scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}.get(unit, 1e-3)
        name = r["Kernel Name"].replace("<unnamed>::", "").replace("(anonymous namespace)::", "")
        name = name.removeprefix("void ")
        for cut in ("<", "("):
            if cut in name:
                name = name.split(cut)[0]
        name = name.split("::")[-1]
        rows.append((name.strip(), v * scale))
    if not rows:
        print(f"{path}: no kernel times")
        return 1
    per = defaultdict(lambda: [0, 0.0])
    for name, us in rows:
        per[name][0] += 1
        per[name][1] += us
    total = sum(us for _, us in rows)
    print(f"{len(rows)} kernels over {steps} steps: {total / steps:.1f} us of kernels per step, "
          f"{total / steps / layers:.1f} per layer, {len(rows) / steps / layers:.1f} launches "
          f"per layer")
    print(f"{'kernel':<48} {'per step':>8} {'us/step':>9} {'us/layer':>9} {'share':>6}")
    for name, (n, us) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        print(f"{name[:48]:<48} {n / steps:8.1f} {us / steps:9.1f} {us / steps / layers:9.2f} "
              f"{us / total:6.1%}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # piped into head
        sys.exit(0)

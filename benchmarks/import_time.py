"""Cost of `import aiak` against `import torch`, each in fresh interpreters, measured in one run.

Goal: at most 1.2x `import torch` (aiak's own modules load lazily; no optional dependency).

    python benchmarks/import_time.py [--repeats 7]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def time_import(stmt: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", stmt], check=True, capture_output=True)
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    stmts = {"import torch": "import torch", "import aiak": "import aiak",
             "import aiak + aiak.optimize": "import aiak; aiak.optimize"}
    time_import("import torch")  # warm the file cache
    samples = {k: [] for k in stmts}
    for _ in range(args.repeats):
        for k, stmt in stmts.items():
            samples[k].append(time_import(stmt))
    base = statistics.median(samples["import torch"])
    print(f"median of {args.repeats} fresh interpreters")
    print(f"{'statement':<30} {'seconds':>8} {'ratio':>6}")
    for k in stmts:
        t = statistics.median(samples[k])
        print(f"{k:<30} {t:>8.3f} {t / base:>6.2f}")
    # `import aiak` alone is lazy and loads almost nothing; the honest figure is the whole API loaded.
    ratio = statistics.median(samples["import aiak + aiak.optimize"]) / base
    print(f"\n(import aiak; aiak.optimize) / import torch = {ratio:.2f} (goal <= 1.2): "
          f"{'PASS' if ratio <= 1.2 else 'FAIL'}")


if __name__ == "__main__":
    main()

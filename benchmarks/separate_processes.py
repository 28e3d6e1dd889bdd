"""Plain PyTorch against aiak with each side in processes of its own: what in-process rounds cannot time.

A process-wide setting that cannot be undone, glibc malloc's thresholds fixed by ``malloc_retain``
(`aiak.runtime.malloc`), reaches every contender of a process once one applied it: ``aiak demo``, ``aiak bench`` and
``benchmarks/auto.py`` leave its gain out. Here each side runs in child processes of its own, for each model of
``benchmarks/auto.py`` (its synthetic images, batch and SGD or AdamW optimizer):

* ``plain``: the model, optimizer and loader as built;
* ``retain``: the same after ``aiak.optimize(model, optimizer, strategy={"malloc_retain": True})``, nothing else on;
* ``auto``: the same after ``aiak.optimize(model, optimizer, loader)`` with an empty tuning cache, as a script does:
  its trials and its guard's windows are paid in the run.

Each child takes ``--warmup`` steps, then times ``--steps`` (from fetching the batch to the end of the optimizer
step) and counts the process's minor page faults over them (``getrusage``); it also times the whole run, from
before ``optimize()`` to the end of its last step, warm-up included. Rounds alternate which side runs first; each
round pairs the two sides into ratios (the first side over the second): of their median steps, and of their whole
runs, each given as the median over rounds with its p10-p90. ``--sides plain,auto --warmup 0 --steps 200`` is
``auto`` against plain over a 200-step run, everything included but Python's start and the model's construction.

    python benchmarks/separate_processes.py [--sides plain,retain] [--models demo,vit,...] [--rounds 5]
                                            [--warmup 5] [--steps 15] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from aiak.measure.rounds import percentile  # noqa: E402

SIDES = ("plain", "retain", "auto")


def child(model: str, side: str, warmup: int, steps: int) -> Dict[str, float]:
    """One side's run in this process: its median step in ms, the minor page faults per timed step, and the whole
    run's seconds (``optimize()`` and every step)."""
    import auto

    import aiak
    from aiak.runtime import malloc

    case = auto.CASES[model]
    setup = auto.make_setup(case, case.batch_size, case.batch_size * 32)
    model_, optimizer, loader = setup.model, setup.optimizer, setup.loader
    start_run = time.perf_counter()
    if side == "retain":
        model_, optimizer, _ = aiak.optimize(model_, optimizer, strategy={"malloc_retain": True})
        if not malloc.read():
            raise SystemExit("malloc_retain did not apply (not glibc?)")
    elif side == "auto":
        os.environ["AIAK_TUNE_CACHE"] = os.path.join(tempfile.mkdtemp(), "cache.json")
        model_, optimizer, loader = aiak.optimize(model_, optimizer, loader)
    contender = auto.Contender(side, model_, optimizer, loader)
    for _ in range(warmup):
        contender.step()
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        contender.step()
        times.append(time.perf_counter() - t0)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / steps
    return {"ms": statistics.median(times) * 1e3, "faults": faults, "run_s": time.perf_counter() - start_run}


def run_child(model: str, side: str, warmup: int, steps: int) -> Dict[str, float]:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", model, side, "--warmup", str(warmup),
                          "--steps", str(steps)], capture_output=True, text=True, timeout=900, cwd=HERE)
    if out.returncode != 0:
        raise RuntimeError(f"{model} {side}: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ''}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def spread(ratios: List[float]) -> str:
    return f"{statistics.median(ratios):.3f}x ({percentile(ratios, 10):.3f}-{percentile(ratios, 90):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sides", default="plain,retain", help=f"two of {', '.join(SIDES)}: the first is the "
                                                                 f"numerator of each ratio")
    parser.add_argument("--models", default="demo,vit,swin,mlp,mobilenet,nfnet,resnet50,vit_small")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "SIDE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.warmup, args.steps)))
        return
    sides = args.sides.split(",")
    if len(sides) != 2 or not set(sides) <= set(SIDES) or sides[0] == sides[1]:
        parser.error(f"--sides: two different of {', '.join(SIDES)}, got {args.sides!r}")
    a, b = sides

    rows = []
    print(f"{a} against {b}, each in child processes of its own, {args.rounds} rounds alternating which runs first; "
          f"{args.warmup} warm-up + {args.steps} timed steps a child; ratios {a} / {b}, median (p10-p90)")
    print(f"{'model':<11} {a + ' ms':>11} {'faults':>7} {b + ' ms':>11} {'faults':>7}  {'step ratio':<24} "
          f"{a + ' run s':>11} {b + ' run s':>11}  {'whole-run ratio':<24}")
    for model in args.models.split(","):
        runs: Dict[str, List[Dict[str, float]]] = {a: [], b: []}
        for r in range(args.rounds):
            for side in ((a, b) if r % 2 == 0 else (b, a)):
                runs[side].append(run_child(model, side, args.warmup, args.steps))
        step_ratios = [x["ms"] / y["ms"] for x, y in zip(runs[a], runs[b])]
        run_ratios = [x["run_s"] / y["run_s"] for x, y in zip(runs[a], runs[b])]
        row = {"model": model, "sides": sides, "ratios": step_ratios, "run_ratios": run_ratios,
               **{f"{side}_{k}": statistics.median(s[k] for s in results) for side, results in runs.items()
                  for k in ("ms", "faults", "run_s")}}
        rows.append(row)
        print(f"{model:<11} {row[a + '_ms']:11.2f} {row[a + '_faults']:7.0f} {row[b + '_ms']:11.2f} "
              f"{row[b + '_faults']:7.0f}  {spread(step_ratios):<24} {row[a + '_run_s']:11.2f} "
              f"{row[b + '_run_s']:11.2f}  {spread(run_ratios):<24}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

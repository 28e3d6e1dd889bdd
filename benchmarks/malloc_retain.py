"""``malloc_retain``: plain PyTorch training steps with glibc malloc's thresholds fixed against glibc's own, A/B.

glibc adapts its malloc thresholds as a process runs, and a process cannot turn that adapting on again once the
thresholds were fixed (`aiak.runtime.malloc`), so each side runs in processes of its own: for each model of
``benchmarks/auto.py`` (its synthetic images, batch and SGD or AdamW optimizer), one child process trains plain
PyTorch as built, the other the same after ``aiak.optimize(model, optimizer, strategy={"malloc_retain": True})``
(nothing else turned on). Each child takes ``--warmup`` steps, then times ``--steps`` (from fetching the batch to
the end of the optimizer step) and counts the process's minor page faults over them (``getrusage``). Rounds
alternate which side runs first; each round pairs the two sides' median steps into a ratio (plain / retained),
given as the median over rounds with its p10-p90. A child that is not glibc's says so and the side is skipped.

    python benchmarks/malloc_retain.py [--models demo,vit,...] [--rounds 5] [--steps 15] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from aiak.measure.rounds import percentile  # noqa: E402


def child(model: str, side: str, warmup: int, steps: int) -> Dict[str, float]:
    """One side's steps in this process: the median step in ms and the minor page faults per step."""
    import auto

    import aiak
    from aiak.runtime import malloc

    case = auto.CASES[model]
    setup = auto.make_setup(case, case.batch_size, case.batch_size * (warmup + steps + 2))
    model_, optimizer = setup.model, setup.optimizer
    if side == "retain":
        model_, optimizer, _ = aiak.optimize(model_, optimizer, strategy={"malloc_retain": True})
        if not malloc.read():
            raise SystemExit("malloc_retain did not apply (not glibc?)")
    contender = auto.Contender(side, model_, optimizer, setup.loader)
    for _ in range(warmup):
        contender.step()
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        contender.step()
        times.append(time.perf_counter() - t0)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / steps
    return {"ms": statistics.median(times) * 1e3, "faults": faults}


def run_child(model: str, side: str, warmup: int, steps: int) -> Dict[str, float]:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", model, side, "--warmup", str(warmup),
                          "--steps", str(steps)], capture_output=True, text=True, timeout=900, cwd=HERE)
    if out.returncode != 0:
        raise RuntimeError(f"{model} {side}: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ''}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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

    rows = []
    print(f"plain PyTorch steps with glibc's malloc thresholds (plain) and fixed by malloc_retain (retained), "
          f"{args.rounds} rounds of one child process each, {args.warmup} warm-up + {args.steps} timed steps")
    print(f"{'model':<11} {'plain ms':>9} {'faults/step':>11} {'retained ms':>11} {'faults/step':>11}  "
          f"{'plain / retained (p10-p90)':<26}")
    for model in args.models.split(","):
        sides: Dict[str, List[Dict[str, float]]] = {"plain": [], "retain": []}
        for r in range(args.rounds):
            for side in (("plain", "retain") if r % 2 == 0 else ("retain", "plain")):
                sides[side].append(run_child(model, side, args.warmup, args.steps))
        ratios = [p["ms"] / q["ms"] for p, q in zip(sides["plain"], sides["retain"])]
        row = {"model": model, "ratios": ratios,
               **{f"{side}_{k}": statistics.median(s[k] for s in runs) for side, runs in sides.items()
                  for k in ("ms", "faults")}}
        rows.append(row)
        print(f"{model:<11} {row['plain_ms']:9.2f} {row['plain_faults']:11.0f} {row['retain_ms']:11.2f} "
              f"{row['retain_faults']:11.0f}  {statistics.median(ratios):.3f}x ({percentile(ratios, 10):.3f}-"
              f"{percentile(ratios, 90):.3f})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

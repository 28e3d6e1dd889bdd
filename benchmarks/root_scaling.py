"""What a factor at the backward's root costs per backward pass (:mod:`aiak.amp.scaling.root_scaling`): fp16 loss scaling,
and counted items (``aiak.count_items``).

    python benchmarks/root_scaling.py [--rounds 15] [--models mlp,deep,resnet50] [--factors fp16,items]

For an fp16 model, every backward pass that reaches its parameters walks the autograd graph once (to find the
leaves and the loss scalers), multiplies the root gradients by the scale and registers a pre-hook on each leaf's
``AccumulateGrad`` node that divides what arrives. This script times that: each model under
``aiak.optimize(..., strategy={"precision": {"level": "O2", "dtype": "fp16", "loss_scale": 128}})``, one forward
and backward per sample, two ways alternating in rounds (both warmed up first):

* ``root``: as aiak runs it, through the wrapper around torch's ``_engine_run_backward``;
* ``bare``: the same forward and backward with torch's own ``_engine_run_backward`` put back for the pass (no
  walk, no hooks; the gradients are then scaled, which the timing does not care about).

It prints, per model, the forward + backward time of each (median of rounds), the difference per backward (median
of the per-round differences, with their min-max) and the ratio root / bare. fp16 is emulated on most CPUs, so
the forward and backward themselves are slow here; the difference is what the wrapper adds, whatever the device.
Also printed: how many graph nodes and leaves the walk visits.

``--factors items`` times the same two ways for an fp32 model under ``grad_accumulation: 4`` with a count
pending (``aiak.count_items(optimizer, 32)``): the walk and one multiply at the root, no hook on the counted
parameters. That is what counting adds to each micro-step's backward.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch import nn

import aiak
from aiak.amp.scaling import root_scaling


def _models():
    import torchvision

    def mlp():
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)), torch.randn(32, 64)

    def deep():
        layers = [m for _ in range(200) for m in (nn.Linear(64, 64), nn.ReLU())]
        return nn.Sequential(*layers, nn.Linear(64, 10)), torch.randn(32, 64)

    def resnet50():
        return torchvision.models.resnet50(num_classes=10), torch.randn(2, 3, 32, 32)

    return {"mlp": mlp, "deep": deep, "resnet50": resnet50}


def _step(model, x) -> None:
    model(x).float().square().mean().backward()
    for p in model.parameters():
        p.grad = None


def _time(fn, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


STRATEGIES = {"fp16": {"precision": {"level": "O2", "dtype": "fp16", "loss_scale": 128}, "tune": False},
              "items": {"grad_accumulation": 4, "tune": False}}


def measure(name: str, build, rounds: int, repeats: int, factor: str = "fp16") -> dict:
    torch.manual_seed(0)
    model, x = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, _ = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                            strategy=STRATEGIES[factor], count_items=factor == "items" or None)
    if factor == "items":
        aiak.count_items(optimizer, 32)  # pending until a step(), which this timing never takes
    wrapped = torch.autograd.graph._engine_run_backward
    bare = root_scaling._original

    def run_root():
        _step(model, x)

    def run_bare():
        torch.autograd.graph._engine_run_backward = torch.autograd._engine_run_backward = bare
        try:
            _step(model, x)
        finally:
            torch.autograd.graph._engine_run_backward = torch.autograd._engine_run_backward = wrapped

    out = model(x).float().square().mean()
    leaves = root_scaling._walk([out])[0]
    seen = _count_nodes(out)
    out.backward()
    for fn in (run_root, run_bare, run_root, run_bare):   # warm-up
        fn()
    root_s, bare_s = [], []
    for r in range(rounds):
        order = (run_root, run_bare) if r % 2 == 0 else (run_bare, run_root)
        for fn in order:
            (root_s if fn is run_root else bare_s).append(_time(fn, repeats))
    diffs = [a - b for a, b in zip(root_s, bare_s)]
    ratios = [a / b for a, b in zip(root_s, bare_s)]
    return {"model": f"{name} {factor}", "nodes": seen, "leaves": len(leaves), "root_ms": statistics.median(root_s) * 1e3,
            "bare_ms": statistics.median(bare_s) * 1e3, "diff_us": statistics.median(diffs) * 1e6,
            "diff_min_us": min(diffs) * 1e6, "diff_max_us": max(diffs) * 1e6,
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def _count_nodes(root: torch.Tensor) -> int:
    seen, stack = set(), [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        stack.extend(n for n, _ in node.next_functions)
    return len(seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=5, help="forward + backward passes per sample")
    ap.add_argument("--models", default="mlp,deep,resnet50")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--factors", default="fp16,items", help="fp16 (O2 fp16, static scale 128) and/or items (fp32, "
                                                             "accumulation 4, a count pending)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    builders = _models()
    print(f"forward + backward; {args.rounds} alternating rounds of {args.repeats} passes, "
          f"{args.threads} thread(s); median (min-max over rounds)")
    print(f"{'model':<16} {'nodes':>6} {'leaves':>6} {'root ms':>9} {'bare ms':>9} {'root - bare us':>24} "
          f"{'root / bare':>22}")
    for factor in args.factors.split(","):
        for name in args.models.split(","):
            row = measure(name, builders[name], args.rounds, args.repeats, factor)
            print(f"{row['model']:<16} {row['nodes']:>6} {row['leaves']:>6} {row['root_ms']:>9.2f} "
                  f"{row['bare_ms']:>9.2f} {row['diff_us']:>9.0f} ({row['diff_min_us']:.0f} to "
                  f"{row['diff_max_us']:.0f}) {row['ratio']:>8.3f} ({row['ratio_min']:.3f}-{row['ratio_max']:.3f})")


if __name__ == "__main__":
    main()

"""Per-step overhead of aiak.optimize on a tiny model, against a plain loop measured in the same run.

Goal: strategy="default" costs at most 1.03x a plain PyTorch step. The other rows show what the
step controller and the precision hooks cost when they have work to do (accumulation, O2) on a model this small,
where the framework's bookkeeping is most visible.

    python benchmarks/overhead.py [--steps 300] [--repeats 7] [--quick]
    python benchmarks/overhead.py --layers 500   # 1002 parameter tensors: the per-parameter hooks' cost

With ``--layers N`` the model is N blocks of Linear(64, 64) + ReLU and a Linear(64, 10) head (2N + 2
parameter tensors, few FLOPs each): the step controller's post-accumulate hook on every parameter, and the
precision hooks on every module, are then what a step mostly does, a worst case for their per-step cost.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
from torch import nn

import aiak


def make(layers=0, seed=0):
    torch.manual_seed(seed)
    if layers:
        blocks = [m for _ in range(layers) for m in (nn.Linear(64, 64), nn.ReLU())]
        model = nn.Sequential(*blocks, nn.Linear(64, 10))
    else:
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def time_loop(model, opt, x, y, steps) -> float:
    crit = nn.CrossEntropyLoss()
    start = time.perf_counter()
    for _ in range(steps):
        crit(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - start) / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", type=int, default=0, help="N Linear(64, 64) blocks instead of the tiny MLP")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.repeats = 50, 3
    logging.getLogger("aiak").setLevel(logging.WARNING)
    torch.set_num_threads(1)  # a tiny model: threads only add noise
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    cases = {
        "plain PyTorch": None,
        "default": "default",
        "grad_accumulation 4": {"grad_accumulation": 4},
        "O2 bf16": {"precision": {"level": "O2", "dtype": "bf16"}},
    }
    setups = {}
    for name, strategy in cases.items():
        model, opt = make(args.layers)
        if strategy is not None:
            model, opt, _ = aiak.optimize(model, opt, strategy=strategy)
        time_loop(model, opt, x, y, 20)  # warm-up
        setups[name] = (model, opt)
    samples = {name: [] for name in cases}
    for _ in range(args.repeats):  # interleaved, so drift hits every case alike
        for name, (model, opt) in setups.items():
            samples[name].append(time_loop(model, opt, x, y, args.steps))
    tensors = sum(1 for _ in setups["plain PyTorch"][0].parameters())
    what = f"{args.layers} x Linear(64, 64) + ReLU" if args.layers else "tiny MLP (64-128-10)"
    print(f"{what}, {tensors} parameter tensors, batch 32, SGD momentum; median of {args.repeats} x {args.steps} "
          "steps, 1 thread; ratio: to plain in the same repeat, median (min-max)")
    print(f"{'case':<22} {'us/step':>9} {'ratio':>7}  spread")
    for name in cases:
        t = statistics.median(samples[name])
        ratios = [a / b for a, b in zip(samples[name], samples["plain PyTorch"])]
        print(f"{name:<22} {t * 1e6:>9.1f} {statistics.median(ratios):>7.3f}  ({min(ratios):.3f}-{max(ratios):.3f})")
    ratio = statistics.median(a / b for a, b in zip(samples["default"], samples["plain PyTorch"]))
    print(f"\ndefault / plain = {ratio:.3f} (goal <= 1.03): {'PASS' if ratio <= 1.03 else 'FAIL'}")

if __name__ == "__main__":
    main()

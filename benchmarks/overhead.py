"""Per-step overhead of aiak.optimize on a tiny model, against a plain loop measured in the same run.

Goal: strategy="default" costs at most 1.03x a plain PyTorch step. The other rows show what the
step controller and the precision hooks cost when they have work to do (accumulation, O2) on a model this small,
where the framework's bookkeeping is most visible. Every case iterates its loader (the one ``optimize`` returns:
with accumulation it closes windows at the epoch's end); the counted rows weigh each micro-batch by its items
(``count_items=fn`` from the loader, a 0-dim tensor; ``aiak.count_items(optimizer, 32)`` in the loop, a number),
and the last line gives what counting adds per micro-step against uncounted accumulation.

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


def time_loop(model, opt, loader, count_in_loop=False) -> float:
    crit = nn.CrossEntropyLoss()
    start = time.perf_counter()
    steps = 0
    for x, y in loader:
        if count_in_loop:
            aiak.count_items(opt, len(y))
        crit(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        steps += 1
    return (time.perf_counter() - start) / steps


def count_labels(batch):
    return (batch[1] >= 0).sum()


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
    batches = [(x, y)] * args.steps
    accumulate = {"grad_accumulation": 4}
    cases = {  # name: (strategy, count_items given to optimize, aiak.count_items called in the loop)
        "plain PyTorch": (None, None, False),
        "default": ("default", None, False),
        "grad_accumulation 4": (accumulate, None, False),
        "  counted by loader": (accumulate, count_labels, False),
        "  counted in loop": (accumulate, True, True),
        "O2 bf16": ({"precision": {"level": "O2", "dtype": "bf16"}}, None, False),
    }
    setups = {}
    for name, (strategy, count_items, in_loop) in cases.items():
        model, opt = make(args.layers)
        loader = batches
        if strategy is not None:
            model, opt, loader = aiak.optimize(model, opt, batches, strategy=strategy, count_items=count_items)
        time_loop(model, opt, loader[:20] if isinstance(loader, list) else loader, in_loop)  # warm-up
        setups[name] = (model, opt, loader, in_loop)
    samples = {name: [] for name in cases}
    for _ in range(args.repeats):  # interleaved, so drift hits every case alike
        for name, (model, opt, loader, in_loop) in setups.items():
            samples[name].append(time_loop(model, opt, loader, in_loop))
    tensors = sum(1 for _ in setups["plain PyTorch"][0].parameters())
    what = f"{args.layers} x Linear(64, 64) + ReLU" if args.layers else "tiny MLP (64-128-10)"
    print(f"{what}, {tensors} parameter tensors, batch 32, SGD momentum; median of {args.repeats} x {args.steps} "
          "steps, 1 thread; ratio: to plain in the same repeat, median (min-max)")
    print(f"{'case':<22} {'us/step':>9} {'ratio':>7}  spread")
    for name in cases:
        t = statistics.median(samples[name])
        ratios = [a / b for a, b in zip(samples[name], samples["plain PyTorch"])]
        print(f"{name:<22} {t * 1e6:>9.1f} {statistics.median(ratios):>7.3f}  ({min(ratios):.3f}-{max(ratios):.3f})")
    for name in ("  counted by loader", "  counted in loop"):
        extra = [(a - b) * 1e6 for a, b in zip(samples[name], samples["grad_accumulation 4"])]
        print(f"counting ({name.strip()}): {statistics.median(extra):+.1f} us per micro-step against uncounted "
              f"accumulation ({min(extra):+.1f} to {max(extra):+.1f})")
    ratio = statistics.median(a / b for a, b in zip(samples["default"], samples["plain PyTorch"]))
    print(f"\ndefault / plain = {ratio:.3f} (goal <= 1.03): {'PASS' if ratio <= 1.03 else 'FAIL'}")

if __name__ == "__main__":
    main()

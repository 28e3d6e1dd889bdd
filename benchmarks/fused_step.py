"""``optimizer.fused``: the script's torch optimizer stepping torch's fused kernel against its default, in one run.

Torch steps Adam, AdamW, SGD and Adagrad in a loop over the parameters on a CPU unless told otherwise; aiak's
``optimizer: {fused: true}`` (on in ``auto``) turns on their ``fused=True`` kernel (`aiak.optim.fused_step`).
For each optimizer and parameter set, the same optimizer twice from the same state: as the script built it, and
after ``aiak.optimize(strategy={"optimizer": {"fused": True}})``. Only ``optimizer.step()`` is timed, the
gradients fixed. Both are warmed up, then timed round-robin (`optimizers.time_round_robin`, the order shuffled
each round); the table gives each step's median with its p10-p90, and the ratio default / fused paired within
each round, median with its p10-p90. Parameter sets (random, no model built):

* ``resnet50``: the parameter shapes of a ResNet-50 (25.6M in 161 tensors, no convolution biases);
* ``vit_tiny``: a ViT-Ti/16 (5.7M in 152 tensors: 12 blocks of width 192);
* ``mlp``: 3072-1024-1024-10 (4.2M in 6 tensors);
* ``small``: 200 tensors of 64 elements (per-tensor overhead alone).

    python benchmarks/fused_step.py [--rounds 20] [--sets resnet50,vit_tiny,mlp,small] [--json FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
from typing import Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from optimizers import make_params, resnet_like_shapes, time_round_robin  # noqa: E402

import aiak  # noqa: E402
from aiak.util.warn import quiet  # noqa: E402


def vit_shapes(depth: int = 12, width: int = 192, patch: int = 16, classes: int = 1000) -> List[Tuple[int, ...]]:
    """Parameter shapes of a ViT (Dosovitskiy et al. 2021): patch embedding, class token, position embedding,
    ``depth`` blocks of attention and a 4x MLP with two LayerNorms, the head."""
    shapes = [(width, 3, patch, patch), (width,), (1, 1, width), (1, 197, width)]
    for _ in range(depth):
        shapes += [(width,), (width,), (3 * width, width), (3 * width,), (width, width), (width,),
                   (width,), (width,), (4 * width, width), (4 * width,), (width, 4 * width), (width,)]
    return shapes + [(width,), (width,), (classes, width), (classes,)]


SETS = {
    "resnet50": lambda: resnet_like_shapes((3, 4, 6, 3), conv_bias=False),
    "vit_tiny": vit_shapes,
    "mlp": lambda: [(1024, 3072), (1024,), (1024, 1024), (1024,), (10, 1024), (10,)],
    "small": lambda: [(64,)] * 200,
}
OPTIMIZERS = {
    "SGD(momentum)": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, weight_decay=1e-4),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.05),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
}


def _pair(shapes, make, device="cpu") -> Dict[str, torch.optim.Optimizer]:
    """The same optimizer over the same parameters and gradients twice: as built, and fused by aiak."""
    out = {}
    for name in ("default", "fused"):
        params = make_params(shapes, device=device)
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(device)
        opt = make(params)
        if name == "fused":
            holder = torch.nn.Module()
            holder.params = torch.nn.ParameterList(params)
            with quiet(), contextlib.redirect_stderr(io.StringIO()):   # the two lines optimize() says each time
                _, opt, _ = aiak.optimize(holder, opt, None, strategy={"optimizer": {"fused": True}})
            assert opt.param_groups[0]["fused"] is True
        out[name] = opt
    return out


def _spread(values: List[float]) -> Tuple[float, float, float]:
    q = statistics.quantiles(values, n=10)
    return statistics.median(values), q[0], q[-1]


def gpu_checks(device: str = "cuda") -> List[dict]:
    """On one GPU, where torch's default is the foreach form: for SGD with momentum and AdamW over ResNet-50's
    parameter shapes, the fused step's weights after 5 steps against the default's (max relative error, goal <= 1e-5)
    and its step time against the default's (goal: not slower). ``device="cpu"`` runs it on the CPU (a smoke test)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        return [{"check": "optim: fused step, cuda available", "ok": False, "metric": "available", "value": False}]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    shapes = SETS["resnet50"]()
    rows = []
    for name in ("SGD(momentum)", "AdamW"):
        pair = _pair(shapes, OPTIMIZERS[name], dev)
        for _ in range(5):
            for opt in pair.values():
                opt.step()
        sync()
        weights = {k: [p for g in opt.param_groups for p in g["params"]] for k, opt in pair.items()}
        err = max(float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
                  for a, b in zip(weights["fused"], weights["default"]))
        rows.append({"check": f"optim: {name} fused step vs torch's default ({dev.type}, 5 steps)", "ok": err <= 1e-5,
                     "metric": "max relative error (goal <= 1e-5)", "value": err})
        times = time_round_robin({k: v.step for k, v in pair.items()}, repeats=20, warmup=3, sync=sync)
        ratio = statistics.median([d / f for d, f in zip(times["default"], times["fused"])])
        rows.append({"check": f"optim: {name} default step / fused step ({dev.type}, 25.6M params)", "ok": ratio >= 1.0,
                     "metric": "speed ratio (goal >= 1.0)", "value": ratio})
        del pair, weights
    return rows


def main(argv=None) -> List[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; optimizer.step() in ms, median (p10-p90) "
          f"over {args.rounds} alternating rounds")
    print(f"{'set':<9} {'optimizer':<14} {'default':>22} {'fused':>22} {'default / fused':>22}")
    for set_name in args.sets.split(","):
        shapes = SETS[set_name]()
        for opt_name, make in OPTIMIZERS.items():
            pair = _pair(shapes, make)
            times = time_round_robin({k: v.step for k, v in pair.items()}, args.rounds, args.warmup)
            ratio = _spread([d / f for d, f in zip(times["default"], times["fused"])])
            default, fused = (_spread([1e3 * t for t in times[k]]) for k in ("default", "fused"))
            cell = lambda m: f"{m[0]:.2f} ({m[1]:.2f}-{m[2]:.2f})"  # noqa: E731
            print(f"{set_name:<9} {opt_name:<14} {cell(default):>22} {cell(fused):>22} "
                  f"{ratio[0]:>8.2f}x ({ratio[1]:.2f}-{ratio[2]:.2f})")
            rows.append({"set": set_name, "optimizer": opt_name, "params": sum(torch.Size(s).numel() for s in shapes),
                         "tensors": len(shapes), "default_ms": default, "fused_ms": fused, "ratio": ratio})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()

"""Step time of aiak's LAMB / LARS against torch's AdamW / SGD-momentum (foreach), measured in one run.

The goals, on CPU with ~32M parameters in ~300 tensors of ResNet-50-like shapes:
  LAMB / AdamW(foreach=True) <= 1.0      LARS / SGD(momentum, foreach=True) <= 1.5
and LAMB's achieved bandwidth, counted at the minimum of 7 x 4 bytes per parameter (read w, g, m, v;
write w, m, v), printed beside a measured copy bandwidth.

The shapes are generated (torchvision is not needed): a bottleneck ResNet with ``--blocks`` per stage
(default 3,4,12,3: ResNet-50 with a longer third stage), convolution biases included, giving 32.3M
parameters in 286 tensors. Optimizers are timed round-robin (one step each per round) so that load from
other processes hits all of them alike (in a shuffled order each round); the table reports medians over
``--repeats`` rounds.

    python benchmarks/optimizers.py            # full size
    python benchmarks/optimizers.py --quick    # a few seconds
"""
from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from aiak.optim import Lamb, Lars


def resnet_like_shapes(blocks: Sequence[int] = (3, 4, 12, 3), width: int = 64, num_classes: int = 1000,
                       conv_bias: bool = True) -> List[Tuple[int, ...]]:
    """Parameter shapes of a bottleneck ResNet (He et al. 2016, Table 1) without building the model."""
    shapes: List[Tuple[int, ...]] = []

    def conv(cin: int, cout: int, k: int) -> None:
        shapes.append((cout, cin, k, k))
        if conv_bias:
            shapes.append((cout,))

    def bn(c: int) -> None:
        shapes.extend([(c,), (c,)])

    conv(3, width, 7)
    bn(width)
    cin = width
    for stage, n in enumerate(blocks):
        mid = width * 2 ** stage
        out = mid * 4
        for b in range(n):
            conv(cin, mid, 1), bn(mid), conv(mid, mid, 3), bn(mid), conv(mid, out, 1), bn(out)
            if b == 0:
                conv(cin, out, 1), bn(out)
            cin = out
    shapes.extend([(num_classes, cin), (num_classes,)])
    return shapes


def make_params(shapes, device="cpu", dtype=torch.float32, seed=0) -> List[torch.nn.Parameter]:
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=gen, device=device, dtype=dtype) * 0.05)
        p.grad = torch.randn(s, generator=gen, device=device, dtype=dtype) * 1e-3
        params.append(p)
    return params


def layerwise_groups(params, weight_decay):
    """ResNet recipe: 1-D tensors (biases, BN) without decay and adaptation."""
    return [{"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0, "adapt": False}]


def candidates(params, bucket_elems=None) -> Dict[str, torch.optim.Optimizer]:
    """The optimizers timed. On CUDA ``LAMB`` and ``LARS`` step with their Triton kernels (their default there), and
    their torch multi-tensor paths are timed beside them (``fused=False``); on a CPU those are the default."""
    out = {
        "AdamW(foreach)": torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=True),
        "AdamW(fused)": torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True),
        "LAMB": Lamb(layerwise_groups(params, 0.01), lr=1e-4, bucket_elems=bucket_elems),
        "LAMB(single-tensor)": Lamb(layerwise_groups(params, 0.01), lr=1e-4, foreach=False, fused=False),
        "SGD(momentum,foreach)": torch.optim.SGD(params, lr=1e-4, momentum=0.9, weight_decay=5e-5, foreach=True),
        "LARS": Lars(layerwise_groups(params, 5e-5), lr=1e-4, bucket_elems=bucket_elems),
        "LARS(single-tensor)": Lars(layerwise_groups(params, 5e-5), lr=1e-4, foreach=False, fused=False),
    }
    if params[0].is_cuda:
        out["LAMB(torch)"] = Lamb(layerwise_groups(params, 0.01), lr=1e-4, bucket_elems=bucket_elems, fused=False)
        out["LARS(torch)"] = Lars(layerwise_groups(params, 5e-5), lr=1e-4, bucket_elems=bucket_elems, fused=False)
    return out


def time_round_robin(steps: Dict[str, Callable[[], None]], repeats: int, warmup: int,
                     sync: Callable[[], None] = lambda: None) -> Dict[str, List[float]]:
    times: Dict[str, List[float]] = {k: [] for k in steps}
    for _ in range(warmup):
        for fn in steps.values():
            fn()
    order = list(steps)
    rng = random.Random(0)
    for _ in range(repeats):
        rng.shuffle(order)  # no optimizer always runs first (or right after the same neighbour)
        for name in order:
            fn = steps[name]
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return times


def copy_bandwidth(numel: int, repeats: int, device="cpu", sync=lambda: None) -> float:
    """GB/s of ``dst.copy_(src)`` over ``numel`` fp32 elements (counting the read and the write)."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    t = time_round_robin({"copy": lambda: dst.copy_(src)}, repeats, 2, sync)["copy"]
    return 2 * 4 * numel / statistics.median(t) / 1e9


# AdamW(fused) is printed for reference, against the same baseline: one pass of torch's fused Adam kernel is
# the floor for any Adam-family step; LAMB needs the norms of the update before applying it (more passes).
BASELINE = {"AdamW(fused)": "AdamW(foreach)", "LAMB": "AdamW(foreach)", "LAMB(single-tensor)": "AdamW(foreach)",
            "LAMB(torch)": "AdamW(foreach)", "LARS": "SGD(momentum,foreach)",
            "LARS(single-tensor)": "SGD(momentum,foreach)", "LARS(torch)": "SGD(momentum,foreach)"}
GOAL = {"LAMB": 1.0, "LARS": 1.5}
# The fewest bytes a step must move per fp32 parameter where nothing stays in cache between passes: AdamW reads w, g,
# m, v and writes w, m, v; LAMB's two passes (its norms first) add a read of w, m, v (40 bytes: 1.43x AdamW's 28),
# LARS's a read of w, g (28: 1.4x SGD's 20). The CPU's bucketed torch paths keep a bucket in cache between their
# passes: 28 and 20.
MIN_BYTES_PER_PARAM = {"AdamW(foreach)": 28, "AdamW(fused)": 28, "LAMB": 28, "LAMB(single-tensor)": 28,
                       "LAMB(torch)": 40, "SGD(momentum,foreach)": 20, "LARS": 20, "LARS(single-tensor)": 20,
                       "LARS(torch)": 28}
TWO_PASS_FLOOR = {"LAMB": 40 / 28, "LARS": 28 / 20}   # on a GPU: the ratio to the baseline at the fewest bytes


def report(times: Dict[str, List[float]], numel: int, copy_gbs: float) -> List[dict]:
    rows = []
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{'optimizer':24s} {'median ms':>10s} {'min ms':>8s} {'ratio':>7s} {'goal':>6s} {'GB/s*':>7s}  vs")
    for name, t in med.items():
        base = BASELINE.get(name)
        ratio = t / med[base] if base else 1.0
        goal = GOAL.get(name)
        gbs = MIN_BYTES_PER_PARAM[name] * numel / t / 1e9
        ok = "" if goal is None else ("ok" if ratio <= goal else "MISS")
        print(f"{name:24s} {t * 1e3:10.1f} {min(times[name]) * 1e3:8.1f} {ratio:7.2f} "
              f"{'' if goal is None else f'<={goal}':>6s} {gbs:7.1f}  {base or '(baseline)'} {ok}")
        rows.append(dict(optimizer=name, median_ms=t * 1e3, ratio=ratio, goal=goal, gb_s=gbs))
    print(f"{'copy bandwidth':24s} {'':>10s} {'':>8s} {'':>7s} {'':>6s} {copy_gbs:7.1f}  dst.copy_(src), fp32")
    print("* GB/s at the minimum traffic: 7 x 4 B/param for AdamW/LAMB (w, g, m, v read; w, m, v written), "
          "5 x 4 B/param for SGD/LARS")
    return rows


def main(argv=None) -> List[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", default="3,4,12,3", help="bottleneck blocks per stage (default 3,4,12,3)")
    ap.add_argument("--width", type=int, default=64, help="stem width (default 64)")
    ap.add_argument("--repeats", type=int, default=15, help="timed rounds (default 15)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: leave torch's)")
    ap.add_argument("--bucket-elems", type=int, default=None, help="LAMB/LARS bucket size (default: automatic)")
    ap.add_argument("--quick", action="store_true", help="small model, few repeats")
    args = ap.parse_args(argv)
    if args.quick:
        args.blocks, args.width, args.repeats, args.warmup = "1,1,1,1", 32, 5, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = resnet_like_shapes(tuple(int(b) for b in args.blocks.split(",")), width=args.width)
    numel = sum(math.prod(s) for s in shapes)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{numel / 1e6:.1f}M parameters in {len(shapes)} tensors, {torch.get_num_threads()} threads, "
          f"{args.repeats} rounds; torch {torch.__version__}; load average {load:.1f} on {os.cpu_count()} CPUs")
    params = make_params(shapes)
    opts = candidates(params, args.bucket_elems)
    times = time_round_robin({k: o.step for k, o in opts.items()}, args.repeats, args.warmup)
    return report(times, numel, copy_bandwidth(numel, args.repeats))


# -- CUDA checks, called by benchmarks/gpu_check.py (touches CUDA only when called) ----------------------
def gpu_checks(device: str = "cuda") -> List[dict]:
    """On one GPU: LAMB/LARS foreach vs single-tensor vs a float64 run, half params, and step times.

    Rows: ``{"check", "ok", "metric", "value"}``. Takes well under a minute on a modern GPU.
    ``device="cpu"`` runs the same checks on the CPU (a smoke test of this function).
    """
    rows: List[dict] = []
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        return [{"check": "optim: cuda available", "ok": False, "metric": "available", "value": False}]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    small = resnet_like_shapes((1, 1, 1, 1), width=16, num_classes=10)

    def run(cls, dtype, steps=5, **kw):
        params = make_params(small, device=dev, dtype=torch.float64)
        params = [torch.nn.Parameter(p.detach().to(dtype)) for p in params]
        grads = [torch.randn(p.shape, device=dev, generator=torch.Generator(device=dev).manual_seed(i)).to(dtype)
                 * 1e-2 for i, p in enumerate(params)]
        opt = cls(layerwise_groups(params, 0.01), **kw)
        for _ in range(steps):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
        sync()
        states_fp32 = all(t.dtype == torch.float32 for st in opt.state.values() for k, t in st.items() if k != "step")
        return params if dtype != torch.bfloat16 else (params, states_fp32)

    def max_rel(a, b):
        return max(float((x.detach().double() - y.detach().double()).abs().max()
                         / y.detach().double().abs().max().clamp_min(1e-30)) for x, y in zip(a, b))

    paths = [("foreach", dict(foreach=True, fused=False))]
    if dev.type == "cuda":
        paths.append(("triton", dict(fused=True)))   # the kernels (aiak.optim._triton.layerwise): CUDA's default
    for cls, kw in ((Lamb, dict(lr=1e-2)), (Lars, dict(lr=0.1, trust_coefficient=0.01))):
        name = cls.__name__
        ref = run(cls, torch.float64, foreach=False, **kw)
        for label, dtype, extra in (*((f"{path} fp32", torch.float32, flags) for path, flags in paths),
                                    ("single fp32", torch.float32, dict(foreach=False, fused=False)),
                                    ("foreach cut fp32", torch.float32, dict(foreach=True, bucket_elems=4096,
                                                                             fused=False))):
            err = max_rel(run(cls, dtype, **extra, **kw), ref)
            rows.append({"check": f"optim: {name} {label} vs float64", "ok": err <= 1e-5,
                         "metric": "max relative error (goal <= 1e-5)", "value": err})
        # bf16 weights: fp32 state, and within one bf16 rounding per step (5 steps) of the float64 run
        for path, flags in paths:
            params, states_fp32 = run(cls, torch.bfloat16, **flags, **kw)
            err = max_rel(params, ref)
            rows.append({"check": f"optim: {name} {path} bf16 (fp32 state) vs float64",
                         "ok": states_fp32 and err <= 5 * 2 ** -7,
                         "metric": "max relative error (goal <= 5 bf16 roundings, fp32 state)", "value": err})
    shapes = resnet_like_shapes()
    params = make_params(shapes, device=dev)
    opts = candidates(params)
    times = time_round_robin({k: o.step for k, o in opts.items()}, repeats=20, warmup=3, sync=sync)
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, goal in GOAL.items():
        base = BASELINE[name]
        ratio = med[name] / med[base]
        floor = f"; two passes' memory floor {TWO_PASS_FLOOR[name]:.2f}" if dev.type == "cuda" else ""
        rows.append({"check": f"optim: {name} step / {base} step ({dev.type}, 32M params)",
                     "ok": ratio <= goal, "metric": f"time ratio (goal <= {goal}{floor})", "value": ratio})
        if f"{name}(torch)" in med:   # the Triton kernels against the torch path they replace on a GPU
            ratio = med[name] / med[f"{name}(torch)"]
            rows.append({"check": f"optim: {name} Triton step / torch multi-tensor step ({dev.type}, 32M params)",
                         "ok": ratio <= 1.0, "metric": "time ratio (goal <= 1.0)", "value": ratio})
    del params, opts
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()

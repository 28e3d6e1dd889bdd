"""The ``aiak`` command line: ``demo``, ``bench``, ``explain``, ``doctor``, ``profiles``."""
from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import time
from typing import List, Optional


def _cmd_profiles(args) -> int:
    from aiak.strategy import list_profiles, load_strategy, profiles_dir

    if args.name:
        print(load_strategy(args.name).to_yaml(), end="")
        return 0
    print(f"built-in profiles ({profiles_dir()}):")
    for name in list_profiles():
        print(f"  {name:<12} {load_strategy(name).description}")
    print("\nshow one: aiak profiles NAME   use one: aiak.optimize(..., strategy=NAME or 'my.yaml' or a dict)")
    return 0


def _cmd_explain(args) -> int:
    """What a strategy (default auto) picks for a model SPEC on this machine, knob by knob, and why.

    Without ``--tune`` the rules' pick only: nothing is trained. With ``--tune`` the strategy is applied to the
    model (``optimize()``, trials included for auto), which takes a few training steps per candidate.
    """
    import torch

    from aiak import model_spec
    from aiak.strategy import load_strategy

    if args.strategy != "auto":
        load_strategy(args.strategy)  # a misspelt profile fails before any model is built
    batch_size = None
    if args.batch_size is not None:  # checked here, not by argparse, so that a mistake is one "aiak:" line
        batch_size = int(args.batch_size) if args.batch_size.strip().lstrip("-").isdigit() else None
        if batch_size is None or batch_size < 1:
            raise model_spec.ModelSpecError(f"--batch-size must be a whole number >= 1, got {args.batch_size}")
    shape = model_spec.parse_input_shape(args.input_shape) if args.input_shape is not None else None
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise model_spec.ModelSpecError(f"--device {args.device!r}: expected cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise model_spec.ModelSpecError(f"--device {args.device!r}: expected cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise model_spec.ModelSpecError(f"--device {args.device}: CUDA is not available here (aiak doctor says why)")
    setup = model_spec.build(args.model, batch_size=batch_size, input_shape=shape)
    logging.getLogger("aiak").setLevel(logging.WARNING)  # optimize() logs the same table at INFO

    from aiak.tune import explain

    decision = explain(setup.model, setup.optimizer, setup.loader, strategy=args.strategy, tune=args.tune,
                       device=device)
    mode = "measured (--tune)" if args.tune else "rules only, nothing trained (--tune measures)"
    print(f"model {setup.description}; device {device}; {mode}\n")
    print(decision.render(full=True))  # every knob, also those left at the defaults
    return 0


def _cmd_demo(args) -> int:
    from aiak.demo import run_demo

    print(f"aiak demo: DemoNet on {args.samples} synthetic 32x32 images, batch {args.batch_size}, "
          f"{args.epochs} epoch(s); plain PyTorch vs aiak.optimize(strategy={args.strategy!r})")
    baseline, optimized = run_demo(args.strategy, args.epochs, args.samples, args.batch_size,
                                   show_progress=not args.no_progress)
    print(f"\n  {'run':<10} {'steps':>6} {'samples/s':>11} {'final loss':>11}")
    for r in (baseline, optimized):
        print(f"  {r.name:<10} {r.steps:>6} {r.throughput:>11.1f} {r.final_loss:>11.4f}")
    print(f"\n  speedup (throughput ratio aiak/baseline): {optimized.throughput / baseline.throughput:.2f}x"
          f" (aiak's time includes its optimize() call, {optimized.setup_seconds:.2f} s: the trials of 'auto')")
    return 0


def _cmd_bench(args) -> int:
    """Median step time of the demo model: plain loop vs the strategy, measured in one run."""
    import torch

    import aiak
    from aiak.demo import make_setup

    def time_steps(strategy: Optional[str]) -> List[float]:
        model, optimizer, loader = make_setup(n=args.batch_size * (args.steps + args.warmup), batch_size=args.batch_size)
        if strategy is not None:
            model, optimizer, loader = aiak.optimize(model, optimizer, loader, strategy=strategy)
        crit = torch.nn.CrossEntropyLoss()
        times = []
        it = iter(loader)
        for i in range(args.steps + args.warmup):
            start = time.perf_counter()
            x, y = next(it)
            crit(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        return times

    logging.getLogger("aiak").setLevel(logging.WARNING)
    base = statistics.median(time_steps(None))
    opt = statistics.median(time_steps(args.strategy))
    print(f"aiak bench: DemoNet, batch {args.batch_size}, median of {args.steps} steps after {args.warmup} warm-up")
    print(f"  baseline          {base * 1e3:8.2f} ms/step")
    print(f"  {args.strategy:<17} {opt * 1e3:8.2f} ms/step")
    print(f"  speedup           {base / opt:8.2f}x")
    print("more: python benchmarks/<name>.py (overhead, import_time, loader_overlap, optimizers, window_attention, "
          "comm_netns, gpu_check)")
    return 0


def _version_of(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cmd_doctor(args) -> int:
    import torch

    from aiak.strategy import profiles_dir

    rows = [("python", platform.python_version()), ("platform", platform.platform()),
            ("torch", torch.__version__), ("aiak profiles", str(profiles_dir()))]
    cuda = torch.cuda.is_available()
    rows.append(("cuda", f"{torch.cuda.device_count()} device(s), CUDA {torch.version.cuda}" if cuda else
                 "not available: GPU-only knobs (tf32, cudnn_benchmark, Triton kernels, side-stream copies) are skipped"))
    if cuda:
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            rows.append((f"  cuda:{i}", f"{torch.cuda.get_device_name(i)} (capability {major}.{minor}, "
                                        f"bf16 {'yes' if major >= 8 else 'emulated'}, tf32 {'yes' if major >= 8 else 'no'})"))
    import torch.distributed as dist

    backends = [b for b, ok in (("gloo", dist.is_available() and dist.is_gloo_available()),
                                ("nccl", dist.is_available() and dist.is_nccl_available())) if ok]
    rows.append(("distributed backends", ", ".join(backends) or "none"))
    for extra, dist_name in (("triton", "triton"), ("dali", "nvidia-dali-cuda120"), ("apex (optional)", "apex"),
                             ("transformers (tests)", "transformers")):
        rows.append((extra, _version_of(dist_name)))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rows.append(("cpu cores usable", str(cpus)))
    rows.append(("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "unset")))
    width = max(len(k) for k, _ in rows)
    print("aiak doctor")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiak", description="Make an existing PyTorch training script faster.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="train a small built-in model, baseline vs optimized (CPU, < 1 minute)")
    p.add_argument("--strategy", default="auto", help="auto, a profile name, or a YAML path (default: auto)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=6400, help="default 6400: 200 steps over 2 epochs of batch 64")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(fn=_cmd_demo)

    p = sub.add_parser("bench", help="median step time of the demo model, baseline vs a strategy")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.set_defaults(fn=_cmd_bench)

    p = sub.add_parser("explain", help="what a strategy (default: auto) picks for a model on this machine, and why")
    p.add_argument("strategy", nargs="?", default="auto", help="auto, a profile name, or a YAML path (default: auto)")
    p.add_argument("--model", default="demo", metavar="SPEC",
                   help="demo, timm:NAME, torchvision:NAME, hf:TYPE or path/to/file.py:factory (default: demo; "
                        "random weights, nothing downloaded)")
    p.add_argument("--batch-size", default=None, metavar="N", help="default: 64 for demo, 32 otherwise")
    p.add_argument("--input-shape", default=None, metavar="C,H,W",
                   help="image size (e.g. 3,64,64), or one number, the sequence length, for a text model")
    p.add_argument("--tune", action="store_true", help="measure the candidates (trials) instead of the rules only")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    p.set_defaults(fn=_cmd_explain)

    p = sub.add_parser("doctor", help="what this machine offers aiak (CUDA, extras, backends)")
    p.set_defaults(fn=_cmd_doctor)

    p = sub.add_parser("profiles", help="list the built-in profiles, or show one")
    p.add_argument("name", nargs="?")
    p.set_defaults(fn=_cmd_profiles)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from aiak.model_spec import ModelSpecError
    from aiak.strategy import StrategyError

    try:
        return args.fn(args)
    except (StrategyError, ModelSpecError) as e:
        print(f"aiak: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

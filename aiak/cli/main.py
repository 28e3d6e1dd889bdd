"""The ``aiak`` command line: ``demo``, ``bench``, ``explain``, ``doctor``, ``profiles``."""
from __future__ import annotations

import argparse
import logging
import sys
import warnings
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
    model (``optimize()``, trials included for auto), which takes a few training steps per candidate, and the model
    trains until the run-time guard decided (`_train_until_the_guard_decided`), since the candidates the run can
    switch between are timed there.
    """
    import torch

    from aiak.cli import model_spec
    from aiak.strategy import load_strategy

    if args.strategy != "auto":
        load_strategy(args.strategy)  # a misspelt profile fails before any model is built
    device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    setup = model_spec.build(args.model, batch_size=args.batch_size, input_shape=args.input_shape)
    logging.getLogger("aiak").setLevel(logging.WARNING)  # optimize() logs the same table at INFO

    from aiak.api import explain, last_decision, optimize

    if args.tune:
        model, optimizer, loader = optimize(setup.model, setup.optimizer, setup.loader, strategy=args.strategy,
                                            device=device)
        decision = last_decision()
        steps = _train_until_the_guard_decided(model, optimizer, loader, decision)
        mode = "measured (--tune)" + (f", then {steps} training steps timed by the run-time guard" if steps else "")
    else:
        decision = explain(setup.model, setup.optimizer, setup.loader, strategy=args.strategy, device=device)
        mode = "rules only, nothing trained (--tune measures)"
    print(f"model {setup.description}; device {device}; {mode}\n")
    print(decision.render(full=True, group_defaults=not args.all))  # --all: a row for every knob
    return 0


GUARD_MAX_STEPS = 64   # the most training steps explain --tune runs for the guard (it decides within 4 rounds)


def _train_until_the_guard_decided(model, optimizer, loader, decision) -> int:
    """Training steps on the model spec's batches until the run-time guard (`aiak.tune.guard`) has decided, at most
    `GUARD_MAX_STEPS`; returns how many ran (none where no guard watches)."""
    from aiak.cli import model_spec

    steps, batches = 0, iter(loader)
    while decision.guard.get("why", "").startswith("watching") and steps < GUARD_MAX_STEPS:
        batch = next(batches, None)
        if batch is None:
            batches = iter(loader)
            continue
        model_spec.compute_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    return steps


def _cmd_demo(args) -> int:
    from aiak.cli.demo import decision_lines, plan, run_demo
    from aiak.measure.rounds import Spread
    from aiak.strategy import load_strategy

    plan(args.epochs, args.samples, args.batch_size, args.rounds, args.warmup)  # mistakes before any output
    if args.strategy != "auto":
        load_strategy(args.strategy)
    print(f"aiak demo: DemoNet on {args.samples} synthetic 32x32 images, batch {args.batch_size}, "
          f"{args.epochs} epoch(s); plain PyTorch vs aiak.optimize(strategy={args.strategy!r}), alternating in "
          f"{args.rounds} rounds", flush=True)
    logging.getLogger("aiak").setLevel(logging.WARNING)  # the decision table: `aiak explain --tune` prints it
    r = run_demo(args.strategy, args.epochs, args.samples, args.batch_size, rounds=args.rounds, warmup=args.warmup,
                 show_progress=not args.no_progress)
    print(f"\n  {'run':<10} {'steps':>6} {'ms/step median (p10-p90)':>26} {'samples/s':>10} {'final loss':>11}")
    for c in (r.baseline, r.optimized):
        timed = [t for t in c.step_seconds if t != float("inf")]
        if c.stopped and not timed:
            print(f"  {c.name:<10} {c.steps:>6}  stopped: {c.stopped}")
            continue
        t = Spread.of(timed).scaled(1e3)
        spread = f"{t.median:.1f} ({t.p10:.1f}-{t.p90:.1f})"
        print(f"  {c.name:<10} {c.steps:>6} {spread:>26} {r.batch_size / (t.median / 1e3):>10.1f} {c.loss:>11.4f}")
        if c.stopped:
            print(f"  {'':<10} stopped: {c.stopped}")
    if r.speedup is None:
        stopped = next(c for c in (r.optimized, r.baseline) if c.stopped)
        print(f"\n  no speedup to report: {stopped.name} stopped ({stopped.stopped}). `aiak explain --tune` shows "
              f"what the strategy applies and how each candidate measured")
        return 0
    import aiak

    for line in decision_lines(aiak.last_decision()):
        print(line)
    more = f"; the first {args.rounds} rounds were too noisy, so {r.extra_rounds} more ran" if r.extra_rounds else ""
    print(f"\n  speedup of the training steps (baseline/aiak, per round{more}): {r.speedup.describe()}")
    if r.extra_rounds:  # every step's time summed: the load's spikes would decide it
        print("  end to end: not given, the machine's load varied too much during the run for a sum of all steps "
              "to mean anything")
    elif not r.speedup.too_noisy:
        print(f"  end to end, aiak.optimize() included ({r.setup_seconds:.2f} s): {r.end_to_end:.2f}x over "
              f"{r.optimized.steps} steps (both sides warmed up {r.warmup} steps, which count here)")
    return 0


def _cmd_bench(args) -> int:
    from aiak.cli import bench

    return bench.run(args)


def _cmd_doctor(args) -> int:
    from aiak.cli import doctor

    return doctor.run(args)


def build_parser() -> argparse.ArgumentParser:
    from aiak.cli import args as cli_args
    from aiak.cli.args import whole_number

    from aiak import __version__

    parser = cli_args.Parser(prog="aiak", description="Make an existing PyTorch training script faster.")
    parser.add_argument("--version", action="version", version=f"aiak {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="train a small built-in CNN twice, plain PyTorch and optimized, and compare",
                       description="Train DemoNet on synthetic images twice from the same weights, plain PyTorch "
                                   "and aiak.optimize(strategy), alternating the two in rounds, and report the "
                                   "speedup with its confidence interval and both final losses.")
    p.add_argument("--strategy", default="auto", metavar="STRATEGY", help=cli_args.STRATEGY_HELP)
    p.add_argument("--epochs", type=whole_number(1), default=2, help="passes over the samples")
    p.add_argument("--samples", type=whole_number(1), default=6400,
                   help="synthetic images; 6400 = 200 steps over 2 epochs of batch 64")
    p.add_argument("--batch-size", type=whole_number(1), default=64, help="images per step")
    p.add_argument("--rounds", type=whole_number(1), default=20,
                   help="the timed steps are cut into this many rounds, alternating baseline and aiak; the "
                        "speedup is the median of the rounds' ratios (6 or more for a verdict)")
    p.add_argument("--warmup", type=whole_number(0), default=5,
                   help="steps each side runs, alternately, before the timing starts (they train too)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(fn=_cmd_demo)

    p = sub.add_parser("bench", help="time a model under plain PyTorch and one or more strategies, in rounds",
                       description="Time training steps of a model (random weights, synthetic data) under plain "
                                   "PyTorch and each --strategy, alternating them in rounds, and print one "
                                   "table: step time (median, p10-p90), samples/s, peak memory, speedup with "
                                   "its confidence interval, final loss.")
    from aiak.cli.bench.options import add_arguments as bench_arguments

    bench_arguments(p)
    p.set_defaults(fn=_cmd_bench)

    p = sub.add_parser("explain", help="what a strategy (default: auto) picks for a model on this machine, and why",
                       description="What a strategy picks for a model on this machine, knob by knob, with the "
                                   "source and the reason of each.")
    p.add_argument("strategy", nargs="?", default="auto", help=cli_args.STRATEGY_HELP)
    p.add_argument("--model", default="demo", metavar="SPEC", help=cli_args.MODEL_HELP)
    p.add_argument("--batch-size", type=whole_number(1), default=None, metavar="N",
                   help="samples per step (default: 64 for demo, 32 otherwise)")
    p.add_argument("--input-shape", type=cli_args.input_shape, default=None, metavar="C,H,W",
                   help="image size (e.g. 3,64,64), or one number, the sequence length, for a text model "
                        "(default: the model's own)")
    p.add_argument("--tune", action="store_true", help="measure the candidates (trials) instead of the rules only")
    p.add_argument("--all", action="store_true",
                   help="a row for every knob, also those left at plain PyTorch's defaults (grouped otherwise)")
    p.add_argument("--device", type=cli_args.device, default=None,
                   help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.set_defaults(fn=_cmd_explain)

    p = sub.add_parser("doctor", help="check this machine for what slows training down, with a fix for each problem",
                       description="One line per check (pass, warn or fail), each warning or failure with its "
                                   "fix. Exit code 0 when all pass, 1 on warnings, 2 on failures.")
    from aiak.cli import doctor

    doctor.add_arguments(p)
    p.set_defaults(fn=_cmd_doctor)

    p = sub.add_parser("profiles", help="list the built-in profiles, or show one",
                       description="List the built-in strategy profiles, or print one as YAML.")
    p.add_argument("name", nargs="?", help="a profile to print (default: list them all)")
    p.set_defaults(fn=_cmd_profiles)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    # A warning's file and line point at the user's script under aiak.optimize(); here the whole stack is the
    # command's own, so the line would only read "<frozen runpy>:88".
    warnings.formatwarning = lambda message, category, *_, **__: f"{category.__name__}: {message}\n"
    from aiak.cli.demo import DemoError
    from aiak.cli.model_spec import ModelSpecError
    from aiak.strategy import StrategyError

    try:
        return args.fn(args)
    except (StrategyError, ModelSpecError, DemoError) as e:
        print(f"aiak: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("aiak: interrupted", file=sys.stderr)
        return 130

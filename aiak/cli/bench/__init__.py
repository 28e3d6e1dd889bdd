"""``aiak bench``: a model's training step timed under plain PyTorch and under each strategy, in rounds.

    aiak bench [--model SPEC] [--strategy S ...] [--batch-size N] [--input-shape C,H,W] [--steps N]
               [--warmup N] [--rounds N] [--device D] [--json] [--trace DIR] [--plot FILE.png]

Every contender is built from the same SPEC (:func:`aiak.cli.model_spec.build`) with the same seed, so all start
from the same weights and read the same batches in the same order: ``baseline`` is that setup untouched (plain
PyTorch, wrapped in DDP by hand under torchrun, as aiak wraps it), each strategy is ``aiak.optimize(model,
optimizer, loader, strategy=S)`` on a fresh build (``setup_s`` times that call, the trials of ``auto``
included; with the tuning cache warm, ``auto`` reuses its last decision and its trials do not run). A step is
what a user's loop does: next batch (the loader is re-iterated at its end), to the device,
:func:`aiak.cli.model_spec.compute_loss`, ``backward()``, ``optimizer.step()``, ``zero_grad()``. Each contender
draws its random numbers (dropout) from its own stream, seeded alike, although the steps interleave: plain
PyTorch under another name (``--strategy default``) ends at the baseline's loss exactly.

Timing is :func:`aiak.measure.rounds.alternate`: everybody warms up, the timed steps are cut into rounds in rotating
order, the speedup is the median of the per-round ratios with its confidence interval, "within noise" when
that interval holds 1.00x; a strategy over 10x slower than the baseline on its first timed step is stopped.
A strategy that raises in ``optimize()`` or in a step is reported as failed (exit code 1); the others go on.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated``, reset whenever a contender's run of steps starts; on
a CPU the process RSS (``/proc/self/statm``) sampled after each forward, backward and optimizer step of the
contender. Both are the whole process's: every contender's weights live in it at once.

Under torchrun (``WORLD_SIZE`` > 1) bench joins the process group itself (gloo on CPU, NCCL on CUDA, env://,
with a timeout), every rank runs every contender on the same synthetic batches and only rank 0 prints. A
contender that fails on one rank is dropped on all (a failure that leaves the other ranks inside a collective
ends there at the process-group timeout, :data:`DIST_TIMEOUT_S`). Linearity is per contender: the
multi-worker throughput / the single-worker throughput / workers, which is the single-worker median step over
the multi-worker one. The single worker is measured on rank 0 alone after the timing (and any trace): the same
model unwrapped from DDP (recompiled if the strategy compiled it), its optimizer and loader, the same warm-up
and rounds, the contenders alternating again, while the other ranks wait in a barrier whose timeout is ten
times rank 0's expected time plus two minutes. The idle ranks leave rank 0 the machine, as on a job of one
worker; rank 0 keeps the thread count torchrun gave it.

With ``--json`` stdout carries one JSON object and nothing else (``aiak bench --json | jq`` works); the table
goes to stderr then. ``--plot`` draws every step, warm-up included (shaded), per contender.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from typing import List, Optional

from aiak.cli.args import MODEL_HELP, device as device_type, input_shape, whole_number

from aiak.cli.bench.report import contender_stats, draw_plot, render_table
from aiak.cli.bench.runs import (TRACE_STEPS, Memory, UsageError, World, build_baseline, build_strategy, single_worker,
                                 time_all, write_traces)
from aiak.measure.rounds import MIN_ROUNDS_FOR_VERDICT

__all__ = ["add_arguments", "run"]

DEFAULT_STEPS = 40
DEFAULT_ROUNDS = 20


def add_arguments(parser) -> None:
    """The options of ``aiak bench`` (``aiak.cli`` builds the subcommand's parser and calls this)."""
    parser.add_argument("--model", default="demo", metavar="SPEC", help=MODEL_HELP)
    parser.add_argument("--strategy", action="append", default=None, metavar="STRATEGY",
                        help="auto, a built-in profile name (aiak profiles lists them) or a path to a YAML profile; "
                             "repeat it to compare several (default: auto)")
    parser.add_argument("--batch-size", type=whole_number(1), default=None, metavar="N",
                        help="samples per step on each worker (default: 64 for demo, 32 otherwise)")
    parser.add_argument("--input-shape", type=input_shape, default=None, metavar="C,H,W",
                        help="image size (e.g. 3,64,64), or one number, the sequence length, for a text model "
                             "(default: the model's own)")
    parser.add_argument("--steps", type=whole_number(1), default=None, metavar="N",
                        help="timed steps per contender, cut into --rounds rounds (default: 40, or --rounds if that "
                             "is more)")
    parser.add_argument("--warmup", type=whole_number(0), default=5, metavar="N",
                        help="untimed steps per contender first, alternating (they train too)")
    parser.add_argument("--rounds", type=whole_number(1), default=None, metavar="N",
                        help="rounds of alternation; the speedup is the median of their ratios, and a verdict needs "
                             f"{MIN_ROUNDS_FOR_VERDICT} or more (default: 20, or --steps if that is fewer)")
    parser.add_argument("--device", type=device_type, default=None, metavar="D",
                        help="cpu, cuda or cuda:N (default: cuda when available, else cpu; under torchrun each rank "
                             "takes cuda:LOCAL_RANK)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object on stdout, and the table on stderr")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help=f"after the timing, write a torch.profiler trace of {TRACE_STEPS} steps of each "
                             "contender to DIR/<name>.json (opens in https://ui.perfetto.dev)")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help='draw step time over steps, one line per contender (needs pip install "aiak[plot]")')
    parser.add_argument("--no-progress", action="store_true", help="no progress bars or status lines")


# ------------------------------------------------------------------------------------------ checks up front

def _usage_error(message: str) -> int:
    hint = " (see aiak bench --help)" if message.startswith("argument ") else ""
    sys.stderr.write(f"aiak bench: {message}{hint}\n")
    return 2


def _writable_dir(path: str, create: bool) -> Optional[str]:
    """None if files can be created in ``path`` (made first if ``create``), else why not."""
    import tempfile

    try:
        if create:
            os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as e:
        return f"{e.strerror or e} ({path})"
    return None


def _settle_steps_and_rounds(args) -> None:
    """A default adapts to the value the user gave: ``--steps 6`` alone times 6 rounds of one step, ``--rounds 50``
    alone 50 steps; only two values given that conflict are an error (:func:`_check_arguments`)."""
    if args.steps is None:
        args.steps = max(DEFAULT_STEPS, args.rounds or 0)
    if args.rounds is None:
        args.rounds = min(DEFAULT_ROUNDS, args.steps)


def _check_arguments(args, strategies: List[str]) -> Optional[str]:
    """The first mistake in the arguments that argparse cannot see alone, as one line; None if there is none."""
    if args.steps < args.rounds:
        return (f"argument --steps: must be at least --rounds ({args.rounds}) so that every round times a step, "
                f"got {args.steps}")
    seen = set()
    for name in strategies:
        if name in seen:
            return f"argument --strategy: {name!r} is given twice"
        if name == "baseline":
            return "argument --strategy: 'baseline' is plain PyTorch, always run; name a strategy to compare with it"
        seen.add(name)
    if args.trace is not None:
        why = _writable_dir(args.trace, create=True)
        if why:
            return f"argument --trace: cannot write traces to {args.trace!r}: {why}"
    if args.plot is not None:
        try:
            import matplotlib
        except ImportError:
            return '--plot needs matplotlib: pip install "aiak[plot]"'
        matplotlib.use("Agg")
        from matplotlib.backend_bases import FigureCanvasBase

        suffix = os.path.splitext(args.plot)[1].lstrip(".").lower()
        if suffix not in FigureCanvasBase.get_supported_filetypes():
            return (f"argument --plot: {args.plot!r} has no image suffix matplotlib writes; use .png "
                    f"(or one of {', '.join(sorted(FigureCanvasBase.get_supported_filetypes()))})")
        why = _writable_dir(os.path.dirname(os.path.abspath(args.plot)), create=False)
        if why:
            return f"argument --plot: cannot write {args.plot!r}: {why}"
    return None


def _load_strategies(strategies: List[str]) -> Optional[str]:
    """Every strategy but ``auto`` loaded before anything is built: a misspelt profile is the user's mistake."""
    from aiak.strategy import StrategyError, load_strategy

    for name in strategies:
        if name != "auto":
            try:
                load_strategy(name)
            except StrategyError as e:
                return f"argument --strategy {name!r}: {e}"
    return None




# ------------------------------------------------------------------------------------------ the command

def run(args) -> int:
    """``aiak bench``: 0 when every contender ran (a stopped one included), 1 when a strategy failed (its row
    says why), 2 for a mistake in the arguments or a SPEC that cannot train (one line on stderr)."""
    strategies = list(args.strategy or ["auto"])
    _settle_steps_and_rounds(args)
    problem = _check_arguments(args, strategies) or _load_strategies(strategies)
    if problem:
        return _usage_error(problem)
    try:
        world = World.join(args.device)
    except UsageError as e:
        return _usage_error(str(e))
    try:
        return _bench(args, strategies, world)
    except UsageError as e:
        return _usage_error(str(e)) if world.leader else 2
    except Exception as e:
        from aiak.cli.model_spec import ModelSpecError

        if isinstance(e, ModelSpecError) and not world.leader:
            return 2                          # rank 0 says it once
        raise
    finally:
        world.leave()


def _bench(args, strategies: List[str], world: World) -> int:
    import warnings

    from aiak.cli.progress import Board

    human = sys.stderr if args.json else sys.stdout
    show = world.leader and not args.no_progress

    def say(line: str) -> None:
        if show:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    if not world.leader:                        # only rank 0 speaks; a failure still raises
        warnings.simplefilter("ignore")
        logging.getLogger("aiak").setLevel(logging.ERROR)
    rounds, per_round, warmup = args.rounds, args.steps // args.rounds, args.warmup
    steps = rounds * per_round
    memory = Memory(world.device)
    baseline, setup = build_baseline(args, world, memory, warmup, steps)
    split = f"{steps} timed steps in {rounds} rounds of {per_round}" + (
        f" ({args.steps} asked: a multiple of --rounds is timed)" if steps != args.steps else "")
    what = ("torch.cuda.max_memory_allocated" if memory.kind == "cuda"
            else "the process RSS, every contender's weights included")
    if world.leader:
        print(f"aiak bench: {setup.description}; device {world.device}"
              + (f", {world.size} workers" if world.size > 1 else "")
              + f"\n  {split} per contender, after {warmup} warm-up steps; peak memory is the whole process's ({what})",
              file=human, flush=True)
    entries = [baseline] + [build_strategy(s, args, world, memory, warmup, steps, say) for s in strategies]
    running = [e for e in entries if e.loop is not None]
    try:
        with Board({e.name: warmup + steps for e in running}, enabled=show) as board:
            time_all(running, warmup, rounds, per_round, board)
    except Exception as e:
        if baseline.loop.failure is None:
            raise
        raise UsageError(f"the baseline (plain PyTorch) {baseline.loop.failure}; the model {args.model!r} cannot "
                          f"train as given") from e
    for e in running:                           # a rank that failed alone: every rank drops the contender
        if world.agree_any(bool(e.failed)) and not e.failed:
            e.failure = "failed on another rank (its log says why)"
    alive = [e for e in running if not e.failed and not e.contender.stopped]
    for e in running:
        if e not in alive and (args.trace or world.size > 1):
            say(f"  {e.name}: {'failed' if e.failed else 'stopped'}, so neither traced nor timed alone")
    traces = write_traces(alive, args.trace, world, say) if args.trace else {}
    if world.size > 1:
        single_worker(alive, world, warmup, rounds, per_round, say)
    code = 1 if any(e.failed for e in entries) else 0          # every rank knows: the failures were agreed
    if not world.leader:
        return code

    report = {"model": args.model, "description": setup.description, "device": str(world.device),
              "batch_size": setup.batch_size, "world_size": world.size, "steps": steps, "steps_asked": args.steps,
              "steps_per_round": per_round,
              "warmup": warmup, "rounds": rounds, "mem_kind": memory.kind}
    report["baseline"] = contender_stats(baseline, baseline, setup.batch_size, world, memory)
    report["strategies"] = {e.name: contender_stats(e, baseline, setup.batch_size, world, memory) for e in entries[1:]}
    report["speedup"] = report["strategies"][strategies[0]]["speedup"]
    if traces:
        report["traces"] = traces
    print("", file=human)
    print(render_table(report, entries), file=human, flush=True)
    if args.plot:
        draw_plot(args.plot, entries, warmup, setup.description)
        print(f"  plot: {args.plot}", file=human)
    if args.json:
        print(json.dumps(report, default=str), flush=True)
    return code


"""The ``aiak bench`` command itself (see `aiak.cli.bench` for what it measures and how)."""
from __future__ import annotations

import json
import logging
import os
import sys
from typing import List, Optional

from aiak.cli.bench.options import DEFAULT_ROUNDS, DEFAULT_STEPS
from aiak.cli.bench.report import contender_stats, draw_plot, render_table
from aiak.cli.bench.runs import (Memory, UsageError, World, build_baseline, build_strategy, single_worker, time_all,
                                 write_traces)

__all__ = ["run"]


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
    alone 50 steps; only two values given that conflict are an error (`_check_arguments`)."""
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


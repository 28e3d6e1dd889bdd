"""O2 bf16 training step: the redesigned O2 (fp32 parameters, half compute copies) against the O2 before it.

    python benchmarks/o2_compute.py [--models demo,mlp,vit] [--rounds 12] [--steps N] [--json FILE]
    python benchmarks/o2_compute.py --quick     # demo and mlp, batch 8, 8 rounds (under a minute)

One training step (forward, cross-entropy, backward, ``optimizer.step()``, ``zero_grad()``), SGD with
momentum, from the same initial weights on the same batches, two ways:

* ``new``: ``aiak.optimize(model, opt, strategy={"precision": {"level": "O2", "dtype": "bf16"}, "tune":
  False})`` (:mod:`aiak.amp.half_compute`): fp32 parameters, each forward computes with bf16 copies made in
  the autograd graph, the optimizer steps the fp32 parameters;
* ``old``: :class:`OldO2`, the O2 before that redesign, re-implemented here for comparison only (the model
  cast to bf16 in place outside norm layers, fp32 masters stepped and copied back). The old O2 made those
  moves from aiak's step controller, whose bookkeeping is left out: a small head start for ``old``.

Models: ``demo`` (:class:`aiak.cli.demo.DemoNet` at width 16, 3x32x32, batch 16), ``mlp`` (3072-1024-1024-10,
batch 16), ``vit`` (timm ``vit_tiny_patch16_224`` at 64 px, batch 4), on :func:`aiak.cli.demo.synthetic_dataset`
images; small batches, as a CPU without AVX512-BF16 emulates bf16 matmuls at about 1 GFLOP/s. First each
model trains 3 steps both ways: the new parameters and the old fp32 masters must agree within bf16
tolerance (``W_RTOL``, ``W_ATOL``), and so must their updates (``UPDATE_RTOL``), or the script stops.

Timing is :mod:`aiak.measure.rounds`'s: both sides warm up, then alternate in rounds; new vs old is old round time /
new round time, the median over rounds with its distribution-free interval and aiak.measure.rounds's verdict. One
torch thread by default (``--threads``): on a shared 2-core machine two OpenMP threads wait for each other
whenever another process holds a core (a DemoNet step: 440-670 ms with 2 threads, 80 ms with 1, load 8).

Peak memory: each side and model in a fresh process (``--memory-of``), after the timing. A throwaway model of
that side trains one step and is dropped (imports, kernel code pages, lazy caches go into the baseline); the
process reads its RSS, builds the measured model, resets the kernel's high-water mark (``5`` into
``/proc/self/clear_refs``), trains a few steps and reads ``VmHWM``. peak MB = that peak minus the RSS before
the model: weights (old: bf16 + fp32 masters; new: fp32), gradients, momentum, activations.
``MALLOC_MMAP_THRESHOLD_=65536`` makes glibc give every tensor over 64 KiB back to the kernel when freed, so
the RSS follows the live tensors. Without clear_refs, ``ru_maxrss`` (set-up included) is used.
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import itertools
import json
import os
import resource
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import aiak
from aiak.util.nested import map_tensors
from aiak.util.warn import quiet
from aiak.cli.demo import DemoNet, synthetic_dataset
from aiak.measure.rounds import Contender, Spread, alternate, plan_rounds, speedup
from aiak.runtime.switches import read_switches

O2_BF16 = {"precision": {"level": "O2", "dtype": "bf16"}, "tune": False}
LR, MOMENTUM = 0.01, 0.9
W_RTOL, W_ATOL = 2e-2, 2e-3          # weights after CHECK_STEPS steps, new parameters vs old masters
UPDATE_RTOL = 1e-2                   # and their updates (w - w0), in global L2 norm (fp32 vs bf16: 0.4-3.4%)
CHECK_STEPS, MEMORY_STEPS, BATCHES = 3, 2, 4


class OldO2:
    """The pre-redesign O2 (aiak up to commit f5e4859), kept here only to compare the redesign against.

    Set-up: the floating parameters and buffers of the modules outside normalization layers are cast to
    ``dtype`` in place (same Parameter objects); the optimizer then steps fp32 masters made from the values
    before the cast (norm parameters stay fp32, stepped as they are). Norm classes without a mixed kernel take
    fp32 inputs and give ``dtype`` back; the root casts its floating inputs to ``dtype``, its outputs to fp32.
    Step: half gradients to the masters as fp32, the optimizer steps, masters copied into the half parameters.
    bf16 only: no loss scaling."""

    NATIVE = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype = torch.bfloat16):
        self.model, self.optimizer = model, optimizer
        in_norm = set()
        for m in model.modules():
            if self.is_norm(m):
                in_norm.update(id(t) for t in itertools.chain(m.parameters(), m.buffers()))
                if not isinstance(m, self.NATIVE):
                    m.register_forward_pre_hook(lambda _, a, k: self._cast((a, k), torch.float32), with_kwargs=True)
                    m.register_forward_hook(lambda _, a, out: self._cast(out, dtype))

        def castable(t):
            return t is not None and t.is_floating_point() and t.dtype != dtype and id(t) not in in_norm

        before: Dict[int, torch.Tensor] = {}
        for m in self._outside_norms(model):
            before.update({id(p): p.detach().clone() for p in m._parameters.values() if castable(p)})
            m._apply(lambda t: t.to(dtype) if castable(t) else t, recurse=False)
        self.pairs: List[Tuple[nn.Parameter, nn.Parameter]] = []     # (half model parameter, fp32 master)
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                if id(p) in before:
                    self.pairs.append((p, nn.Parameter(before[id(p)], requires_grad=p.requires_grad)))
                params.append(self.pairs[-1][1] if id(p) in before else p)
            group["params"] = params
        model.register_forward_pre_hook(lambda _, a, k: self._cast((a, k), dtype), with_kwargs=True)
        model.register_forward_hook(lambda _, a, out: self._cast(out, torch.float32))

    @staticmethod
    def is_norm(m: nn.Module) -> bool:
        return isinstance(m, OldO2.NATIVE) or "Norm" in type(m).__name__

    @staticmethod
    def _outside_norms(model: nn.Module):
        stack, seen = [model], set()
        while stack:
            m = stack.pop()
            if id(m) not in seen and not OldO2.is_norm(m):
                seen.add(id(m))
                yield m
                stack.extend(m.children())

    @staticmethod
    def _cast(obj, dtype):
        return map_tensors(obj, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)

    def step(self) -> None:
        for p, master in self.pairs:
            master.grad, p.grad = (None if p.grad is None else p.grad.float()), None
        self.optimizer.step()
        with torch.no_grad():
            torch._foreach_copy_([p for p, _ in self.pairs], [m for _, m in self.pairs])

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def fp32_weights(self) -> Dict[str, torch.Tensor]:
        """What the optimizer steps (a master, or an fp32 norm parameter), by the model's parameter names."""
        master_of = {id(p): m for p, m in self.pairs}
        return {n: master_of.get(id(p), p) for n, p in self.model.named_parameters()}


def _timm_vit() -> nn.Module:
    import timm

    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, drop_rate=0.0,
                             drop_path_rate=0.0, img_size=64)


# name -> (factory, image size, batch, --quick batch, steps per side, description)
CASES: Dict[str, Tuple[Callable[[], nn.Module], int, int, int, int, str]] = {
    "demo": (lambda: DemoNet(width=16), 32, 16, 8, 48, "aiak.cli.demo.DemoNet(width=16), 3x32x32"),
    "mlp": (lambda: nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 1024), nn.GELU(), nn.Linear(1024, 1024),
                                  nn.GELU(), nn.Linear(1024, 10)), 32, 16, 8, 48, "MLP 3072-1024-1024-10"),
    "vit": (_timm_vit, 64, 4, 2, 16, "timm vit_tiny_patch16_224 @ 64 px"),
}


def batches(name: str, batch: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    images, labels = synthetic_dataset(BATCHES * batch, image_size=CASES[name][1], seed=0).tensors
    return list(zip(images.split(batch), labels.split(batch)))


def build(name: str, side: str, init: Optional[nn.Module] = None):
    """(model, optimizer) of one side, with ``init``'s weights (a model seeded afresh when None)."""
    if init is None:
        torch.manual_seed(0)
        init = CASES[name][0]()
    model = copy.deepcopy(init)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    if side == "old":
        return model, OldO2(model, opt)
    with quiet():  # aiak warns once that this CPU emulates bf16, which this benchmark knows
        model, opt, _ = aiak.optimize(model, opt, strategy=O2_BF16)
    return model, opt


def stepper(model, opt, data) -> Callable[[], torch.Tensor]:
    it = itertools.cycle(data)

    def step():
        x, y = next(it)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


def same_training(name: str, init: nn.Module, data) -> Tuple[float, float, Optional[str]]:
    """After CHECK_STEPS steps from ``init``: (max |w_new - w_old|, |update_new - update_old| / |update_old| in
    global L2 norm, what failed or None). The weights alone would pass an old side that never copies its
    masters back (tried: weights 2e-4 apart, updates 2.7%), hence the update check too."""
    (old_m, old), (new_m, new) = build(name, "old", init), build(name, "new", init)
    for step in (stepper(old_m, old, data), stepper(new_m, new, data)):
        for _ in range(CHECK_STEPS):
            step()
    start, want = dict(init.named_parameters()), old.fp32_weights()
    worst, diff2, update2, failure = 0.0, 0.0, 0.0, None
    for n, p in new_m.named_parameters():
        w, ref = p.detach(), want[n].detach()
        d = w.double() - ref.double()
        worst, diff2 = max(worst, d.abs().max().item()), diff2 + d.square().sum().item()
        update2 += (ref.double() - start[n].detach().double()).square().sum().item()
        if failure is None and not (w.dtype == ref.dtype == torch.float32 and
                                    torch.allclose(w, ref, rtol=W_RTOL, atol=W_ATOL)):
            failure = f"{n}: {w.dtype} vs {ref.dtype}, max |dw| {d.abs().max():.3g}"
    rel = (diff2 / update2) ** 0.5 if update2 > 0 else float("inf")
    if failure is None and not rel <= UPDATE_RTOL:
        failure = f"updates {rel:.2%} apart (more than {UPDATE_RTOL:.0%})"
    return worst, rel, failure


def _status(field: str) -> float:  # VmRSS, VmHWM in MB
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def memory_of(side: str, name: str, batch: int) -> dict:
    """Peak RSS of MEMORY_STEPS steps over the RSS before the model (in a fresh process; see above)."""
    data = batches(name, batch)
    stepper(*build(name, side), data)()   # the throwaway
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    base = _status("VmRSS")
    step = stepper(*build(name, side), data)
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        method = "VmHWM"
    except OSError:
        method = "ru_maxrss"
    for _ in range(MEMORY_STEPS):
        step()
    peak = _status("VmHWM") if method == "VmHWM" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mb": peak - base, "method": method}


def measure_memory(runs: List[Tuple[str, str, int]]) -> Dict[Tuple[str, str], dict]:
    """``(side, model, batch)`` -> :func:`memory_of` in a fresh process each, all at once after the timing (an
    RSS is per process: they slow each other down, but cannot change each other's figures)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    procs = {(side, name): subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--memory-of", side, "--model", name, "--batch", str(batch),
         "--threads", str(torch.get_num_threads())], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env) for side, name, batch in runs}
    out = {}
    for key, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"memory run of {key} failed:\n{stderr[-2000:]}")
        out[key] = json.loads(stdout.strip().splitlines()[-1])
    return out


def run_model(name: str, args) -> dict:
    factory, _, batch, quick_batch, steps, spec = CASES[name]
    batch, steps = (quick_batch, 16) if args.quick else (batch, steps)
    data, steps = batches(name, batch), args.steps or steps
    torch.manual_seed(0)
    init = factory()
    print(f"\n== {name}: {spec}, batch {batch}, SGD lr {LR} momentum {MOMENTUM}", flush=True)
    worst, rel, failure = same_training(name, init, data)
    tolerance = f"weights rtol={W_RTOL} atol={W_ATOL}, updates {UPDATE_RTOL:.0%}"
    if failure:
        print(f"   same training: NO ({failure}; {tolerance})")
        raise SystemExit(1)
    print(f"   same training: yes (max |dw| = {worst:.2e}, updates {rel:.2%} apart after {CHECK_STEPS} steps, new "
          f"parameters vs old fp32 masters; {tolerance})", flush=True)
    contenders = []
    for side in ("old", "new"):
        model, opt = build(name, side, init)
        contenders.append(Contender(side, stepper(model, opt, data), switches=read_switches()))
    warmup, per_round = plan_rounds(steps, args.rounds, args.warmup)
    t0 = time.perf_counter()
    alternate(contenders, warmup=warmup, rounds=args.rounds, steps_per_round=per_round)
    old, new = contenders
    ratio = speedup(old.round_seconds, new.round_seconds)
    print(f"   timed {args.rounds} rounds x {per_round} steps per side after {warmup} warm-up steps in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    return {"model": name, "spec": spec, "batch": batch, "max_dw": worst, "update_diff": rel, "warmup": warmup,
            "steps_per_round": per_round, "old_ms": Spread.of(old.step_seconds).scaled(1e3).__dict__,
            "new_ms": Spread.of(new.step_seconds).scaled(1e3).__dict__, "speedup": ratio.to_dict(),
            "describe": ratio.describe()}


def main(argv: Optional[List[str]] = None) -> List[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help=f"comma-separated, from {', '.join(CASES)} (default: all; "
                                                   "--quick: demo,mlp)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 12; --quick 8)")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per side, warm-up included (default: demo and mlp 48, vit 16; --quick 16)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per side, at least (default 3; --quick 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: see above)")
    ap.add_argument("--quick", action="store_true", help="demo and mlp, smaller batches, fewer steps")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the results there")
    ap.add_argument("--memory-of", choices=("old", "new"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_of:
        print(json.dumps(memory_of(args.memory_of, args.model, args.batch)))
        return []
    args.rounds = args.rounds or (8 if args.quick else 12)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    names = (args.models or ("demo,mlp" if args.quick else ",".join(CASES))).split(",")
    if any(n not in CASES for n in names):
        ap.error(f"unknown model in --models {','.join(names)}; choose from {', '.join(CASES)}")

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"O2 bf16 step, new (half compute copies) vs old (half model + fp32 masters): torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), load average {load:.1f}, {args.rounds} rounds")
    t0 = time.perf_counter()
    results = [run_model(n, args) for n in names]
    print(f"\npeak memory: {2 * len(results)} fresh processes, one per side and model ...", flush=True)
    memory = measure_memory([(side, r["model"], r["batch"]) for r in results for side in ("old", "new")])
    ms = lambda s: f"{s['median']:.1f} ({s['p10']:.1f}-{s['p90']:.1f})"  # noqa: E731
    print(f"\n{'model':<6} {'old ms (p10-p90)':>22} {'new ms (p10-p90)':>22} {'peak MB old / new':>18}  "
          "new vs old (old/new per round)")
    for r in results:
        r["memory"] = {side: memory[(side, r["model"])] for side in ("old", "new")}
        mem = f"{r['memory']['old']['peak_mb']:.1f} / {r['memory']['new']['peak_mb']:.1f}"
        print(f"{r['model']:<6} {ms(r['old_ms']):>22} {ms(r['new_ms']):>22} {mem:>18}  {r['describe']}")
    print(f"({time.perf_counter() - t0:.0f} s; peak memory by {memory[('new', names[0])]['method']})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()

"""What each precision costs on this CPU: training-step time of small CNNs through ``aiak.optimize``.

    python benchmarks/precision_cpu.py [--models demo,resnet18] [--candidates "fp32,O2 fp16,..."]
                                       [--rounds 15] [--isa-cap AVX2]

Candidates: fp32 (the ``default`` strategy), O2 fp16, O2 bf16, O1 bf16 (and O1 fp16 on request). Every
candidate is built from the same seed, warmed up, then the candidates are timed in rounds by
``optimizers.time_round_robin`` (the order is shuffled each round, so drift on a noisy machine hits all of
them); each round times one full step (forward, backward, step, zero_grad) of every candidate. The table
gives the median step time with its p10-p90 spread, the ratio to fp32 (median over rounds of the per-round
ratio, with its min-max), and the ratio of the p10 step times: on a machine shared with other work, the
fastest decile is the least disturbed estimate of each cost.

``--isa-cap ISA`` sets ``ONEDNN_MAX_CPU_ISA`` for this run: oneDNN (which runs the convolutions and matmuls)
then behaves as on a CPU without the newer instructions, e.g. ``AVX2`` for a CPU without AVX512-BF16. It
is an approximation of such a CPU (ATen's own kernels still see the real one) and the table says so.
The figures quoted in aiak's precision warnings (``aiak/amp/emulation.py``) come from this script.

:func:`gpu_checks` holds the CUDA rows of ``aiak.amp`` (probe, emulation rule, exact norms under O2, clipping
routed to the step controller, inductor through aiak's compile fallback) for ``benchmarks/gpu_check.py``.
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import warnings
from typing import Callable, Dict, List, Tuple

CANDIDATES: Dict[str, object] = {
    "fp32": "default",
    "O2 fp16": {"precision": {"level": "O2", "dtype": "fp16"}},
    "O2 bf16": {"precision": {"level": "O2", "dtype": "bf16"}},
    "O1 bf16": {"precision": {"level": "O1", "dtype": "bf16"}},
    "O1 fp16": {"precision": {"level": "O1", "dtype": "fp16"}},  # not in the default set: --candidates
    # fp8 (torchao, emulated off fp8 tensor cores): --models mlp --candidates "O2 bf16,fp8 tensorwise,fp8 rowwise"
    "fp8 tensorwise": {"precision": {"level": "O2", "dtype": "bf16", "fp8": "tensorwise"}},
    "fp8 rowwise": {"precision": {"level": "O2", "dtype": "bf16", "fp8": "rowwise"}},
}
DEFAULT_CANDIDATES = ("fp32", "O2 fp16", "O2 bf16", "O1 bf16")


def _models() -> Dict[str, Tuple[Callable, Tuple[int, ...]]]:
    """name -> (factory, input shape): the demo's ResNet-like DemoNet and torchvision's resnet18, CPU-sized, and a
    transformer-shaped MLP (two 256-1024-256 feed-forward blocks over 64 tokens, a 10-class head), whose linear
    layers fp8 converts."""
    def demo():
        from aiak.cli.demo import DemoNet
        return DemoNet(width=16)

    def resnet18():
        import torchvision
        return torchvision.models.resnet18(num_classes=10)

    def mlp():
        from torch import nn
        blocks = [nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(2)]
        return nn.Sequential(nn.Linear(256, 256), *blocks, nn.Linear(256, 10))

    return {"demo": (demo, (32, 3, 32, 32)), "resnet18": (resnet18, (8, 3, 64, 64)), "mlp": (mlp, (64, 256))}


class Setup:
    """One candidate: a freshly seeded model + SGD through ``aiak.optimize``, and a fixed batch."""

    def __init__(self, factory: Callable, shape: Tuple[int, ...], strategy: object):
        import torch

        import aiak

        torch.manual_seed(0)
        model = factory()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        aiak_logger = logging.getLogger("aiak")
        level = aiak_logger.level
        aiak_logger.setLevel(logging.ERROR)  # the warnings' logger copy too
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the emulation warnings are what this script measures
            self.model, self.optimizer, _ = aiak.optimize(model, optimizer, strategy=strategy)
        aiak_logger.setLevel(level)
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(*shape, generator=g)
        self.y = torch.randint(0, 10, (shape[0],), generator=g)

    def step(self) -> None:
        import torch

        loss = torch.nn.functional.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def _quantile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def measure(name: str, candidates: List[str], rounds: int, warmup: int, baseline: str = "fp32") -> List[dict]:
    from optimizers import time_round_robin

    factory, shape = _models()[name]
    setups = {cand: Setup(factory, shape, CANDIDATES[cand]) for cand in candidates}
    times = time_round_robin({cand: setup.step for cand, setup in setups.items()}, repeats=rounds, warmup=warmup)
    rows = []
    for cand in setups:
        ratios = [c / b for c, b in zip(times[cand], times[baseline])]  # paired within each round
        rows.append({"model": name, "candidate": cand, "median_ms": 1e3 * statistics.median(times[cand]),
                     "p10_ms": 1e3 * _quantile(times[cand], 0.1), "p90_ms": 1e3 * _quantile(times[cand], 0.9),
                     "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                     "p10_ratio": _quantile(times[cand], 0.1) / _quantile(times[baseline], 0.1)})
    return rows


def _cpu_line() -> str:
    from aiak.util.machine.cpu import NATIVE_BF16_CPU_FLAGS, NATIVE_FP16_CPU_FLAGS, cpu_features

    model_name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            model_name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                              model_name)
    except OSError:
        pass
    flags = sorted(cpu_features() & (NATIVE_BF16_CPU_FLAGS | NATIVE_FP16_CPU_FLAGS | {"avx512f", "amx_tile"}))
    return f"{model_name}, {os.cpu_count()} cores, half-precision flags: {', '.join(flags) or 'none'}"


def _row(check, ok, metric, value):
    return {"check": check, "ok": bool(ok), "metric": metric, "value": value}


def root_scaling_row(dev) -> dict:
    """fp16 loss scaling at the backward's root (:mod:`aiak.amp.scaling.root_scaling`) on ``dev``, where a CUDA backward
    runs on a device thread: an auxiliary loss kept on the module, a block under reentrant checkpointing (a
    backward inside the backward) and a gradient penalty's ``autograd.grad``, all in one loss; O2 fp16 against the
    same model in fp32. Goal: every parameter's gradient within cosine 0.99 and 5% of its norm, and the input's."""
    import copy

    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    import aiak

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.side, self.head = nn.Linear(16, 32), nn.Linear(32, 8), nn.Linear(32, 4)
            self.block = nn.Sequential(nn.Linear(32, 32), nn.Tanh())

        def forward(self, x):
            h = checkpoint(self.block, self.stem(x), use_reentrant=True)
            self.aux_loss = self.side(h).pow(2).mean()
            return self.head(h)

    torch.manual_seed(0)
    ref = Net().to(dev)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _, _ = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    strategy={"precision": {"level": "O2", "dtype": "fp16", "loss_scale": 1024}})
    x, z = torch.randn(8, 16, device=dev), torch.randn(8, 32, device=dev)
    inputs = []
    for m in (model, ref):
        inp, feature = x.clone().requires_grad_(), z.clone().requires_grad_()
        out = m(inp)
        g, = torch.autograd.grad(m.head(feature).sum(), feature, create_graph=True)  # (reentrant checkpointing
        # refuses autograd.grad through it, so the penalty is on the head's own input)
        (out.logsumexp(1).mean() + 0.1 * m.aux_loss + ((g.norm(dim=1) - 1) ** 2).mean()).backward()
        inputs.append(inp.grad)
    pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())] + [tuple(inputs)]
    cos = min(float(nn.functional.cosine_similarity(a.flatten().float(), b.flatten(), 0)) for a, b in pairs)
    off = max(abs(float(a.norm() / b.norm()) - 1) for a, b in pairs)
    return _row("amp: fp16 root scaling (aux, checkpoint, penalty)", cos >= 0.99 and off <= 0.05,
                "min cosine, max norm off (goal .99, 5%)", f"{cos:.4f}, {off:.2%}")


def counted_items_row(dev, dtype: str = "fp16") -> dict:
    """Accumulation averaged by counted items (``count_items=fn``, the counts 0-dim tensors on ``dev``) under
    ``dtype`` O1 with its loss scaling, against plain fp32 PyTorch on one big batch per window (one mean over all
    its tokens). Goal: the final weights within 2e-3 of it, where the mean of the micro-batches' means is further
    off than that, and no step skipped for overflow."""
    import torch
    from torch import nn

    import aiak
    from aiak.step.controller import controller_of

    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(8):
        length = int(torch.randint(2, 40, (1,), generator=g))
        ids, labels = torch.randint(0, 16, (4, length), generator=g), torch.randint(0, 16, (4, length), generator=g)
        labels[:, int(torch.randint(1, length + 1, (1,), generator=g)):] = -100
        batches.append({"ids": ids.to(dev), "labels": labels.to(dev)})

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(16, 32), nn.Tanh(), nn.Linear(32, 16)).to(dev)
        return model, torch.optim.SGD(model.parameters(), lr=0.5)

    def loss_of(model, b, reduction="mean"):
        return nn.functional.cross_entropy(model(b["ids"]).flatten(0, 1).float(), b["labels"].flatten(),
                                           ignore_index=-100, reduction=reduction)

    big, big_opt = build()
    means, means_opt = build()
    for w in range(0, 8, 4):
        window = batches[w:w + 4]
        tokens = sum(int((b["labels"] != -100).sum()) for b in window)
        (sum(loss_of(big, b, "sum") for b in window) / tokens).backward()
        for b in window:
            (loss_of(means, b) / 4).backward()
        for opt in (big_opt, means_opt):
            opt.step()
            opt.zero_grad()
    model, opt = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = aiak.optimize(model, opt, batches, count_items=lambda b: (b["labels"] != -100).sum(),
                                           strategy={"grad_accumulation": 4, "tune": False,
                                                     "precision": {"level": "O1", "dtype": dtype}})
    for b in loader:
        loss_of(model, b).backward()
        opt.step()
        opt.zero_grad()
    scaler = controller_of(opt).scaler
    skipped = scaler.skipped_steps if scaler is not None else 0

    def off(a):
        return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), big.parameters()))

    got, unweighted = off(model), off(means)
    return _row(f"amp: counted items under O1 {dtype}", got <= 2e-3 < unweighted and skipped == 0,
                "max |w - big batch|, mean of means, skipped (goal <= 2e-3 < it, 0)",
                f"{got:.1e}, {unweighted:.1e}, {skipped}")


def gpu_checks() -> list:
    """CUDA checks of aiak.amp, one row each with its goal: run by ``benchmarks/gpu_check.py`` on a GPU."""
    import copy

    import torch
    from torch import nn

    import aiak
    from aiak.amp.emulation import emulation_warning
    from aiak.strategy.probes import cuda_capability

    dev = torch.device("cuda")
    rows = []
    cap, want = cuda_capability(dev), tuple(torch.cuda.get_device_capability(dev))
    rows.append(_row("amp: cuda_capability probe", cap == want, "probe / torch (goal: equal)", f"{cap} / {want}"))
    warned = emulation_warning("bf16", dev) is not None
    rows.append(_row("amp: bf16 emulation warning", warned == (want < (8, 0)), "warns (goal: only below sm80)", warned))

    # O2 fp16 keeps BatchNorm values fp16 cannot hold, exactly, and steps them like fp32
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(4), nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 8 * 8, 3)).to(dev)
    with torch.no_grad():
        model[0].running_var.fill_(1e5)
        model[0].weight.fill_(1.0001)
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.01) for m in (model, ref))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, _ = aiak.optimize(model, opt, strategy={"precision": {"level": "O2", "dtype": "fp16"}})
    exact = bool(model[0].running_var.eq(1e5).all() and model[0].weight.eq(ref[0].weight).all())
    rows.append(_row("amp: O2 fp16 BatchNorm values exact", exact, "running_var 1e5, weight 1.0001 kept", exact))
    x = torch.randn(16, 4, 8, 8, device=dev).half().float()
    y = torch.randint(0, 3, (16,), device=dev)
    for m, o in ((model, opt), (ref, ref_opt)):
        (nn.functional.cross_entropy(m(x), y) * 0).backward()  # zero loss: only weight decay and BN statistics
        o.step()
    same = torch.equal(model[0].weight, ref[0].weight)
    close = torch.allclose(model[0].running_var, ref[0].running_var, rtol=1e-5)
    rows.append(_row("amp: O2 fp16 BatchNorm update = fp32", same and close, "weight equal, running_var rtol 1e-5",
                     f"{same}, {close}"))

    # the user's torch.nn.utils.clip_grad_norm_ under O2 fp16 + accumulation 4 = fp32 reference
    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 3)).to(dev)

    ref, model = mlp(), mlp()
    start = [p.detach().clone() for p in ref.parameters()]
    ref_opt, opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, _ = aiak.optimize(model, opt, strategy={"precision": {"level": "O2", "dtype": "fp16"},
                                                            "grad_accumulation": 4})
    g = torch.Generator(device=dev).manual_seed(0)
    for _ in range(4):
        x, y = torch.randn(32, 12, device=dev, generator=g), torch.randint(0, 3, (32,), device=dev, generator=g)
        for xs, ys in zip(x.split(8), y.split(8)):
            (nn.functional.cross_entropy(ref(xs), ys) / 4).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
        for xs, ys in zip(x.split(8), y.split(8)):
            nn.functional.cross_entropy(model(xs), ys).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
    moved = torch.cat([(r.detach() - s).flatten() for r, s in zip(ref.parameters(), start)]).norm()
    off = torch.cat([(m.detach().float() - r.detach()).flatten()
                     for m, r in zip(model.parameters(), ref.parameters())]).norm()
    rows.append(_row("amp: clip_grad_norm_ O2 fp16 + accum 4", off <= 0.06 * moved,
                     "|w-w_ref|/|w_ref-w0| (goal <= 0.06)", f"{float(off / moved):.4f}"))

    rows.append(root_scaling_row(dev))
    rows.append(counted_items_row(dev, "fp16"))
    rows.append(counted_items_row(dev, "bf16"))

    # compile: true with inductor runs compiled (no eager fallback) and computes what eager does
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10)).to(dev)
    ref = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _, _ = aiak.optimize(model, strategy={"compile": True})
        x = torch.randn(32, 64, device=dev)
        out, want_out = model(x), ref(x)
    fell_back = any("runs eager" in str(w.message) for w in caught)
    err = float((out - want_out).abs().max())
    rows.append(_row("amp: compile (inductor) via aiak", not fell_back and err < 1e-3,
                     "fell back / max |out - eager| (goal: no, < 1e-3)", f"{fell_back} / {err:.2e}"))

    # O2 bf16 on CUDA: the parameters stay fp32 (the conv computes with a bf16 copy), an EMA deepcopy is
    # independent, and compiled (inductor) gradients equal the eager ones to bf16 rounding
    def o2_net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                             nn.Linear(8 * 6 * 6, 10)).to(dev)

    eager, compiled = o2_net(), o2_net()
    o2 = {"precision": {"level": "O2", "dtype": "bf16"}}
    eager, _, _ = aiak.optimize(eager, torch.optim.SGD(eager.parameters(), lr=0.1), strategy=o2)
    compiled, _, _ = aiak.optimize(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1),
                                   strategy={**o2, "compile": True})
    seen = []
    eager[0].register_forward_hook(lambda m, a, o: seen.append(m.weight.dtype))
    x, y = torch.randn(16, 3, 8, 8, device=dev), torch.randint(0, 10, (16,), device=dev)
    ema = copy.deepcopy(eager)
    for m in (eager, compiled):
        nn.functional.cross_entropy(m(x), y).backward()
    fp32 = all(p.dtype == torch.float32 for p in eager.parameters())
    independent = ema[0].weight.data_ptr() != eager[0].weight.data_ptr()
    rows.append(_row("amp: O2 bf16 leaves fp32 parameters", fp32 and seen[:1] == [torch.bfloat16] and independent,
                     "params fp32 / conv computes in / EMA copy independent (goal: True, bf16, True)",
                     f"{fp32} / {seen[:1]} / {independent}"))
    grads = [(a.grad, b.grad) for a, b in zip(eager.parameters(), compiled.parameters())]
    missing = sum(b is None for _, b in grads)
    err = max(float((a - b).abs().max() / (a.abs().max() + 1e-12)) for a, b in grads if b is not None)
    rows.append(_row("amp: O2 bf16 compiled grads = eager", missing == 0 and err < 2e-2,
                     "missing grads / max relative |g - g_eager| (goal: 0, < 2e-2)", f"{missing} / {err:.2e}"))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="demo,resnet18", help="comma-separated: demo, resnet18, mlp")
    ap.add_argument("--candidates", default=",".join(DEFAULT_CANDIDATES),
                    help=f"comma-separated, fp32 always included: {', '.join(CANDIDATES)}")
    ap.add_argument("--rounds", type=int, default=15, help="timed rounds (one step of every candidate each)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per candidate before the rounds")
    ap.add_argument("--baseline", default="fp32", help="the candidate the ratios are to (one of --candidates)")
    ap.add_argument("--isa-cap", default=None, help="set ONEDNN_MAX_CPU_ISA (e.g. AVX2) to approximate an older CPU")
    args = ap.parse_args(argv)
    if args.isa_cap:
        os.environ["ONEDNN_MAX_CPU_ISA"] = args.isa_cap  # read by oneDNN when its first primitive is created
    import torch

    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in _models()]
    if unknown:
        ap.error(f"--models: unknown {unknown}; valid: {', '.join(_models())}")
    candidates = ["fp32"] + [c.strip() for c in args.candidates.split(",") if c.strip() and c.strip() != "fp32"]
    unknown = [c for c in candidates if c not in CANDIDATES]
    if unknown:
        ap.error(f"--candidates: unknown {unknown}; valid: {', '.join(CANDIDATES)}")
    print(f"precision_cpu: torch {torch.__version__}, {torch.get_num_threads()} threads; CPU: {_cpu_line()}")
    if args.isa_cap:
        print(f"oneDNN capped at ONEDNN_MAX_CPU_ISA={args.isa_cap} (approximates a CPU without newer instructions)")
    print(f"{args.rounds} rounds of one step per candidate, {args.warmup} warm-up steps, order shuffled each round")
    if args.baseline not in candidates:
        ap.error(f"--baseline: {args.baseline!r} is not among the candidates {candidates}")
    vs = f"vs {args.baseline}"
    print(f"\n{'model':<9} {'candidate':<14} {'median ms':>10} {'p10-p90 ms':>19} {vs:>11} {'(min-max)':>15} "
          f"{'p10 ' + vs:>15}")
    for name in names:
        for row in measure(name, candidates, args.rounds, args.warmup, args.baseline):
            spread = f"{row['p10_ms']:.1f}-{row['p90_ms']:.1f}"
            ratio_range = f"({row['ratio_min']:.2f}-{row['ratio_max']:.2f})"
            print(f"{row['model']:<9} {row['candidate']:<14} {row['median_ms']:>10.1f} {spread:>19} "
                  f"{row['ratio']:>10.2f}x {ratio_range:>15} {row['p10_ratio']:>14.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One script that checks and times every CUDA path of aiak on one GPU, in under 8 minutes.

    python benchmarks/gpu_check.py [--only core,auto,amp,loaders,optim,ops,comm,doctor,bench,fp8,compile,fsdp,lce]
                                   [--budget-s 420]

Sections: core (TF32 switch, O1/O2 fp16/bf16 on CUDA vs fp32, overflow skip, step time against goals),
auto (the probe on CUDA, the CUDA rules, trials timed with CUDA events and their peak memory, winner >= plain,
final loss vs fp32, cache hit),
amp (capability probe, exact norm layers under O2 fp16, torch's clip_grad_norm_ under O2 + accumulation,
inductor through aiak), loaders (side-stream copy hidden under compute, record_stream, CUDA-resident source
batches, DALI GPU output), optim (LAMB/LARS on CUDA; torch's fused step against its foreach default), ops
(Triton window attention: correctness, the largest admitted shape, the speed goals), comm (int8 codec, the hook pipeline's stream order with CPU-Reduce's host
copies, NaN recovery, autotune and NCCL socket candidates in child processes on a one-rank NCCL group), doctor (what it reads of the GPUs, NCCL, Triton and DALI on the GPU),
bench (``aiak bench`` on resnet18: CUDA memory, CUDA kernels in its trace, default = plain), fp8 (a transformer
block at widths 4096 and 8192, compiled: tensorwise and rowwise against bf16, step time and loss; several minutes
of compiling, so run it with ``--only fp8`` when the budget is short), compile (an MLP, a ViT and GPT-2 compiled
under O2 and O1 bf16: graphs and step time against compiled plain autocast; minutes of compiling too), fsdp
(``comm.engine: fsdp2`` against DDP on 2 GPUs: per-rank training state and step time; not measured on one GPU),
lce (the language-model head without its logits: each implementation against fp64, the head's and a one-layer
Llama step's peak memory and time against plain at a 128k vocabulary, ``benchmarks/linear_cross_entropy.py``).
Every row compares what it measured to its goal and says ok or NO.
Exit status 1 if any check failed. Without CUDA it prints why and exits 0 having checked nothing (so it is
safe to run anywhere).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling benchmark modules

from optimizers import time_round_robin  # noqa: E402  (alternating rounds, warm-up, CUDA-synchronised)


def _row(check, ok, metric, value):
    return {"check": check, "ok": bool(ok), "metric": metric, "value": value}


def _spread(samples) -> str:
    """median [p10-p90] of a list of seconds, in ms."""
    q = statistics.quantiles(samples, n=10, method="inclusive") if len(samples) >= 2 else samples * 9
    return f"{statistics.median(samples) * 1e3:.2f} [{q[0] * 1e3:.2f}-{q[-1] * 1e3:.2f}] ms"


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _steps(fn, n: int):
    """One timed sample: ``n`` training steps (a single step of a small model is too short to time alone)."""
    def run():
        for _ in range(n):
            fn()
    return run


def core_checks(device: str = "cuda", speed_shape=(128, 256, 64), rounds: int = 7, numerics_shape=(64, 128, 32)) -> list:
    """TF32 switch, O1/O2 on CUDA against fp32, overflow skipping, and the step-time goals of each precision.

    ``speed_shape`` and ``numerics_shape`` are (DemoNet width, batch, image size) of the timed and the
    trained-for-30-steps models. ``device="cpu"`` with a small
    shape dry-runs the same code on CPU (the TF32 row then fails: no CUDA)."""
    import aiak
    from aiak.cli.demo import DemoNet

    rows = []
    dev = torch.device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    m = nn.Linear(8, 8).to(dev)
    aiak.optimize(m, strategy={"tf32": True})
    rows.append(_row("core: tf32 switch", torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32,
                     "allow_tf32 after optimize (goal True)", torch.backends.cuda.matmul.allow_tf32))

    def setup(strategy, width=64, batch=128, image=32, seed=0):
        """A fresh model and data; ``strategy`` None is plain PyTorch, TF32 off."""
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        torch.manual_seed(seed)
        model = DemoNet(width=width).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if strategy is not None:
            model, opt, _ = aiak.optimize(model, opt, strategy=strategy)
        g = torch.Generator(device=dev).manual_seed(seed)
        x = torch.randn(batch, 3, image, image, device=dev, generator=g)
        y = torch.randint(0, 10, (batch,), device=dev, generator=g)

        def step():
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return model, opt, step

    # numerics: 30 steps of each precision against fp32 (stated tolerance: final loss within 5% of fp32)
    def final_loss(strategy, steps=30):
        width, batch, image = numerics_shape
        _, _, step = setup(strategy, width=width, batch=batch, image=image)
        for _ in range(steps):
            loss = step()
        return float(loss)

    base_loss = final_loss(None)
    precisions = {"O1 fp16": {"precision": {"level": "O1", "dtype": "fp16"}},
                  "O1 bf16": {"precision": {"level": "O1", "dtype": "bf16"}},
                  "O2 fp16": {"precision": {"level": "O2", "dtype": "fp16"}, "channels_last": True},
                  "O2 bf16": {"precision": {"level": "O2", "dtype": "bf16"}, "channels_last": True}}
    for name, strategy in precisions.items():
        loss = final_loss(strategy)
        rows.append(_row(f"core: {name} final loss vs fp32", abs(loss - base_loss) <= 0.05 * base_loss + 1e-3,
                         "loss / fp32 loss (goal within 5%)", f"{loss:.4f} / {base_loss:.4f}"))

    # speed: a compute-bound conv net (about 1 TFLOP per step), every candidate against plain fp32 in
    # alternating rounds. Goals: default costs nothing (<= 1.03x), TF32 and half precision pay on tensor cores.
    goals = {"default": ("<=", 1.03), "tf32": (">=", 1.5), "O1 bf16": (">=", 1.5), "O2 fp16": (">=", 1.8),
             "O2 bf16": (">=", 1.8)}
    strategies = {"default": "default", "tf32": {"tf32": True}, "O1 bf16": precisions["O1 bf16"],
                  "O2 fp16": precisions["O2 fp16"], "O2 bf16": precisions["O2 bf16"]}
    width, batch, image = speed_shape
    runs = {"fp32": setup(None, width=width, batch=batch, image=image)[2]}
    for name, strategy in strategies.items():
        runs[name] = setup(strategy, width=width, batch=batch, image=image)[2]
        if name == "tf32":  # setup() turned TF32 off for the baseline; this candidate's optimize() turned it on
            runs[name] = _with_tf32(runs[name])
    steps = 10
    times = time_round_robin({name: _steps(fn, steps) for name, fn in runs.items()}, repeats=rounds, warmup=1,
                             sync=_sync)
    times = {name: [t / steps for t in samples] for name, samples in times.items()}  # seconds per step
    base = statistics.median(times["fp32"])
    for name, (op, goal) in goals.items():
        ratio = base / statistics.median(times[name])  # > 1: faster than fp32
        slowdown = 1 / ratio
        ok = slowdown <= goal if op == "<=" else ratio >= goal
        what = "step time / fp32" if op == "<=" else "speedup vs fp32"
        rows.append(_row(f"core: {name} step time", ok, f"{what} (goal {op} {goal}x)",
                         f"{slowdown if op == '<=' else ratio:.2f}x ({_spread(times[name])} vs fp32 {_spread(times['fp32'])})"))

    # fp16 O2 overflow: an inf gradient skips the step (weights unchanged) and halves the scale; training then
    # goes on (the next clean step changes the weights and keeps the scale)
    width, batch, image = numerics_shape
    model, opt, step = setup({"precision": {"level": "O2", "dtype": "fp16"}}, width=width, batch=batch, image=image)
    step()
    ctl = opt._aiak_steps
    scale, w = ctl.scaler.scale, next(model.parameters()).detach().clone()
    x = torch.randn(4, 3, image, image, device=dev)
    (model(x).sum() * float("inf")).backward()
    opt.step()
    opt.zero_grad()
    skipped = ctl.scaler.scale == scale / 2 and torch.equal(w, next(model.parameters()))
    rows.append(_row("core: fp16 O2 overflow skips the step", skipped, "scale halved, weights kept (goal both)",
                     f"scale {scale:g} -> {ctl.scaler.scale:g}"))
    step()
    resumed = not torch.equal(w, next(model.parameters())) and ctl.scaler.scale == scale / 2 \
        and all(torch.isfinite(p).all() for p in model.parameters())
    rows.append(_row("core: fp16 O2 trains on after an overflow", resumed, "next step changes finite weights",
                     f"skipped {ctl.scaler.skipped_steps}"))
    return rows


def _with_tf32(step):
    def run():
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        try:
            return step()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    return run


def auto_checks(device: str = "cuda", width: int = 64, batch: int = 128, size: int = 32) -> list:
    """The auto-selector on a GPU: the probe reads the device right, the rules match the CUDA profiles, the
    trials run on CUDA (event-timed, peak memory recorded), pick a strategy at least as fast as plain fp32,
    train to fp32's loss, and a second call is a cache hit. ``device="cpu"`` dry-runs it on CPU."""
    import aiak
    from aiak.cli.demo import DemoNet, synthetic_dataset
    from aiak.strategy.probes import probe
    from aiak.strategy.select import select
    from torch.utils.data import DataLoader

    rows = []
    dev = torch.device(device)

    def setup():
        torch.manual_seed(0)
        model = DemoNet(width=width).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loader = DataLoader(synthetic_dataset(batch * 40, image_size=size), batch_size=batch, shuffle=True,
                            generator=torch.Generator().manual_seed(0), drop_last=True)
        return model, opt, loader

    model, opt, loader = setup()
    p = probe(model, opt, loader)
    cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    rows.append(_row("auto: probe reads the device", p.device == dev.type and (cap is None or tuple(p.cuda_capability) == cap)
                     and p.bf16_native == (cap is not None and cap >= (8, 0)),
                     "device, capability, bf16 (goal match torch)", f"{p.device} {p.cuda_capability} bf16={p.bf16_native}"))
    sel = select(model, opt, loader)
    want = ({"cuda", "cnn"} | ({"cuda_bf16"} if cap >= (8, 0) else set())) if cap else set()
    rows.append(_row("auto: CUDA rules match", want <= set(sel.matched), "matched (goal cuda, cnn, cuda_bf16 on sm80+)",
                     ", ".join(sel.matched)))

    def train(model, opt, loader, steps=30):
        for i, (x, y) in enumerate(loader):
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if i + 1 == steps:
                break
        return float(loss.detach())

    plain_loss = train(*setup())
    model, opt, loader = aiak.optimize(*setup())
    d = aiak.last_decision().to_dict()
    chosen = next((t for t in d["trials"] if "chosen" in t["why"]), None)
    rows.append(_row("auto: trials ran on the device", len(d["trials"]) >= 3 and chosen is not None
                     and (dev.type != "cuda" or all(t["peak_mem_mb"] for t in d["trials"] if t["accepted"])),
                     "trials, peak memory (goal >= 3, recorded)",
                     "; ".join(f"{t['label']} {t['speedup'] and round(t['speedup'], 2)}x" for t in d["trials"])))
    rows.append(_row("auto: winner vs plain in the trials", chosen is not None and chosen["speedup"] >= 0.98,
                     "speedup (goal >= 0.98x)", f"{chosen['label']} {chosen['speedup']:.2f}x, tuning {d['tuning_seconds']:.2f} s"
                     if chosen else "none"))
    loss = train(model, opt, loader)
    rows.append(_row("auto: final loss vs fp32", abs(loss - plain_loss) <= 0.05 * plain_loss + 1e-3,
                     "30 steps (goal within 5%)", f"{loss:.4f} vs {plain_loss:.4f}"))
    aiak.optimize(*setup())
    rows.append(_row("auto: second call is a cache hit", aiak.last_decision().cache_hit, "cache_hit (goal true)",
                     str(aiak.last_decision().cache_hit)))
    return rows


def bench_checks() -> list:
    """``aiak bench`` on the GPU (subprocess, as a user runs it): CUDA memory figures, the profiler's CUDA
    kernels in the trace, ``default`` within noise of plain PyTorch with the same loss, auto at least plain."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "aiak.cli", "bench", "--model", "timm:resnet18", "--batch-size", "64",
               "--steps", "40", "--rounds", "20", "--strategy", "default", "--strategy", "auto", "--json",
               "--no-progress", "--trace", tmp]
        t = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        seconds = time.perf_counter() - t
        rows = [_row("bench: runs", out.returncode == 0, "exit code (goal 0)",
                     f"{out.returncode} in {seconds:.0f} s {out.stderr.strip().splitlines()[-1:] if out.returncode else ''}")]
        if out.returncode != 0:
            return rows
        report = json.loads(out.stdout.strip().splitlines()[-1])
        default, auto = report["strategies"]["default"], report["strategies"]["auto"]
        rows.append(_row("bench: CUDA memory", report["mem_kind"] == "cuda" and (auto["peak_mem_mb"] or 0) > 0,
                         "mem_kind, auto peak MB (goal cuda, > 0)", f"{report['mem_kind']}, {auto['peak_mem_mb']}"))
        # cuDNN's backward kernels may add in another order from run to run: the losses agree to 1e-3, not bits
        same_loss = abs(default["final_loss"] - report["baseline"]["final_loss"]) <= 1e-3 * max(
            1.0, abs(report["baseline"]["final_loss"]))
        rows.append(_row("bench: default = plain", default["verdict"] == "within noise" and same_loss,
                         "verdict, loss (goal noise, 1e-3)", f"{default['verdict']} {default['speedup']:.2f}x, "
                         f"{default['final_loss']} vs {report['baseline']['final_loss']}"))
        rows.append(_row("bench: auto >= plain", auto["verdict"] != "slower", "verdict (goal not slower)",
                         f"{auto['verdict']} {auto['speedup']:.2f}x"))
        trace = json.loads(Path(report["traces"]["auto"]).read_text())["traceEvents"]
        kernels = sum(e.get("cat") == "kernel" for e in trace)
        rows.append(_row("bench: trace has CUDA kernels", kernels > 0, "kernel events (goal > 0)", kernels))
    return rows


def section(name: str):
    if name == "core":
        return core_checks()
    if name == "auto":
        return auto_checks()
    if name == "amp":
        from precision_cpu import gpu_checks
        return gpu_checks()
    if name == "loaders":
        from loader_overlap import gpu_checks
        return gpu_checks()
    if name == "optim":
        from fused_step import gpu_checks as fused_step_checks
        from optimizers import gpu_checks
        return gpu_checks() + fused_step_checks()
    if name == "ops":
        from window_attention import gpu_checks
        return gpu_checks()
    if name == "comm":
        from comm_netns import gpu_checks
        return gpu_checks()
    if name == "doctor":
        from aiak.cli.doctor import gpu_checks
        return gpu_checks()
    if name == "bench":
        return bench_checks()
    if name == "fp8":
        from fp8 import gpu_checks
        return gpu_checks()
    if name == "compile":
        from compiled_precision import gpu_checks
        return gpu_checks()
    if name == "fsdp":
        from fsdp_memory import gpu_checks
        return gpu_checks()
    if name == "lce":
        from linear_cross_entropy import gpu_checks
        return gpu_checks()
    raise ValueError(f"--only: unknown section {name!r}; valid: core, auto, amp, loaders, optim, ops, comm, doctor, "
                     "bench, fp8, compile, fsdp, lce")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="core,auto,amp,loaders,optim,ops,comm,doctor,bench,fp8,compile,fsdp,lce")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip remaining sections past this many seconds")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing checked")
        return 0
    os.environ.pop("TRITON_INTERPRET", None)
    print(f"gpu_check on {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    start, rows = time.perf_counter(), []
    for name in [s.strip() for s in args.only.split(",") if s.strip()]:
        if time.perf_counter() - start > args.budget_s:
            rows.append(_row(f"{name}: section", False, "skipped", "time budget spent"))
            continue
        t = time.perf_counter()
        try:
            found = section(name)
        except Exception as e:  # one broken section must not hide the others
            traceback.print_exc()
            found = [_row(f"{name}: section", False, "crashed", f"{type(e).__name__}: {e}")]
        rows.extend(found)
        for r in found:  # at once too: a run killed at its time limit still shows the sections it finished
            print(f"  {'ok' if r['ok'] else 'NO'}  {r['check']}: {r['value']}", flush=True)
        print(f"[{name}: {time.perf_counter() - t:.1f} s]", flush=True)
    width = max(len(r["check"]) for r in rows)
    print(f"\n{'check':<{width}}  ok    {'metric':<28} value")
    for r in rows:
        print(f"{r['check']:<{width}}  {'yes' if r['ok'] else 'NO ':<4}  {str(r['metric']):<28} {r['value']}")
    failed = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} ok in {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""One script that checks and times every CUDA path of aiak on one GPU, in under 8 minutes.

    python benchmarks/gpu_check.py [--only core,loaders,optim,ops,comm] [--budget-s 420]

Sections: core (TF32 switch, O1/O2 fp16/bf16 on CUDA vs fp32, overflow skip, step time), loaders (side-stream
copy hidden under compute, record_stream, DALI mixed), optim (LAMB/LARS on CUDA), ops (Triton window
attention: correctness and the speed goals), comm (int8 codec, NCCL hook). Every row says ok or not, with
what it measured. Exit status 1 if any check failed. Without CUDA it prints why and exits 0 having checked
nothing (so it is safe to run anywhere).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling benchmark modules


def _row(check, ok, metric, value):
    return {"check": check, "ok": bool(ok), "metric": metric, "value": value}


def core_checks() -> list:
    """TF32 switch, O1/O2 on CUDA against fp32, overflow skipping, and the O2 step speedup."""
    import aiak
    from aiak.demo import DemoNet

    rows = []
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    m = nn.Linear(8, 8).to(dev)
    aiak.optimize(m, strategy={"tf32": True})
    rows.append(_row("core: tf32 switch", torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32,
                     "allow_tf32", torch.backends.cuda.matmul.allow_tf32))

    def train(strategy, steps=30, width=64, batch=128):
        torch.manual_seed(0)
        model = DemoNet(width=width).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, opt, _ = aiak.optimize(model, opt, strategy=strategy)
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(batch, 3, 32, 32, device=dev, generator=g)
        y = torch.randint(0, 10, (batch,), device=dev, generator=g)
        times = []
        for i in range(steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return loss.item(), sorted(times[5:])[len(times[5:]) // 2], model, opt

    base_loss, base_t, _, _ = train({"tf32": False})
    for name, strategy in (("O1 fp16", {"precision": {"level": "O1", "dtype": "fp16"}}),
                           ("O2 fp16", {"precision": {"level": "O2", "dtype": "fp16"}, "channels_last": True}),
                           ("O2 bf16", {"precision": {"level": "O2", "dtype": "bf16"}, "tf32": True})):
        loss, t, model, opt = train(strategy)
        rows.append(_row(f"core: {name} final loss vs fp32", abs(loss - base_loss) <= 0.05 * base_loss + 1e-3,
                         "loss / fp32 loss", f"{loss:.4f} / {base_loss:.4f}"))
        rows.append(_row(f"core: {name} step time", True, "speedup vs fp32", f"{base_t / t:.2f}x"))
    # overflow: an inf gradient skips the step and halves the scale
    _, _, model, opt = train({"precision": {"level": "O2", "dtype": "fp16"}}, steps=1)
    ctl = opt._aiak_steps
    scale, w = ctl.scaler.scale, next(model.parameters()).detach().clone()
    x = torch.randn(4, 3, 32, 32, device=dev)
    (model(x).sum() * float("inf")).backward()
    opt.step()
    rows.append(_row("core: fp16 overflow skips the step", ctl.scaler.scale == scale / 2 and
                     torch.equal(w, next(model.parameters())), "scale after", ctl.scaler.scale))
    return rows


def section(name: str):
    if name == "core":
        return core_checks()
    if name == "loaders":
        from loader_overlap import gpu_checks
        return gpu_checks()
    if name == "optim":
        from optimizers import gpu_checks
        return gpu_checks()
    if name == "ops":
        from window_attention import gpu_checks
        return gpu_checks()
    if name == "comm":
        from comm_netns import gpu_checks
        return gpu_checks()
    raise ValueError(f"--only: unknown section {name!r}; valid: core, loaders, optim, ops, comm")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="core,loaders,optim,ops,comm")
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
            rows.extend(section(name))
        except Exception as e:  # one broken section must not hide the others
            traceback.print_exc()
            rows.append(_row(f"{name}: section", False, "crashed", f"{type(e).__name__}: {e}"))
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

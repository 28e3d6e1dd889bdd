"""fp8 (``precision.fp8``) against bf16 on transformer blocks: step time where fp8 runs natively, and the loss after N
steps everywhere.

    python benchmarks/fp8.py [--widths 64] [--tokens 256] [--steps 50] [--rounds 5] [--device cpu]

Each candidate is ``aiak.optimize`` of the same model (same seed): O2 bf16, and O2 bf16 with the ``tensorwise`` and
``rowwise`` recipes. The model is a thin input projection, one pre-norm transformer block (attention projections and
a 4x feed-forward, heads of 128 or fewer channels) and a thin output projection; the projections are the first and
last Linear layers, which fp8 leaves in high precision by default, so the block's four layers are the ones
converted. The target is a fixed random function of the input (MSE).

* loss: each candidate trains ``--steps`` AdamW steps on the same batches; the fp8 loss must be within 10% of
  bf16's (the average of the last 5 steps);
* time (CUDA only): the candidates' steps alternate in ``--rounds`` rounds after a warm-up (``time_round_robin``:
  the order shuffled each round), compiled (``compile: true``: torchao's float8 is built to be compiled), and the
  table gives each candidate's median step time with its p10-p90 spread and the ratio of bf16's median to its own.

On a CPU, torchao emulates fp8: the loss rows mean what they say, the times would not (they are not taken).
:func:`gpu_checks` holds the rows ``benchmarks/gpu_check.py --only fp8`` runs on a GPU: widths 4096 and 8192, each
row against its goal (tensorwise at least 1.2x bf16 at width 8192, rowwise at least 1.1x there, both at least
1.0x at 4096, on a GPU with fp8 tensor cores: compute capability 8.9 or newer).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path
from typing import Dict, List

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling benchmark modules

from optimizers import time_round_robin  # noqa: E402  (alternating rounds, warm-up, synchronised)

CANDIDATES = {
    "bf16": {"level": "O2", "dtype": "bf16"},
    "tensorwise": {"level": "O2", "dtype": "bf16", "fp8": "tensorwise"},
    "rowwise": {"level": "O2", "dtype": "bf16", "fp8": "rowwise"},
}
# Speed goals on a GPU with fp8 tensor cores: (width, recipe) -> minimum bf16 / fp8 step-time ratio.
SPEED_GOALS = {(8192, "tensorwise"): 1.2, (8192, "rowwise"): 1.1, (4096, "tensorwise"): 1.0, (4096, "rowwise"): 1.0}
LOSS_TOLERANCE = 0.10


class Block(nn.Module):
    """Pre-norm attention (fused qkv, output projection) and a 4x GELU feed-forward."""

    def __init__(self, width: int):
        super().__init__()
        self.heads = max(1, width // 128)
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def make_model(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(16, width), Block(width), nn.Linear(width, 16))


def batch(step: int, tokens: int, device: torch.device):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(max(1, tokens // 512), min(tokens, 512), 16, generator=g)
    w = torch.randn(16, 16, generator=torch.Generator().manual_seed(99)) / 4
    return x.to(device), torch.tanh(x @ w).cumsum(dim=1).div(x.shape[1] ** 0.5).to(device)


def build(name: str, width: int, device: torch.device, compile: bool):
    import aiak

    torch.manual_seed(0)
    model = make_model(width).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the emulation warning off fp8 tensor cores: the rows say so themselves
        model, optimizer, _ = aiak.optimize(model, optimizer,
                                            strategy={"precision": CANDIDATES[name], "compile": compile})
    return model, optimizer


def train_steps(model, optimizer, tokens: int, device: torch.device, steps: int, start: int = 0) -> List[float]:
    losses = []
    for step in range(start, start + steps):
        x, y = batch(step, tokens, device)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _row(check, ok, metric, value):
    return {"check": check, "ok": bool(ok), "metric": metric, "value": value}


def loss_rows(width: int, tokens: int, device: torch.device, steps: int, compile: bool) -> List[dict]:
    finals: Dict[str, float] = {}
    first = 0.0
    for name in CANDIDATES:
        model, optimizer = build(name, width, device, compile)
        losses = train_steps(model, optimizer, tokens, device, steps)
        finals[name], first = sum(losses[-5:]) / len(losses[-5:]), losses[0]
        del model, optimizer
    rows = []
    for name in ("tensorwise", "rowwise"):
        off = abs(finals[name] - finals["bf16"]) / finals["bf16"]
        rows.append(_row(f"fp8: width {width} {name} loss after {steps} steps", off <= LOSS_TOLERANCE,
                         f"vs bf16 (goal within {LOSS_TOLERANCE:.0%})",
                         f"{finals[name]:.4f} vs {finals['bf16']:.4f} ({off:.1%}; from {first:.4f})"))
    return rows


def speed_rows(width: int, tokens: int, device: torch.device, rounds: int, native: bool) -> List[dict]:
    setups = {name: build(name, width, device, compile=True) for name in CANDIDATES}
    steps = {}
    for name, (model, optimizer) in setups.items():
        x, y = batch(0, tokens, device)

        def step(model=model, optimizer=optimizer, x=x, y=y):
            F.mse_loss(model(x).float(), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        steps[name] = step
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = time_round_robin(steps, repeats=rounds, warmup=3, sync=sync)
    base = statistics.median(times["bf16"])
    rows = []
    for name in ("tensorwise", "rowwise"):
        ratio = base / statistics.median(times[name])
        q = statistics.quantiles(times[name], n=10, method="inclusive")
        goal = SPEED_GOALS[(width, name)] if (width, name) in SPEED_GOALS else 1.0
        rows.append(_row(f"fp8: width {width} {name} step, compiled", native and ratio >= goal,
                         f"bf16 / fp8 (goal >= {goal}x{'' if native else ', fp8 GPU'})",
                         f"{ratio:.2f}x: {statistics.median(times[name]) * 1e3:.1f} [{q[0] * 1e3:.1f}-"
                         f"{q[-1] * 1e3:.1f}] ms vs bf16 {base * 1e3:.1f} ms"))
    return rows


def gpu_checks() -> list:
    """The fp8 rows of ``benchmarks/gpu_check.py``: widths 4096 and 8192, 8192 tokens a step, compiled."""
    from aiak.amp.emulation import native_fp8

    device = torch.device("cuda")
    native = native_fp8(device)
    cap = torch.cuda.get_device_capability(device)
    rows = [_row("fp8: fp8 tensor cores", native, "compute capability (goal >= 8.9)", f"{cap[0]}.{cap[1]}")]
    for width in (4096, 8192):
        rows += speed_rows(width, 8192, device, rounds=7, native=native)
        torch.cuda.empty_cache()
    rows += loss_rows(4096, 4096, device, steps=30, compile=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", default="64", help="comma-separated model widths (multiples of 16)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens a step")
    ap.add_argument("--steps", type=int, default=50, help="training steps of the loss comparison")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (CUDA only)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", action="store_true", help="compile the loss runs too (always for the timings)")
    args = ap.parse_args(argv)
    from aiak.amp.emulation import native_fp8

    device = torch.device(args.device)
    native = native_fp8(device)
    print(f"fp8: torch {torch.__version__} on {device}; fp8 tensor cores: {'yes' if native else 'no (emulated)'}")
    rows = []
    for width in [int(w) for w in args.widths.split(",") if w.strip()]:
        rows += loss_rows(width, args.tokens, device, args.steps, args.compile)
        if device.type == "cuda":
            rows += speed_rows(width, args.tokens, device, args.rounds, native)
    for r in rows:
        print(f"  {'ok' if r['ok'] else 'NO'}  {r['check']}: {r['metric']}: {r['value']}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Mixed precision under ``torch.compile``: compiled aiak against compiled plain autocast, and against eager aiak.

    python benchmarks/compiled_precision.py [--models mlp,resnet,vit,gpt2,bert] [--precision "O2 bf16"]
                                            [--rounds 10] [--steps 40] [--backend inductor] [--json FILE]

One training step (forward, cross-entropy or the Hugging Face model's own loss, backward, AdamW step, zero_grad),
from the same initial weights on the same batch, four ways:

* ``plain compiled``: ``torch.compile(model)`` called under ``torch.autocast`` of the precision's dtype (the
  reference: what a script does without aiak);
* ``aiak compiled``: ``aiak.optimize(model, opt, strategy={"precision": ...})``, then ``torch.compile(model)``
  (aiak's half-precision regions are traced into the graph: :mod:`aiak.amp.compiled_region`);
* ``aiak eager``: the same aiak model, not compiled;
* ``plain eager``: the model under ``torch.autocast``, not compiled.

Before timing, ``torch._dynamo.explain`` counts the graphs (and breaks) of the compiled forwards: aiak must make no
more than plain autocast. Timing is :mod:`aiak.measure.rounds`'s: every side warms up (compilation included), then
the sides alternate in rounds; each ratio is the median of the per-round ratios with its distribution-free 99%
interval and the verdict of :mod:`aiak.measure.rounds`. ``compiled vs plain`` is plain compiled's round time over aiak
compiled's (>= 1.00x: aiak costs nothing under compile); ``compiled vs eager``: aiak eager's over aiak compiled's.

Models (random weights, nothing downloaded; CPU-sized): ``mlp`` (4 residual pre-norm MLP blocks of width 256, batch
64), ``resnet`` (torchvision ``resnet18`` at 64 px, batch 8), ``vit`` (timm ``vit_tiny_patch16_224`` at 64 px, batch
8), ``gpt2`` and ``bert`` (Hugging Face, hidden 128, 2 layers, 4 heads, vocabulary 1024, 64 tokens, batch 4); not
run by default, ``gpt2-512`` and ``bert-512`` (hidden 512, 4 layers, 8 heads, 128 tokens), where eager aiak's
Python per module call is a smaller share of the step. One
torch thread by default (``--threads``): on a shared 2-core machine two OpenMP threads wait for each other whenever
another process holds a core. :func:`gpu_checks` holds the rows of ``benchmarks/gpu_check.py --only compile``.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import aiak  # noqa: E402
from aiak.measure.rounds import Contender, Spread, alternate, plan_rounds, speedup  # noqa: E402
from aiak.runtime.switches import read_switches  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SIDES = ("plain compiled", "aiak compiled", "aiak eager", "plain eager")


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MLP(nn.Module):
    def __init__(self, width: int = 256, blocks: int = 4, classes: int = 10):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(blocks)])
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.blocks(x))


def _hf(kind: str, hidden: int = 128, layers: int = 2, tokens: int = 64) -> nn.Module:
    import transformers

    heads = max(hidden // 64, 4) if hidden > 128 else 4
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=1024, n_embd=hidden, n_layer=layers, n_head=heads,
                                         n_positions=tokens, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.BertConfig(vocab_size=1024, hidden_size=hidden, num_hidden_layers=layers,
                                     num_attention_heads=heads, intermediate_size=4 * hidden,
                                     max_position_embeddings=tokens, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config)


def _image(shape) -> Callable[[torch.Generator, int], Tuple[dict, torch.Tensor]]:
    def make(g, batch):
        return {"x": torch.randn(batch, *shape, generator=g)}, torch.randint(0, 10, (batch,), generator=g)
    return make


def _text(kind: str, tokens: int = 64):
    def make(g, batch):
        ids = torch.randint(0, 1024, (batch, tokens), generator=g)
        labels = ids if kind == "gpt2" else torch.randint(0, 2, (batch,), generator=g)
        return {"input_ids": ids, "labels": labels}, None
    return make


def _timm_vit() -> nn.Module:
    import timm

    return timm.create_model("vit_tiny_patch16_224", img_size=64, num_classes=10)


def _resnet() -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


# name -> (factory, batch maker, batch size)
MODELS: Dict[str, Tuple[Callable[[], nn.Module], Callable, int]] = {
    "mlp": (MLP, _image((256,)), 64),
    "resnet": (_resnet, _image((3, 64, 64)), 8),
    "vit": (_timm_vit, _image((3, 64, 64)), 8),
    "gpt2": (lambda: _hf("gpt2"), _text("gpt2"), 4),
    "bert": (lambda: _hf("bert"), _text("bert"), 4),
    # (not run by default) the same at hidden 512, 4 layers, 128 tokens: where a step's per-call Python is small
    "gpt2-512": (lambda: _hf("gpt2", 512, 4, 128), _text("gpt2", 128), 4),
    "bert-512": (lambda: _hf("bert", 512, 4, 128), _text("bert", 128), 4),
}
DEFAULT_MODELS = "mlp,resnet,vit,gpt2,bert"


def _loss(model, inputs: dict, target) -> torch.Tensor:
    if target is None:
        return model(**inputs).loss
    return F.cross_entropy(model(inputs["x"]).float(), target)


def _quiet():
    logging.getLogger("aiak").setLevel(logging.ERROR)
    return contextlib.redirect_stderr(io.StringIO())


def build(name: str, side: str, precision: str, backend: str, device: torch.device = torch.device("cpu")):
    """``(module to call, optimizer, autocast context or None)`` for one side, from seed 0."""
    factory = MODELS[name][0]
    torch.manual_seed(0)
    model = factory().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    level, dtype = precision.split()
    autocast = None
    if side.startswith("aiak"):
        with _quiet():
            model, opt, _ = aiak.optimize(model, opt, strategy={"precision": {"level": level, "dtype": dtype},
                                                                "tune": False})
    else:
        autocast = lambda: torch.autocast(device.type, dtype=DTYPES[dtype])  # noqa: E731
    if side.endswith("compiled"):
        model = torch.compile(model, backend=backend)
    return model, opt, autocast


def stepper(model, opt, autocast, inputs, target) -> Callable[[], torch.Tensor]:
    def step():
        with autocast() if autocast is not None else contextlib.nullcontext():
            loss = _loss(model, inputs, target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def graphs(name: str, precision: str, inputs: dict, target,
           device: torch.device = torch.device("cpu")) -> Dict[str, Tuple[int, int]]:
    """(graphs, breaks) of the forward and loss, plain autocast against aiak, by ``torch._dynamo.explain``."""
    import torch._dynamo

    out = {}
    for side in ("plain", "aiak"):
        model, _, autocast = build(name, side + " eager", precision, "eager", device)
        torch._dynamo.reset()
        with autocast() if autocast is not None else contextlib.nullcontext():
            explained = torch._dynamo.explain(lambda: _loss(model, inputs, target))()
        out[side] = (explained.graph_count, explained.graph_break_count)
    torch._dynamo.reset()
    return out


def _on(device: torch.device, inputs: dict, target):
    return {k: v.to(device) for k, v in inputs.items()}, target.to(device) if target is not None else None


def run_model(name: str, args, device: torch.device = torch.device("cpu")) -> dict:
    _, make_batch, batch = MODELS[name]
    inputs, target = _on(device, *make_batch(torch.Generator().manual_seed(0), batch))
    counted = graphs(name, args.precision, inputs, target, device)
    print(f"\n== {name}, {args.precision}, batch {batch}: graphs (breaks) plain {counted['plain'][0]} "
          f"({counted['plain'][1]}), aiak {counted['aiak'][0]} ({counted['aiak'][1]})", flush=True)
    contenders = []
    for side in SIDES:
        model, opt, autocast = build(name, side, args.precision, args.backend, device)
        contenders.append(Contender(side, stepper(model, opt, autocast, inputs, target), device=device,
                                    switches=read_switches()))
    warmup, per_round = plan_rounds(args.steps, args.rounds, args.warmup)
    t0 = time.perf_counter()
    alternate(contenders, warmup=warmup, rounds=args.rounds, steps_per_round=per_round, slow_factor=1e9)
    by = {c.name: c for c in contenders}
    vs_plain = speedup(by["plain compiled"].round_seconds, by["aiak compiled"].round_seconds)
    vs_eager = speedup(by["aiak eager"].round_seconds, by["aiak compiled"].round_seconds)
    eager_vs_plain = speedup(by["plain eager"].round_seconds, by["aiak eager"].round_seconds)
    for c in contenders:
        s = Spread.of(c.step_seconds).scaled(1e3)
        print(f"   {c.name:15s} {s.median:8.2f} ms ({s.p10:.2f}-{s.p90:.2f}), loss {c.loss:.4f}")
    print(f"   aiak compiled vs plain compiled: {vs_plain.describe()}")
    print(f"   aiak compiled vs aiak eager:     {vs_eager.describe()}")
    print(f"   aiak eager vs plain eager:       {eager_vs_plain.describe()}")
    print(f"   {args.rounds} rounds x {per_round} steps per side after {warmup} warm-up steps, "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return {"model": name, "precision": args.precision, "batch": batch, "graphs": counted,
            "ms": {c.name: Spread.of(c.step_seconds).scaled(1e3).__dict__ for c in contenders},
            "compiled_vs_plain": vs_plain.to_dict(), "compiled_vs_eager": vs_eager.to_dict(),
            "eager_vs_plain": eager_vs_plain.to_dict()}


def gpu_checks() -> list:
    """The rows of ``benchmarks/gpu_check.py --only compile``: on the GPU, for the MLP, the ViT and GPT-2 under O2 and
    O1 bf16, compiled aiak makes no more graphs than compiled plain autocast and is not slower than it (the median of
    8 alternating rounds' ratios, goal >= 1.0 within the interval); the ratio to eager aiak is printed beside it."""
    device = torch.device("cuda")
    rows = []
    for precision in ("O2 bf16", "O1 bf16"):
        args = argparse.Namespace(precision=precision, rounds=8, steps=48, warmup=4, backend="inductor")
        for name in ("mlp", "vit", "gpt2"):
            r = run_model(name, args, device)
            g, ratio = r["graphs"], r["compiled_vs_plain"]
            rows.append({"check": f"compile: {name} {precision} graphs", "ok": g["aiak"][0] <= g["plain"][0],
                         "metric": "aiak <= plain autocast", "value": f"{g['aiak'][0]} vs {g['plain'][0]}"})
            rows.append({"check": f"compile: {name} {precision} step", "ok": ratio["high"] >= 1.0,
                         "metric": "plain / aiak, compiled (goal >= 1.0)",
                         "value": f"{ratio['median']:.2f}x ({ratio['low']:.2f}-{ratio['high']:.2f}); compiled / eager "
                                  f"aiak {r['compiled_vs_eager']['median']:.2f}x"})
            torch.cuda.empty_cache()
    return rows


def main(argv: Optional[List[str]] = None) -> List[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=DEFAULT_MODELS, help=f"comma-separated, from {', '.join(MODELS)} (default "
                    f"{DEFAULT_MODELS})")
    ap.add_argument("--precision", default="O2 bf16", help="'O1 bf16', 'O2 bf16', 'O1 fp16' or 'O2 fp16'")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=40, help="steps per side, warm-up included (default 40)")
    ap.add_argument("--warmup", type=int, default=4, help="warm-up steps per side, at least (compiles: default 4)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {unknown}; valid: {', '.join(MODELS)}")
    level, _, dtype = args.precision.partition(" ")
    if level not in ("O1", "O2") or dtype not in DTYPES:
        ap.error(f"--precision: {args.precision!r}; valid: 'O1 bf16', 'O2 bf16', 'O1 fp16', 'O2 fp16'")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", module="aiak")
    print(f"compiled_precision: torch {torch.__version__}, {torch.get_num_threads()} thread(s), backend "
          f"{args.backend}, {args.precision}")
    results = [run_model(name, args, torch.device(args.device)) for name in names]
    print("\n| model | graphs plain / aiak | aiak compiled vs plain compiled | aiak compiled vs aiak eager | "
          "aiak eager vs plain eager |\n|---|---|---|---|---|")
    for r in results:
        g = r["graphs"]
        cell = lambda d: f"{d['median']:.2f}x ({d['low']:.2f}-{d['high']:.2f})"  # noqa: E731
        print(f"| {r['model']} | {g['plain'][0]} / {g['aiak'][0]} | {cell(r['compiled_vs_plain'])} | "
              f"{cell(r['compiled_vs_eager'])} | {cell(r['eager_vs_plain'])} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()

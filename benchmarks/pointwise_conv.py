"""1x1 convolutions as matrix multiplies (``fused_ops: [pointwise_conv]``) against oneDNN's convolution, in one run.

Two tables, each alternating the contenders in rounds (order shuffled every round) after a warm-up, with the
median and its p10-p90 spread, and the ratio to the baseline paired within each round (median over rounds, p10-p90):

1. **layers**: every 1x1 convolution of the model, forward and backward (input, weight and bias gradients) on its
   own input shape, as ``nn.Conv2d`` and as `aiak.ops.pointwise_conv`; the sum over the layers;
2. **steps**: a whole SGD training step of the model (forward, cross-entropy, backward, step) in each layout and
   precision, with and without the 1x1 convolutions as matrix multiplies (fp32 and, where the CPU has bf16
   hardware, O1 bf16 autocast), each against plain fp32 contiguous.

    python benchmarks/pointwise_conv.py                                    # ResNet-50 at 32 px, batch 16
    python benchmarks/pointwise_conv.py --model mobilenetv3_small_050 --size 64 --batch 64
    python benchmarks/pointwise_conv.py --quick                            # a few rounds, steps only

Models are timm's, random weights, nothing downloaded.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path
from typing import List

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from aiak.ops.pointwise_conv import is_pointwise_conv, replace_pointwise_convs  # noqa: E402
from aiak.util.machine.cpu import has_native_bf16_cpu  # noqa: E402
from optimizers import time_round_robin  # noqa: E402


def _spread(values: List[float]) -> tuple:
    q = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else [values[0]] * 9
    return statistics.median(values), q[0], q[-1]


def ratio_text(baseline: List[float], other: List[float]) -> str:
    med, lo, hi = _spread([b / o for b, o in zip(baseline, other)])
    return f"{med:.2f}x ({lo:.2f}-{hi:.2f})"


def layer_inputs(model: nn.Module, x: torch.Tensor) -> List[tuple]:
    """(module, its input's shape) of every 1x1 convolution, in call order."""
    seen = []
    hooks = [m.register_forward_hook(lambda m, a, out: seen.append((m, tuple(a[0].shape))))
             for m in model.modules() if is_pointwise_conv(m)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return seen


def bench_layers(model: nn.Module, x: torch.Tensor, rounds: int, warmup: int) -> None:
    print("\n== layers: each 1x1 convolution forward + backward (input, weight, bias), ms")
    print(f"   {'input':>20} {'out':>5} {'s':>2}  {'conv median (p10-p90)':>24}  {'matmul median (p10-p90)':>24}  "
          f"conv/matmul (p10-p90)")
    totals = {"conv": [0.0] * rounds, "matmul": [0.0] * rounds}
    for conv, shape in layer_inputs(model, x):
        matmul = copy.deepcopy(conv)
        replace_pointwise_convs(matmul)
        inp = torch.randn(shape)

        def run(module, inp=inp):
            a = inp.detach().requires_grad_()
            module.zero_grad(set_to_none=True)
            y = module(a)
            y.backward(torch.ones_like(y))

        t = time_round_robin({"conv": lambda: run(conv), "matmul": lambda: run(matmul)}, rounds, warmup)
        for k in totals:
            totals[k] = [a + b for a, b in zip(totals[k], t[k])]
        c, m = _spread(t["conv"]), _spread(t["matmul"])
        print(f"   {str(shape):>20} {conv.out_channels:>5} {conv.stride[0]:>2}  "
              f"{c[0] * 1e3:8.2f} ({c[1] * 1e3:.2f}-{c[2] * 1e3:.2f}){'':>3}  "
              f"{m[0] * 1e3:8.2f} ({m[1] * 1e3:.2f}-{m[2] * 1e3:.2f}){'':>3}  {ratio_text(t['conv'], t['matmul'])}")
    c, m = _spread(totals["conv"]), _spread(totals["matmul"])
    print(f"   {'sum':>20} {'':>5} {'':>2}  {c[0] * 1e3:8.2f} ({c[1] * 1e3:.2f}-{c[2] * 1e3:.2f})  "
          f"{m[0] * 1e3:8.2f} ({m[1] * 1e3:.2f}-{m[2] * 1e3:.2f})  {ratio_text(totals['conv'], totals['matmul'])}")


def bench_steps(base: nn.Module, x: torch.Tensor, y: torch.Tensor, rounds: int, warmup: int) -> None:
    kinds = [(cl, mm, bf) for bf in ([False, True] if has_native_bf16_cpu() else [False])
             for cl in (False, True) for mm in (False, True)]
    steps = {}
    for cl, mm, bf in kinds:
        label = ("O1 bf16" if bf else "fp32") + (" +cl" if cl else "") + (" +1x1mm" if mm else "")
        model = copy.deepcopy(base)
        if mm:
            replace_pointwise_convs(model)
        if cl:
            model = model.to(memory_format=torch.channels_last)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        inputs = x.contiguous(memory_format=torch.channels_last) if cl else x

        def step(model=model, optimizer=optimizer, inputs=inputs, bf=bf):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf):
                loss = F.cross_entropy(model(inputs), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        steps[label] = step
    t = time_round_robin(steps, rounds, warmup)
    print("\n== steps: a whole SGD training step, ms (baseline: fp32, contiguous)")
    print(f"   {'contender':<22} {'median (p10-p90)':>24}  vs fp32 (p10-p90)")
    for label, seconds in t.items():
        med, lo, hi = _spread(seconds)
        print(f"   {label:<22} {med * 1e3:9.1f} ({lo * 1e3:.1f}-{hi * 1e3:.1f})   {ratio_text(t['fp32'], seconds)}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50", help="a timm model name (default: resnet50)")
    parser.add_argument("--size", type=int, default=32, help="image side in pixels (default: 32)")
    parser.add_argument("--batch", type=int, default=16, help="batch size (default: 16)")
    parser.add_argument("--rounds", type=int, default=12, help="alternating rounds (default: 12)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls of each contender first (default: 3)")
    parser.add_argument("--quick", action="store_true", help="4 rounds, 1 warm-up, the steps table only")
    args = parser.parse_args(argv)
    import timm

    if args.quick:
        args.rounds, args.warmup = 4, 1
    torch.manual_seed(0)
    model = timm.create_model(args.model, pretrained=False, num_classes=10)
    x, y = torch.randn(args.batch, 3, args.size, args.size), torch.randint(0, 10, (args.batch,))
    count = sum(is_pointwise_conv(m) for m in model.modules())
    print(f"1x1 convolutions as matrix multiplies: timm {args.model} at {args.size} px, batch {args.batch}, "
          f"{count} such layers; torch {torch.__version__}, {torch.get_num_threads()} threads; {args.rounds} rounds")
    if not args.quick:
        bench_layers(model, x, args.rounds, args.warmup)
    bench_steps(model, x, y, args.rounds, args.warmup)


if __name__ == "__main__":
    main()

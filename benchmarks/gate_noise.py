"""The numerics gate's figures: half-precision gradient error against the gradient's own sampling noise.

    python benchmarks/gate_noise.py [--models timm:resnet18,...] [--batches 8,16] [--seeds 0,1,2] [--size 32]

For each model (random init), batch size and seed: plain fp32's gradient ``g`` of batch 0, its sampling noise
from batch 1's gradient (:func:`aiak.tune.gate.sampling_noise`, as the trials estimate it), and, through
:func:`aiak.tune.gate.compare`, the error / noise and the scale along ``g`` of bf16 O1 and O2, and of broken
gradients built from ``g``: permuted within each tensor, doubled. ``|g| / noise`` says how much of a small batch's
gradient is signal (about 1: mostly noise). The figures in ``aiak/tune/gate.py``'s docstring come from this
script. bf16 is emulated on a CPU without AVX512-BF16 / AMX: keep the sizes small there.
"""
from __future__ import annotations

import argparse
import copy
import math
import warnings

MODELS = ("timm:resnet18", "timm:mobilenetv3_small_050", "timm:vit_tiny_patch16_224", "torchvision:resnet18")


def _model(spec: str, size: int):
    import timm
    import torchvision

    source, name = spec.split(":", 1)
    if source == "torchvision":
        return getattr(torchvision.models, name)(num_classes=10)
    extra = {"img_size": size, "patch_size": 8} if name.startswith("vit") else {}
    return timm.create_model(name, pretrained=False, num_classes=10, **extra)


def _gradients(model, x, y):
    import torch

    from aiak.tune import gate

    model.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return gate.gradients(model)


def _bf16_gradients(model, level, x, y):
    import torch

    import aiak
    from aiak.util import warn as amp_warn

    m = copy.deepcopy(model)
    with amp_warn.quiet():
        m, _, _ = aiak.optimize(m, torch.optim.SGD(m.parameters(), lr=0.1), None,
                                strategy={"extends": "default", "precision": {"level": level, "dtype": "bf16"},
                                          "tune": False})
    return _gradients(m, x, y)


def measure(spec: str, batch: int, seed: int, size: int):
    """One row: |g| / noise, then (error / noise, scale) of bf16 O1, bf16 O2, permuted, doubled."""
    import torch

    from aiak.tune import gate

    torch.manual_seed(seed)
    model = _model(spec, size)
    x, y = torch.randn(2 * batch, 3, size, size), torch.randint(0, 10, (2 * batch,))
    g = _gradients(copy.deepcopy(model), x[:batch], y[:batch])
    other = _gradients(copy.deepcopy(model), x[batch:], y[batch:])
    noise = gate.sampling_noise(g, other, batch, batch, batch)
    gen = torch.Generator().manual_seed(seed)
    permuted = {k: v.reshape(-1)[torch.randperm(v.numel(), generator=gen)].reshape(v.shape) for k, v in g.items()}
    bf16 = [_bf16_gradients(model, level, x[:batch], y[:batch]) for level in ("O1", "O2")]
    candidates = bf16 + [permuted, {k: 2 * v for k, v in g.items()}]
    signal = math.sqrt(sum(float(v.double().square().sum()) for v in g.values())) / noise
    return signal, [gate.compare(c, g, noise) for c in candidates]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated timm:NAME / torchvision:NAME")
    ap.add_argument("--batches", default="8,16", help="comma-separated batch sizes")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (weights and data)")
    ap.add_argument("--size", type=int, default=32, help="image side in pixels")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    print("error / noise (scale along fp32's gradient); the gate passes error <= 1 and scale within 1 +- 0.3")
    print(f"{'model':34} {'batch':>5} {'seed':>4} {'|g|/noise':>9}  {'bf16 O1':>13} {'bf16 O2':>13} "
          f"{'permuted':>13} {'doubled':>13}")
    for spec in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for seed in (int(s) for s in args.seeds.split(",")):
                signal, results = measure(spec, batch, seed, args.size)
                cells = " ".join(f"{r.error_to_noise:6.3f} ({r.scale:4.2f})" for r in results)
                print(f"{spec:34} {batch:5d} {seed:4d} {signal:9.2f}  {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The numerics gate: a candidate that changes the math must give the fp32 gradients, within tolerances.

On the same batch, from the same weights and RNG state, a candidate's gradients (unscaled, in fp32) are
compared with those of plain fp32 PyTorch, parameter by parameter name:

* every gradient finite (no inf, no NaN);
* cosine similarity of the flattened gradients >= ``MIN_COSINE``;
* relative norm difference ``| |g| / |g_ref| - 1 |`` <= ``MAX_NORM_DIFF``.

Tolerances: bf16 keeps 8 bits of mantissa (relative rounding 2^-9 ~ 0.2%), so a bf16 forward and backward
through tens of layers moves a gradient by a few percent at most; measured on the test models (DemoNet,
timm ResNet-18 / ViT-Tiny / Swin, at random init) bf16 O1 and O2 give cosines above 0.999 and norm
differences under 1%. A broken candidate (a layer left unscaled, an overflow, a wrong cast) is far off:
cosine well below 0.9 or norms off by orders of magnitude. The bounds sit between the two.

Numerics-neutral candidates (layout, prefetching, bucket sizes: :data:`NEUTRAL_KEYS`) skip the gate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict

import torch

MIN_COSINE = 0.99
MAX_NORM_DIFF = 0.05

# Strategy keys that cannot change what is computed beyond float rounding of a different kernel or layout:
# which memory layout convolutions use, how batches reach the device, cuDNN's algorithm choice, process
# affinity, DDP's bucket sizes. Everything else (precision, tf32, compile, fused ops, optimizer,
# accumulation, compression, balanced batches) changes numerics and goes through the gate.
NEUTRAL_KEYS = ("channels_last", "cudnn_benchmark", "cpu_affinity", "loader.prefetch", "loader.pin_memory",
                "comm.bucket_mb", "comm.hierarchical", "comm.autotune", "comm.perf_mode", "comm.tune_steps",
                "comm.tune_cache", "comm.deadlock_guard", "comm.timeout_s", "comm.pipeline_mb", "tune")


@dataclass
class GateResult:
    cosine: float
    norm_diff: float
    finite: bool

    @property
    def passed(self) -> bool:
        return self.finite and self.cosine >= MIN_COSINE and self.norm_diff <= MAX_NORM_DIFF

    def why(self) -> str:
        if not self.finite:
            return "gradients hold inf or NaN"
        verdict = "passes" if self.passed else "fails"
        return (f"numerics gate {verdict}: gradient cosine {self.cosine:.5f} (>= {MIN_COSINE}), norm differs by "
                f"{self.norm_diff:.2%} (<= {MAX_NORM_DIFF:.0%}) from fp32")


def gradients(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The gradients of ``model``'s trainable parameters by name, in fp32 (after one backward they are the true
    gradient of the batch under every strategy: loss scaling is undone inside the graph, accumulation divides
    only at the real step). Missing gradients count as zeros."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            out[name] = g.detach().float().contiguous()
    return out


def compare(candidate: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor]) -> GateResult:
    """Gate ``candidate`` gradients against the fp32 ``reference`` (same names; see the module docstring)."""
    if set(candidate) != set(reference):
        missing = sorted(set(reference) ^ set(candidate))[:3]
        raise ValueError(f"numerics gate: parameters differ between candidate and reference (e.g. {missing})")
    names = sorted(reference)
    dot = norm_a = norm_b = 0.0
    finite = True
    for n in names:  # per tensor (no concatenated copy); each partial sum in float64
        a, b = candidate[n].reshape(-1), reference[n].reshape(-1)
        if not bool(torch.isfinite(a).all()):
            finite = False
            break
        dot += float(torch.dot(a, b).double())
        norm_a += float(torch.dot(a, a).double())
        norm_b += float(torch.dot(b, b).double())
    if not finite:
        return GateResult(float("nan"), float("inf"), False)
    na, nb = math.sqrt(norm_a), math.sqrt(norm_b)
    if nb == 0.0:
        same = na == 0.0
        return GateResult(1.0 if same else 0.0, 0.0 if same else math.inf, True)
    cosine = dot / (na * nb) if na > 0 else 0.0
    return GateResult(cosine, abs(na / nb - 1.0), True)


def is_neutral(changed_keys, neutral=NEUTRAL_KEYS) -> bool:
    """True when every changed key path is numerics-neutral."""
    return all(any(k == n or k.startswith(n + ".") for n in neutral) for k in changed_keys)

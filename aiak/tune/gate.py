"""The numerics gate: a candidate that changes the math must give plain fp32's gradients, up to their sampling noise.

On the same batch, from the same weights and RNG state, a candidate's gradients ``c`` (unscaled, in fp32) are
compared with plain fp32 PyTorch's ``g``, parameter by parameter name. The candidate passes when:

* every gradient is finite (an fp16 loss scale that overflows gives inf);
* no parameter lost its gradient (all zeros where fp32's is not: a dropped or detached gradient);
* its error is within the gradient's own sampling noise: ``|c - g| <= MAX_ERROR_TO_NOISE * noise``, where
  ``noise`` is the norm of the sampling noise of ``g`` as an estimate of the expected gradient
  (`sampling_noise`). An error below it moves a step less than drawing another batch of the same size
  would, which SGD tolerates by design. A fixed bound on the cosine cannot say this: how far half-precision
  rounding moves a gradient depends on the model and on how much of the gradient is signal, and at random init
  the gradient of a small batch is mostly noise (``|g| ~ noise``): bf16 gave cosines down to 0.90 on
  torchvision's ResNet-18 and 0.94 on timm's MobileNetV3, which it trains like fp32;
* its scale along fp32's gradient is right: ``<c, g> / |g|^2`` within ``1 +- MAX_SCALE_ERROR``. Rounding errors
  are nearly uncorrelated with the gradient and leave the scale near 1; a scale error (a loss scale left in, a
  doubled gradient) is systematic, the same on every step, and the noise bound alone would let it through when
  ``|g| ~ noise``.

Measured (``benchmarks/gate_noise.py``: random init, CPU, 32 px images, batches of 8 and 16, seeds 0-3, noise
from two batches): bf16 O1 and O2 error / noise 0.01-0.02 on timm ViT-Tiny, 0.11-0.16 on timm ResNet-18,
0.14-0.36 on timm MobileNetV3 (``mobilenetv3_small_050``), 0.36-0.46 on torchvision ResNet-18; scale 0.88-1.01.
Broken: gradients permuted within each tensor 1.1-1.5 (scale -0.03-0.06), doubled 0.8-1.1 (scale 2), a layer's
gradient dropped (lost), an overflowing loss scale (not finite). No error bound alone tells broken from bf16
with a wide margin: with ``|g| / noise`` at 0.8-1.1, even a wholly wrong gradient is only 1-1.5 noise away,
so the scale and lost-gradient checks carry the clear cases and the error bound the rest.

Numerics-neutral candidates (layout, prefetching, bucket sizes: `NEUTRAL_KEYS`; ``fused_ops`` listing only
`aiak.ops.surgery.NEUTRAL_FUSED_OPS`) skip the gate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from aiak.ops.surgery import NEUTRAL_FUSED_OPS
from aiak.strategy import knobs

MAX_ERROR_TO_NOISE = 1.0
MAX_SCALE_ERROR = 0.3

# Strategy keys that cannot change what is computed beyond float rounding of a different kernel or layout
# (which memory layout convolutions use, how batches reach the device, cuDNN's algorithm choice, DDP's bucket
# sizes): the knob table's numerics-neutral rows. Everything else goes through the gate.
NEUTRAL_KEYS = knobs.neutral_keys()


@dataclass
class GateResult:
    finite: bool
    lost: str                          # a parameter whose gradient the candidate lost; "" when none
    error_to_noise: Optional[float]    # |c - g| / noise; None without a noise estimate (not judged)
    scale: float                       # <c, g> / |g|^2
    cosine: float                      # shown in the decision record; not judged
    norm_diff: float                   # | |c| / |g| - 1 |; shown, not judged

    @property
    def passed(self) -> bool:
        return (self.finite and not self.lost and abs(self.scale - 1.0) <= MAX_SCALE_ERROR
                and (self.error_to_noise is None or self.error_to_noise <= MAX_ERROR_TO_NOISE))

    def why(self) -> str:
        if not self.finite:
            return "gradients hold inf or NaN"
        if self.lost:
            return f"numerics gate fails: the gradient of {self.lost} is lost (zeros where fp32's is not)"
        verdict = "passes" if self.passed else "fails"
        error = ("not judged (no estimate of the gradient's sampling noise)" if self.error_to_noise is None else
                 f"{self.error_to_noise:.2f}x the gradient's sampling noise (<= {MAX_ERROR_TO_NOISE:g})")
        return (f"numerics gate {verdict}: error {error}, scale {self.scale:.3f} along fp32's gradient "
                f"(1 +- {MAX_SCALE_ERROR:g}), cosine {self.cosine:.4f}")

    def numbers(self) -> List[float]:
        """This result as numbers whose elementwise maximum over several results is their worst (what a MAX
        all-reduce over ranks gives): not finite, lost, error, the scale above and below 1, the lowest cosine,
        the largest norm difference. `from_numbers` reads them back."""
        return [0.0 if self.finite else 1.0, 1.0 if self.lost else 0.0,
                -1.0 if self.error_to_noise is None else self.error_to_noise,
                self.scale, -self.scale, -self.cosine, self.norm_diff]

    @classmethod
    def from_numbers(cls, numbers: Sequence[float], lost: str = "") -> "GateResult":
        """The result `numbers` gave (the worst of several); ``lost``: the name of a lost gradient, if
        known here."""
        nonfinite, lost_flag, error, high, neg_low, neg_cosine, norm_diff = numbers
        scale = high if high - 1.0 >= 1.0 + neg_low else -neg_low  # whichever is farther from 1
        return cls(not nonfinite, (lost or "a parameter (on another rank)") if lost_flag else "",
                   None if error < 0 else error, scale, -neg_cosine, norm_diff)


def gradients(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The gradients of ``model``'s trainable parameters by name, in fp32 (after one backward they are the true
    gradient of the batch under every strategy: loss scaling is undone as each gradient lands, accumulation divides
    only at the real step). Missing gradients count as zeros."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            out[name] = g.detach().float().contiguous()
    return out


def sampling_noise(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], size_a: int, size_b: int,
                   size: int) -> float:
    """The norm of the sampling noise of a ``size``-sample batch's gradient, from the gradients ``a`` and ``b`` of
    two disjoint sets of ``size_a`` and ``size_b`` samples, taken from the same weights.

    A batch gradient is the mean of per-sample gradients of covariance ``S``: its noise has squared norm
    ``tr(S) / size``, and ``a - b`` has ``tr(S) (1/size_a + 1/size_b)``, so
    ``noise = |a - b| * sqrt((1/size) / (1/size_a + 1/size_b))``: ``|a - b| / sqrt(2)`` for two batches of the
    same size, ``|a - b| / 2`` for the two halves of one."""
    squared = sum(_squared_norm(a[n] - b[n]) for n in a)
    return math.sqrt(squared * (1.0 / size) / (1.0 / size_a + 1.0 / size_b))


def _squared_norm(t: torch.Tensor) -> float:
    """``|t|^2`` as a Python float: one fp32 pass (torch's reduction sums in blocks, a relative error near 1e-7,
    far below anything the gate judges), or in float64 where fp32 would overflow or underflow to 0."""
    t = t.reshape(-1)
    norm = float(torch.linalg.vector_norm(t))
    if norm == 0.0 and bool(t.any()) or math.isinf(norm) and bool(torch.isfinite(t).all()):
        return float(torch.linalg.vector_norm(t.double())) ** 2
    return norm * norm


def squared_norms(gradients: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """``|t|^2`` of each gradient (`_squared_norm`): the reference's, taken once for every candidate `compare` gates."""
    return {name: _squared_norm(t) for name, t in gradients.items()}


def compare(candidate: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor],
            noise: Optional[float] = None, reference_norms: Optional[Dict[str, float]] = None) -> GateResult:
    """Gate ``candidate`` gradients against the fp32 ``reference`` (same names), whose sampling noise is ``noise``
    (`sampling_noise`; None: the error is not judged) and whose `squared_norms` are ``reference_norms`` (None: taken
    here). See the module docstring."""
    if set(candidate) != set(reference):
        missing = sorted(set(reference) ^ set(candidate))[:3]
        raise ValueError(f"numerics gate: parameters differ between candidate and reference (e.g. {missing})")
    norms = reference_norms if reference_norms is not None else squared_norms(reference)
    norm_c = norm_g = error = 0.0
    lost = ""
    for n in sorted(reference):  # per tensor (no concatenated copy), fp32 passes; the sums in float64
        c, g = candidate[n], reference[n]
        squared_c = _squared_norm(c)
        if not math.isfinite(squared_c):   # an inf or NaN gradient gives an inf or NaN norm
            return GateResult(False, "", math.inf, math.inf, -1.0, math.inf)
        squared_g = norms[n]
        if not lost and squared_c == 0.0 and squared_g > 0.0:
            lost = n
        norm_c += squared_c
        norm_g += squared_g
        # a gradient that is exactly zero (`_squared_norm` is 0 only then) is no error's part: |0 - g| = |g|
        error += squared_g if squared_c == 0.0 else squared_c if squared_g == 0.0 else _squared_norm(c - g)
    dot = (norm_c + norm_g - error) / 2   # <c, g>, from |c - g|^2 = |c|^2 + |g|^2 - 2 <c, g>
    nc, ng, error = math.sqrt(norm_c), math.sqrt(norm_g), math.sqrt(error)
    ratio = None if noise is None else error / noise if noise > 0 else 0.0 if error == 0 else math.inf
    if ng == 0.0:  # nothing to compare the direction or scale with: only an error can fail
        return GateResult(True, lost, ratio, 1.0 if nc == 0.0 else math.inf, 1.0 if nc == 0.0 else 0.0,
                          0.0 if nc == 0.0 else math.inf)
    return GateResult(True, lost, ratio, dot / norm_g, dot / (nc * ng) if nc > 0 else 0.0, abs(nc / ng - 1.0))


def neutral_ops(fused_ops: Sequence[str]) -> List[str]:
    """The numerics-neutral ops of a ``fused_ops`` list (`NEUTRAL_FUSED_OPS`), in its order."""
    return [op for op in fused_ops if op in NEUTRAL_FUSED_OPS]


def is_neutral(changes, neutral=NEUTRAL_KEYS) -> bool:
    """True when every change is numerics-neutral. ``changes``: key paths with their values (a mapping), or key paths
    alone (then a ``fused_ops`` change, whose ops are unknown, is not neutral)."""
    values: Mapping[str, Any] = changes if isinstance(changes, Mapping) else dict.fromkeys(changes)
    return all(any(k == n or k.startswith(n + ".") for n in neutral)
               or k == "fused_ops" and isinstance(v, (list, tuple)) and neutral_ops(v) == list(v)
               for k, v in values.items())

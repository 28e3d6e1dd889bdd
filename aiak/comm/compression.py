"""Gradient codecs for communication: fp16 / bf16 casts and 8-bit min-max quantization.

The 8-bit codec follows Bagua's ByteGrad (Gan et al., "Bagua: Scaling up Distributed Learning with
System Relaxations", VLDB 2022): each block of ``block`` values is sent as uint8 codes plus its own
``min`` and ``scale`` (two float32), so traffic is ~4x lower than float32. Packing codes and headers into
one uint8 tensor keeps it to a single collective per stage.

Quantization error is not lost: :class:`ErrorFeedback` keeps a per-bucket residual that is added back
before the next compression (Seide et al. 2014, "1-bit SGD"; Karimireddy et al. 2019, "Error Feedback
Fixes SignSGD"), so SGD with compressed gradients converges like float32.
"""
from __future__ import annotations

from typing import Dict, Hashable, Optional, Tuple

import torch

COMPRESSIONS = ("none", "fp16", "bf16", "int8")
CAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
INT8_HEADER_BYTES = 8  # float32 min + float32 scale per block


def check_compression(name: str, argument: str = "compression") -> str:
    if name not in COMPRESSIONS:
        raise ValueError(f"{argument} must be one of {list(COMPRESSIONS)}, got {name!r}")
    return name


def int8_packed_bytes(numel: int, block: int) -> int:
    """Bytes of :func:`quantize_int8` output for ``numel`` values (``numel`` a multiple of ``block``)."""
    return numel + (numel // block) * INT8_HEADER_BYTES


def quantize_int8(x: torch.Tensor, block: int) -> torch.Tensor:
    """Pack a 1-D float tensor (length a multiple of ``block``) into uint8 codes + per-block min/scale.

    Layout: ``[codes (numel bytes)][min, scale as float32 (8 bytes per block)]``. Codes are
    ``round((x - min) / scale)``, computed as one ``addcmul`` (``x / scale + (0.5 - min / scale)``) and a
    truncating cast: a few passes over memory, which matters on the CPU that runs it.
    """
    assert x.dim() == 1 and x.numel() % block == 0, (x.shape, block)
    numel = x.numel()
    rows = x.float().view(-1, block)
    lo = rows.amin(dim=1, keepdim=True)
    scale = (rows.amax(dim=1, keepdim=True) - lo) / 255.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    inv = 1.0 / scale
    scaled = torch.addcmul(0.5 - lo * inv, rows, inv).clamp_(0, 255)
    out = torch.empty(numel + (numel // block) * INT8_HEADER_BYTES, dtype=torch.uint8, device=x.device)
    out[:numel].view(-1, block).copy_(scaled)  # float -> uint8 truncates: floor(v + 0.5) = round(v)
    out[numel:].view(torch.float32).view(-1, 2).copy_(torch.cat([lo, scale], dim=1))
    return out


def _header(packed: torch.Tensor, numel: int) -> torch.Tensor:
    raw = packed[numel:]
    if numel % 4:  # a float32 view needs a 4-byte aligned offset
        raw = raw.clone()
    return raw.view(torch.float32).view(-1, 2)


def dequantize_int8(packed: torch.Tensor, numel: int, block: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse of :func:`quantize_int8` (float32 result, written into ``out`` when given)."""
    header = _header(packed, numel)
    codes = packed[:numel].view(-1, block)
    if out is None:
        return codes.float().mul_(header[:, 1:2]).add_(header[:, 0:1]).view(-1)
    rows = out.view(-1, block)
    torch.mul(codes, header[:, 1:2], out=rows)
    rows.add_(header[:, 0:1])
    return out


def dequantize_int8_chunks(packed: torch.Tensor, chunk: int, block: int,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode a concatenation of :func:`quantize_int8` outputs of ``chunk`` values each."""
    nbytes = int8_packed_bytes(chunk, block)
    parts = packed.numel() // nbytes
    if out is None:
        out = torch.empty(parts * chunk, dtype=torch.float32, device=packed.device)
    for i in range(parts):
        dequantize_int8(packed[i * nbytes:(i + 1) * nbytes], chunk, block, out=out[i * chunk:(i + 1) * chunk])
    return out


def quantize_int8_chunks(x: torch.Tensor, parts: int, block: int) -> torch.Tensor:
    """:func:`quantize_int8` of each of ``parts`` equal chunks of ``x``, concatenated (chunk i at i*bytes)."""
    return torch.cat([quantize_int8(c, block) for c in x.chunk(parts)])


class ErrorFeedback:
    """Per-bucket residuals: ``compress(x + r)``, then ``r <- (x + r) - decompress(compressed)``.

    Keys are ``(bucket index, stage)``; a residual whose shape no longer matches (DDP rebuilds its
    buckets after the first iteration) is dropped rather than misapplied.
    """

    __slots__ = ("enabled", "_residuals")

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._residuals: Dict[Hashable, torch.Tensor] = {}

    def add(self, key: Hashable, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus the stored residual for ``key``; ``x`` is left alone.

        The result is the buffer :meth:`update` turns into the next residual (the old residual's memory is
        reused), so call :meth:`update` with it once it has been compressed.
        """
        if not self.enabled:
            return x.float()
        r = self._residuals.pop(key, None)
        if r is None or r.shape != x.shape:
            return x.float().clone()
        return r.add_(x)

    def update(self, key: Hashable, sent: torch.Tensor, decoded: torch.Tensor) -> None:
        """Store ``sent - decoded``; ``sent`` (the tensor :meth:`add` returned) is reused as the buffer."""
        if self.enabled:
            self._residuals[key] = sent.sub_(decoded)

    def reset(self) -> None:
        self._residuals.clear()

    def __len__(self) -> int:
        return len(self._residuals)


def pad_to_multiple(x: torch.Tensor, multiple: int) -> Tuple[torch.Tensor, int]:
    """1-D ``x`` zero-padded to a length divisible by ``multiple`` (no copy when already divisible)."""
    n = x.numel()
    padded = -(-n // multiple) * multiple
    if padded == n:
        return x, n
    out = x.new_zeros(padded)
    out[:n].copy_(x)
    return out, n

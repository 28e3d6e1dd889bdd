"""Fused forwards for the Swin window-attention modules people actually use.

Each class here is a mixin placed *in front of* the original class by `aiak.ops.surgery`
(``type("FusedX", (Mixin, X), {})``): the module keeps its parameters, buffers, attributes, helper
methods and ``isinstance`` identity, so ``state_dict`` keys and an optimizer built beforehand are
unchanged; only ``forward`` computes the attention with `aiak.ops.window_attention`. Whatever the
fused path cannot reproduce exactly (attention dropout while training, returning attention weights,
head masks) calls the original ``forward`` through ``super()``.

The forwards follow, line by line in meaning, the modules they replace:
Liu et al. 2021, Swin-Transformer ``models/swin_transformer.py`` ``WindowAttention`` (and timm's copy),
torchvision ``models/swin_transformer.py`` ``shifted_window_attention``, Hugging Face transformers
``SwinSelfAttention`` (4.x) and ``SwinAttention`` + ``SwinRelativePositionBias`` (5.x).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aiak.ops.window_attention import window_attention

__all__ = ["FusedQKVWindowAttention", "FusedTorchvisionShiftedWindowAttention",
           "FusedHFSwinSelfAttention", "FusedHFSwinAttention", "relative_position_bias"]


def relative_position_bias(table: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """Gather the ``[(2Wh-1)(2Ww-1), H]`` table into the ``[H, N, N]`` bias (differentiable w.r.t. table)."""
    return table[index.reshape(-1)].view(n, n, -1).permute(2, 0, 1)


def _dropout_p(module) -> float:
    return module.p if isinstance(module, nn.Dropout) else 0.0


class FusedQKVWindowAttention:
    """Original Swin ``WindowAttention`` and timm's: ``qkv``, ``relative_position_bias_table``,
    ``relative_position_index``, ``proj``; ``forward(x [B*nW, N, C], mask [nW, N, N] | None)``."""

    def forward(self, x, mask=None, *args, **kwargs):
        if args or kwargs or (self.training and _dropout_p(getattr(self, "attn_drop", None)) > 0):
            return super().forward(x, mask, *args, **kwargs)
        windows, n, _ = x.shape
        qkv = self.qkv(x).reshape(windows, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        scale = getattr(self, "scale", q.shape[-1] ** -0.5)
        bias = relative_position_bias(self.relative_position_bias_table, self.relative_position_index, n)
        out = window_attention(q, k, v, bias, None if mask is None else mask.to(q.dtype), scale)
        out = self.proj(out.transpose(1, 2).reshape(windows, n, -1))
        proj_drop = getattr(self, "proj_drop", None)
        return proj_drop(out) if proj_drop is not None else out


class FusedTorchvisionShiftedWindowAttention:
    """torchvision ``ShiftedWindowAttention``: pads, shifts and partitions ``x [B, H, W, C]`` itself."""

    def forward(self, x):
        # Some torchvision releases apply both dropouts even in eval mode (F.dropout without training=):
        # any dropout at all runs the original forward, whatever the mode.
        if self.attention_dropout > 0 or self.dropout > 0:
            return super().forward(x)
        batch, height, width, channels = x.shape
        wh, ww = self.window_size
        x_pad = F.pad(x, (0, 0, 0, (ww - width % ww) % ww, 0, (wh - height % wh) % wh))
        _, pad_h, pad_w, _ = x_pad.shape
        shift = [0 if wh >= pad_h else self.shift_size[0], 0 if ww >= pad_w else self.shift_size[1]]
        if sum(shift) > 0:
            x_pad = torch.roll(x_pad, shifts=(-shift[0], -shift[1]), dims=(1, 2))
        rows, cols = pad_h // wh, pad_w // ww
        windows = x_pad.view(batch, rows, wh, cols, ww, channels).permute(0, 1, 3, 2, 4, 5)
        windows = windows.reshape(batch * rows * cols, wh * ww, channels)

        n = wh * ww
        qkv = self.qkv(windows).reshape(windows.shape[0], n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        bias = self.get_relative_position_bias().reshape(self.num_heads, n, n)
        mask = _shift_mask(pad_h, pad_w, (wh, ww), shift, x.device, q.dtype) if sum(shift) > 0 else None
        out = window_attention(q, k, v, bias, mask, (channels // self.num_heads) ** -0.5)
        out = self.proj(out.transpose(1, 2).reshape(windows.shape[0], n, channels))

        out = out.view(batch, rows, cols, wh, ww, channels).permute(0, 1, 3, 2, 4, 5)
        out = out.reshape(batch, pad_h, pad_w, channels)
        if sum(shift) > 0:
            out = torch.roll(out, shifts=(shift[0], shift[1]), dims=(1, 2))
        return out[:, :height, :width, :].contiguous()


def _shift_mask(pad_h, pad_w, window, shift, device, dtype):
    """The SW-MSA mask of Swin (Fig. 4): tokens from different shifted regions never attend to each other."""
    (wh, ww), (sh, sw) = window, shift
    rows, cols = torch.arange(pad_h, device=device), torch.arange(pad_w, device=device)
    region_h = (rows >= pad_h - wh).long() + (rows >= pad_h - sh).long()  # 0, 1, 2 along each axis
    region_w = (cols >= pad_w - ww).long() + (cols >= pad_w - sw).long()
    regions = region_h[:, None] * 3 + region_w[None, :]
    regions = regions.view(pad_h // wh, wh, pad_w // ww, ww).permute(0, 2, 1, 3).reshape(-1, wh * ww)
    different = regions.unsqueeze(1) != regions.unsqueeze(2)
    return torch.zeros(different.shape, device=device, dtype=dtype).masked_fill_(different, -100.0)


class FusedHFSwinSelfAttention:
    """Hugging Face transformers 4.x ``SwinSelfAttention`` (``query``/``key``/``value`` + bias table)."""

    def forward(self, hidden_states, attention_mask=None, head_mask=None, output_attentions=False, *args, **kwargs):
        if (head_mask is not None or output_attentions or args or kwargs
                or (self.training and _dropout_p(getattr(self, "dropout", None)) > 0)):
            return super().forward(hidden_states, attention_mask, head_mask, output_attentions, *args, **kwargs)
        windows, n, _ = hidden_states.shape

        def split_heads(x):
            return x.view(windows, n, self.num_attention_heads, self.attention_head_size).transpose(1, 2)

        q, k, v = (split_heads(proj(hidden_states)) for proj in (self.query, self.key, self.value))
        bias = relative_position_bias(self.relative_position_bias_table, self.relative_position_index, n)
        mask = None if attention_mask is None else attention_mask.to(q.dtype)
        out = window_attention(q, k, v, bias, mask, self.attention_head_size ** -0.5)
        return (out.transpose(1, 2).reshape(windows, n, self.all_head_size),)


class FusedHFSwinAttention:
    """Hugging Face transformers 5.x ``SwinAttention`` (``q_proj``..``o_proj`` + ``SwinRelativePositionBias``)."""

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        if kwargs.get("output_attentions") or (self.training and self.attention_dropout > 0):
            return super().forward(hidden_states, attention_mask, **kwargs)
        windows, n, _ = hidden_states.shape

        def split_heads(x):
            return x.view(windows, n, -1, self.head_dim).transpose(1, 2)

        q, k, v = (split_heads(proj(hidden_states)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        rpb = self.relative_position_bias
        bias = relative_position_bias(rpb.relative_position_bias_table, rpb.relative_position_index, n)
        mask = None if attention_mask is None else attention_mask.to(q.dtype)
        out = window_attention(q, k, v, bias, mask, self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(windows, n, -1)), None

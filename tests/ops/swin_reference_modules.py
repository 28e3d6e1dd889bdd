"""Small Swin modules written after public reference code that pip cannot install beside the test extra.

timm, torchvision and transformers 5.x are tested through their real classes (test_surgery.py); these
stand in only for the rest:

* ``OriginalWindowAttention`` / ``OriginalSwinBlock`` follow microsoft/Swin-Transformer
  ``models/swin_transformer.py`` (``WindowAttention``, ``SwinTransformerBlock``, ``window_partition``):
  the original repository is not a pip package.
* ``CosineWindowAttention`` has the ``logit_scale`` of that repository's SwinV2 ``WindowAttention``
  (cosine attention), which surgery must leave alone.
* ``HF4SwinSelfAttention`` follows Hugging Face transformers 4.x ``SwinSelfAttention`` (the test extra
  installs transformers 5.x, whose ``SwinAttention`` has another layout).
"""
import torch
from torch import nn


def relative_position_index(wh, ww):
    coords = torch.stack(torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
    rel[:, :, 0] += wh - 1
    rel[:, :, 1] += ww - 1
    rel[:, :, 0] *= 2 * ww - 1
    return rel.sum(-1)


class OriginalWindowAttention(nn.Module):
    def __init__(self, dim, window_size, num_heads, qkv_bias=True, qk_scale=None, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.dim, self.window_size, self.num_heads = dim, window_size, num_heads
        self.scale = qk_scale or (dim // num_heads) ** -0.5
        self.relative_position_bias_table = nn.Parameter(
            0.02 * torch.randn((2 * window_size[0] - 1) * (2 * window_size[1] - 1), num_heads))
        self.register_buffer("relative_position_index", relative_position_index(*window_size))
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x, mask=None):
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(N, N, -1)
        attn = attn + bias.permute(2, 0, 1).contiguous().unsqueeze(0)
        if mask is not None:
            nW = mask.shape[0]
            attn = attn.view(B_ // nW, nW, self.num_heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, N, N)
        attn = self.attn_drop(self.softmax(attn))
        x = (attn @ v).transpose(1, 2).reshape(B_, N, C)
        return self.proj_drop(self.proj(x))


def window_partition(x, ws):
    B, H, W, C = x.shape
    x = x.view(B, H // ws, ws, W // ws, ws, C)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, ws, ws, C)


def window_reverse(windows, ws, H, W):
    B = int(windows.shape[0] / (H * W / ws / ws))
    x = windows.view(B, H // ws, W // ws, ws, ws, -1)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(B, H, W, -1)


class OriginalSwinBlock(nn.Module):
    """SwinTransformerBlock without the MLP: norm, (shifted) window attention, residual."""

    def __init__(self, dim, resolution, num_heads, window_size=7, shift_size=0, attn_drop=0.0):
        super().__init__()
        self.resolution, self.window_size, self.shift_size = resolution, window_size, shift_size
        self.norm1 = nn.LayerNorm(dim)
        self.attn = OriginalWindowAttention(dim, (window_size, window_size), num_heads, attn_drop=attn_drop)
        attn_mask = None
        if shift_size > 0:
            H, W = resolution
            img_mask = torch.zeros((1, H, W, 1))
            cnt = 0
            for h in (slice(0, -window_size), slice(-window_size, -shift_size), slice(-shift_size, None)):
                for w in (slice(0, -window_size), slice(-window_size, -shift_size), slice(-shift_size, None)):
                    img_mask[:, h, w, :] = cnt
                    cnt += 1
            mask_windows = window_partition(img_mask, window_size).view(-1, window_size * window_size)
            attn_mask = mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)
            attn_mask = attn_mask.masked_fill(attn_mask != 0, -100.0).masked_fill(attn_mask == 0, 0.0)
        self.register_buffer("attn_mask", attn_mask)

    def forward(self, x):
        H, W = self.resolution
        B, L, C = x.shape
        shortcut = x
        x = self.norm1(x).view(B, H, W, C)
        if self.shift_size > 0:
            x = torch.roll(x, shifts=(-self.shift_size, -self.shift_size), dims=(1, 2))
        windows = window_partition(x, self.window_size).view(-1, self.window_size * self.window_size, C)
        mask = None if self.attn_mask is None else self.attn_mask.to(x.dtype)
        windows = self.attn(windows, mask=mask).view(-1, self.window_size, self.window_size, C)
        x = window_reverse(windows, self.window_size, H, W)
        if self.shift_size > 0:
            x = torch.roll(x, shifts=(self.shift_size, self.shift_size), dims=(1, 2))
        return shortcut + x.view(B, H * W, C)


class HF4SwinSelfAttention(nn.Module):
    def __init__(self, dim, num_heads, window_size, dropout=0.0):
        super().__init__()
        self.num_attention_heads = num_heads
        self.attention_head_size = dim // num_heads
        self.all_head_size = num_heads * self.attention_head_size
        self.window_size = (window_size, window_size)
        self.relative_position_bias_table = nn.Parameter(0.02 * torch.randn((2 * window_size - 1) ** 2, num_heads))
        self.register_buffer("relative_position_index", relative_position_index(window_size, window_size))
        self.query = nn.Linear(dim, self.all_head_size)
        self.key = nn.Linear(dim, self.all_head_size)
        self.value = nn.Linear(dim, self.all_head_size)
        self.dropout = nn.Dropout(dropout)

    def transpose_for_scores(self, x):
        x = x.view(x.size()[:-1] + (self.num_attention_heads, self.attention_head_size))
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None, head_mask=None, output_attentions=False):
        batch_size, dim, num_channels = hidden_states.shape
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        scores = torch.matmul(query_layer, key_layer.transpose(-1, -2)) / self.attention_head_size ** 0.5
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        bias = bias.view(self.window_size[0] * self.window_size[1], self.window_size[0] * self.window_size[1], -1)
        scores = scores + bias.permute(2, 0, 1).contiguous().unsqueeze(0)
        if attention_mask is not None:
            mask_shape = attention_mask.shape[0]
            scores = scores.view(batch_size // mask_shape, mask_shape, self.num_attention_heads, dim, dim)
            scores = scores + attention_mask.unsqueeze(1).unsqueeze(0)
            scores = scores.view(-1, self.num_attention_heads, dim, dim)
        probs = self.dropout(nn.functional.softmax(scores, dim=-1))
        if head_mask is not None:
            probs = probs * head_mask
        context = torch.matmul(probs, value_layer).permute(0, 2, 1, 3).contiguous()
        context = context.view(context.size()[:-2] + (self.all_head_size,))
        return (context, probs) if output_attentions else (context,)


class CosineWindowAttention(OriginalWindowAttention):
    """SwinV2-style: cosine similarity with a learned logit scale (not fusable exactly)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones((self.num_heads, 1, 1))))

"""1x1 convolutions computed as one matrix multiply over the channels (``fused_ops: [pointwise_conv]``).

A 1x1 convolution with no padding is a linear map of each pixel's channels: ``y[n, :, i, j] = W x[n, :, s*i, s*j]
+ b`` for stride ``s``. Bottleneck ResNets (He et al. 2016, "Deep residual learning for image recognition", the
bottleneck block's two 1x1 convolutions), MobileNets' pointwise convolutions (Howard et al. 2017) and the
squeeze-excite gates of EfficientNet and RegNet compute most of their FLOPs in such layers. On a CPU, oneDNN's
convolution backward runs small maps of them far below its matrix-multiply speed: timm's ResNet-50 at 32 px,
batch 16, spent 76 ms of a 138 ms convolution forward-and-backward in its 1x1 layers, 35 ms as matrix multiplies
(layer 4's stride-2 downsample: 12.9 ms against 2.4 ms), on a 2-core Xeon with AMX. The same computation within
float rounding (another summation order of the same products, like another convolution algorithm).

How: the module's class changes (`aiak.runtime.class_swap`) to one whose ``forward`` strides the input (exact for
a 1x1 kernel with no padding), reads it as ``[N, H, W, C]`` (a view of a channels_last tensor; one copy of a
contiguous one) and calls ``F.linear`` with the weight as a ``[out, in]`` matrix, so autocast, O2 and every hook
treat it as the convolution. The output has the memory format the convolution would give: channels_last where the
input's or the weight's strides are ordered so, contiguous otherwise. Parameters, buffers, ``state_dict`` keys and
hooks are untouched.

Which modules: a `torch.nn.Conv2d` whose forward is Conv2d's own (timm's weight-standardized and "same"-padded
convolutions, which override it, are left alone), with a 1x1 kernel, no padding and one group; not a
``LazyConv2d``, which becomes a plain ``Conv2d`` at its first call. A call with an unbatched ``[C, H, W]`` input,
and `torch.fx` tracing (torchvision's feature extractors), compute as the convolution.

Whether it pays depends on the map size and the layout (``python benchmarks/pointwise_conv.py`` times each layer and
the whole step): `auto`'s trials and run-time guard time it against the step without it.
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F
from torch import nn
from torch._prims_common import suggest_memory_format
from torch.nn.modules.lazy import LazyModuleMixin

from aiak.runtime.class_swap import original_class, restore_class, swap_class

__all__ = ["PointwiseConvAsMatmul", "is_pointwise_conv", "replace_pointwise_convs", "restore_pointwise_convs",
           "pointwise_convs"]


class PointwiseConvAsMatmul:
    """The mixin put in front of a 1x1 `torch.nn.Conv2d` (see the module docstring)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(input, torch.fx.Proxy) or input.dim() != 4:   # torch.fx traces (feature extractors) the conv
            return super().forward(input)
        # the layout the convolution gives: channels_last where the input's or the weight's strides are ordered so
        channels_last = torch.channels_last in (suggest_memory_format(input), suggest_memory_format(self.weight))
        sh, sw = self.stride
        x = input if (sh, sw) == (1, 1) else input[:, :, ::sh, ::sw]
        weight = self.weight.reshape(self.out_channels, self.in_channels)
        y = F.linear(x.permute(0, 2, 3, 1), weight, self.bias).permute(0, 3, 1, 2)
        return y if channels_last else y.contiguous()


def is_pointwise_conv(module: nn.Module) -> bool:
    """True for a module `replace_pointwise_convs` computes as a matrix multiply, or has (see the module docstring)."""
    cls = original_class(module) or type(module)
    if not isinstance(module, nn.Conv2d) or isinstance(module, LazyModuleMixin):
        return False
    if cls.forward is not nn.Conv2d.forward or cls._conv_forward is not nn.Conv2d._conv_forward:
        return False
    return (tuple(module.kernel_size) == (1, 1) and module.groups == 1
            and (module.padding in ("valid", "same") or tuple(module.padding) == (0, 0)))


def _is_swapped(module: nn.Module) -> bool:
    return isinstance(module, PointwiseConvAsMatmul)


def replace_pointwise_convs(model: nn.Module) -> int:
    """Compute every 1x1 convolution of ``model`` as a matrix multiply, in place.

    What `fused_ops: [pointwise_conv]` does: each module keeps its parameters, buffers, hooks and `state_dict` keys
    and only its class changes (see the module docstring).

    Args:
        model: the bare model (before DDP or `torch.compile`).

    Returns:
        How many modules were swapped now (modules swapped before are not counted again).
    """
    replaced = 0
    for module in model.modules():
        if not _is_swapped(module) and is_pointwise_conv(module):
            swap_class(module, PointwiseConvAsMatmul, "Matmul")
            replaced += 1
    return replaced


def restore_pointwise_convs(model: nn.Module) -> int:
    """Undo `replace_pointwise_convs` in place: each swapped module computes as a convolution again.

    Args:
        model: a model `replace_pointwise_convs` changed.

    Returns:
        How many modules were restored.
    """
    return sum(restore_class(module) for module in model.modules() if _is_swapped(module))


def pointwise_convs(model: nn.Module) -> List[nn.Module]:
    """The modules of ``model`` that `replace_pointwise_convs` swapped."""
    return [module for module in model.modules() if _is_swapped(module)]

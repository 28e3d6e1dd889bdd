"""Parameter groups that exclude biases and normalization weights from weight decay and adaptation.

Layer-wise trust ratios were designed for weight matrices and convolution kernels. The large-batch
recipes that made LARS and LAMB work (Goyal et al. 2017 for decay on BN; You et al. 2019 for BERT;
MLPerf ResNet-50 LARS) leave biases and normalization scales/shifts out of both weight decay and the
trust ratio. Which parameters those are is decided here **by module type first** (every parameter owned
by a normalization layer, `aiak.util.norm_layers.is_norm_layer`), then by name (``bias``) and shape (1-D tensors such as
layer-scale gammas), so a model with custom-named norm layers is still handled.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Set

import torch
from torch import nn

from aiak.util.norm_layers import is_norm_layer

__all__ = ["excluded_parameters", "layerwise_param_groups", "split_param_groups"]

def excluded_parameters(model: nn.Module) -> Set[int]:
    """``id()`` of every parameter that should get neither weight decay nor a trust ratio.

    Excluded: parameters owned directly by a normalization module (by type), parameters named ``bias``,
    and any parameter with fewer than 2 dimensions (scales, gains, layer-scale vectors).
    """
    excluded: Set[int] = set()
    for module in model.modules():
        norm = is_norm_layer(module)
        for name, p in module.named_parameters(recurse=False):
            if norm or name == "bias" or name.endswith("_bias") or p.ndim < 2:
                excluded.add(id(p))
    return excluded


def split_param_groups(groups: Sequence[Dict[str, Any]], excluded: Set[int]) -> List[Dict[str, Any]]:
    """Split each group in two: the parameters to adapt, and the excluded ones (``weight_decay=0``, ``adapt=False``).

    Every other key of a group (its ``lr``, user keys) is kept in both halves; empty halves are dropped,
    and the order of parameters inside each half follows the original group.
    """
    out: List[Dict[str, Any]] = []
    for group in groups:
        params = list(group["params"])
        rest = {k: v for k, v in group.items() if k != "params"}
        kept = [p for p in params if id(p) not in excluded]
        dropped = [p for p in params if id(p) in excluded]
        if kept:
            out.append({**rest, "params": kept})
        if dropped:
            out.append({**rest, "params": dropped, "weight_decay": 0.0, "adapt": False})
    return out


def layerwise_param_groups(model: nn.Module, weight_decay: Optional[float] = None,
                           params: Optional[Iterable[torch.Tensor]] = None) -> List[Dict[str, Any]]:
    """Two parameter groups for ``model``: decayed and adapted weights, then excluded biases / norm weights.

    Args:
        model: where module types and parameter names are looked up.
        weight_decay: put on the first group when given (the excluded group always gets 0).
        params: restrict to these parameters (default: every parameter of ``model`` that requires grad).
    """
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    group: Dict[str, Any] = {"params": list(params)}
    if weight_decay is not None:
        group["weight_decay"] = weight_decay
    return split_param_groups([group], excluded_parameters(model))

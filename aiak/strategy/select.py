"""Strategy resolution for ``optimize()``, and the (for now conservative) auto-selector.

``strategy="auto"`` starts from the ``default`` profile (numerically identical to plain PyTorch) and turns
on only what cannot change the math (layouts, prefetching, algorithm choice; results stay within float
rounding of plain PyTorch) and is known to help on the detected hardware. Every choice comes with
a reason, so ``aiak explain`` and the log can say why each knob is what it is.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Set, Tuple

import torch
from torch import nn

from aiak.strategy.profiles import load_strategy
from aiak.strategy.schema import Strategy

Reasons = Dict[str, str]


def model_features(model: Optional[nn.Module]) -> Set[str]:
    """Tags describing the model, matched against profiles' ``match.modules``."""
    tags: Set[str] = set()
    if model is None:
        return tags
    for m in model.modules():
        name = type(m).__name__.lower()
        if isinstance(m, (nn.Conv2d, nn.Conv3d)):
            tags.add("conv2d" if isinstance(m, nn.Conv2d) else "conv3d")
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            tags.add("batchnorm")
        if isinstance(m, nn.LayerNorm) or "layernorm" in name:
            tags.add("layernorm")
        if isinstance(m, nn.MultiheadAttention) or name.endswith(("selfattention", "attention")):
            tags.add("multihead_attention")
        if "windowattention" in name or hasattr(m, "relative_position_bias_table") or "swin" in name:
            tags.add("window_attention")
    return tags


def model_device(model: Optional[nn.Module], device: Any = None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if model is not None:
        for p in model.parameters():
            return p.device
    return torch.device("cpu")


def select_strategy(model: Optional[nn.Module], optimizer=None, loader=None, *,
                    device: Any = None) -> Tuple[Strategy, Reasons]:
    """The auto-selector: ``(Strategy, reasons)``; reasons map each changed knob to the rule that chose it."""
    base = load_strategy("default")
    data = base.to_dict()
    data["name"] = "auto"
    data["description"] = "default profile + knobs that keep the math and help on the detected hardware"
    reasons: Reasons = {"*": "auto: started from the 'default' profile (plain PyTorch numerics)"}
    dev = model_device(model, device)
    features = model_features(model)
    if loader is not None:
        data["loader"]["prefetch"] = 2
        reasons["loader.prefetch"] = ("a loader was given: a background thread keeps 2 batches ready so loading "
                                      "overlaps the step (same batches, same order)")
        if dev.type == "cuda":
            data["loader"]["pin_memory"] = True
            reasons["loader.pin_memory"] = "CUDA device: pinned host memory makes non-blocking copies possible"
    if "conv2d" in features:
        data["channels_last"] = True
        reasons["channels_last"] = ("Conv2d layers: NHWC is the layout oneDNN (CPU) and cuDNN (CUDA) convolve fastest; "
                                    "a layout change only (same function, float rounding may differ)")
    if dev.type == "cuda" and ("conv2d" in features or "conv3d" in features):
        data["cudnn_benchmark"] = True
        reasons["cudnn_benchmark"] = "CUDA + convolutions: let cuDNN pick the fastest algorithm per shape"
    for knob in ("tf32", "precision", "grad_accumulation", "optimizer", "fused_ops", "comm"):
        reasons.setdefault(knob, "kept at default: changes numerics, so only a named profile turns it on")
    return Strategy.from_dict(data, source="auto"), reasons


def resolve_strategy(spec: Any, model=None, optimizer=None, loader=None, *, device: Any = None
                     ) -> Tuple[Strategy, Reasons]:
    """``optimize()``'s first step: "auto" -> the auto-selector; anything else -> ``load_strategy``."""
    if isinstance(spec, str) and spec == "auto":
        return select_strategy(model, optimizer, loader, device=device)
    strategy = load_strategy(spec)
    reasons: Reasons = {"*": f"strategy {strategy.name!r} given explicitly"
                             + (f": {strategy.description}" if strategy.description else "")}
    chosen, default = strategy.to_dict(), load_strategy("default").to_dict()
    for key, value in chosen.items():
        if key in ("name", "extends", "description", "match"):
            continue
        pairs = ([(f"{key}.{k}", v, default[key].get(k)) for k, v in value.items()] if isinstance(value, dict)
                 else [(key, value, default.get(key))])
        for path, new, old in pairs:
            if new != old:
                reasons[path] = f"set by strategy {strategy.name!r} (default: {old})"
    return strategy, reasons

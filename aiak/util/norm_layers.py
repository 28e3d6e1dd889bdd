"""Which modules are normalization layers: one answer for O2 (computed in fp32), LAMB/LARS (left out of weight
decay and trust ratios) and the probes (``batchnorm`` / ``layernorm`` / ``groupnorm`` module kinds).

torch's normalization classes, and any class without submodules whose name says ``Norm`` (``LlamaRMSNorm``,
``LayerNorm2d``, ``FrozenBatchNorm2d``, ``T5LayerNorm``): the norm layers of transformers and timm do not all
subclass torch's. A module that holds others is a block, whatever its name: timm's ``ConvNormAct`` and
``NormMlpClassifierHead``, torchvision's ``Conv2dNormActivation``, timm's ``NormFreeNet`` (a whole model) hold
convolutions and linear layers, which O2 computes in half and LAMB/LARS adapt.
"""
from __future__ import annotations

from typing import Optional, Tuple

from torch import nn

# The normalization layers of torch.nn (BatchNorm*/InstanceNorm*/SyncBatchNorm share _NormBase).
NORM_TYPES: Tuple[type, ...] = tuple(t for t in (
    nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
    getattr(nn, "RMSNorm", None),
) if t is not None)


def is_norm_layer(module: nn.Module) -> bool:
    """True for torch.nn normalization layers and for modules without submodules whose class is named like one (the
    class name, not the attribute name the user gave the module)."""
    return isinstance(module, NORM_TYPES) or ("Norm" in type(module).__name__ and not module._modules)


def norm_kind(module: nn.Module) -> Optional[str]:
    """``"batchnorm"``, ``"layernorm"``, ``"groupnorm"``, ``"norm"`` (another normalization layer) or None."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "batchnorm"
    if isinstance(module, nn.GroupNorm):
        return "groupnorm"
    if not is_norm_layer(module):
        return None
    return "layernorm" if isinstance(module, nn.LayerNorm) or "layernorm" in type(module).__name__.lower() else "norm"

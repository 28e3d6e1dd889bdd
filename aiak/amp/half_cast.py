"""O2's cast to the half dtype: every module outside normalization layers, keeping the exact originals.

Casting the whole model and then ``.float()``-ing the norm layers back loses their values for good: a
BatchNorm ``running_var`` of 1e5 becomes ``inf`` in fp16 (max 65504), a running_mean of 1e-8 becomes 0, a
weight of 1.0001 becomes 1.0 in fp16 and bf16. Pretrained CNNs carry such values, so fine-tuning one under
O2 would start from a damaged model. Here norm layers (and anything inside them) are never cast down (fp32
stays as it is; a norm already in a half dtype is widened to fp32, as apex's O2 keeps norms in fp32);
every other module's *own* floating parameters and buffers are cast in place (``Module._apply`` with
``recurse=False``, i.e. what ``Module.to`` does, one module at a time).

What is cast still has to come back exactly in ``state_dict()``: trained parameters through their fp32
master weights (``aiak.amp.precision.MasterWeights``); frozen parameters and buffers (a position table, a
frozen pretrained backbone) through the exact copy taken here, returned for as long as the half tensor
still holds that copy's rounding (if the model changed it since, its half value is returned, widened).
That copy costs the original size of what is cast without a master, as the masters do for the rest.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn

# These accept a half input with fp32 weights natively (CPU and CUDA) and return the input's dtype.
NATIVE_MIXED_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)


def is_norm_layer(module: nn.Module) -> bool:
    """Normalization layers stay fp32 under O2: torch's norm classes, and any class named ``*Norm*``."""
    return isinstance(module, NATIVE_MIXED_NORMS) or "Norm" in type(module).__name__


class CastRecord:
    """The exact values, from before the cast, of every tensor :func:`cast_outside_norms` cast."""

    __slots__ = ("params", "buffers")

    def __init__(self):
        self.params: Dict[int, torch.Tensor] = {}                 # id(parameter) -> exact original
        self.buffers: Dict[Tuple[int, str], torch.Tensor] = {}    # (id(module), buffer name) -> exact original


def _modules_outside_norms(model: nn.Module) -> Iterator[nn.Module]:
    seen: Set[int] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        if id(module) in seen or is_norm_layer(module):
            continue  # a norm layer and everything inside it keep their own precision
        seen.add(id(module))
        yield module
        stack.extend(module.children())


def cast_outside_norms(model: nn.Module, dtype: torch.dtype) -> CastRecord:
    """Cast, in place, the floating parameters and buffers of every module outside norm layers to ``dtype``.

    Tensors a norm layer owns are never rounded, even when a module outside shares them; those already in a
    half dtype (a model ``.half()``-ed by the user) are widened to fp32, which loses nothing. Returns the
    exact originals of what was cast (persistent buffers only: the others never reach a ``state_dict``).
    """
    in_norms: Set[int] = set()
    for module in model.modules():
        if is_norm_layer(module):
            module._apply(lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t)
            in_norms.update(id(t) for t in module.parameters())
            in_norms.update(id(t) for t in module.buffers())

    def casts(t: Optional[torch.Tensor]) -> bool:
        return t is not None and t.is_floating_point() and t.dtype != dtype and id(t) not in in_norms

    record = CastRecord()
    for module in _modules_outside_norms(model):
        for p in module._parameters.values():
            if casts(p):
                record.params.setdefault(id(p), p.detach().clone())
        for name, b in module._buffers.items():
            if casts(b) and name not in module._non_persistent_buffers_set:
                record.buffers[(id(module), name)] = b.detach().clone()
        module._apply(lambda t: t.to(dtype) if casts(t) else t, recurse=False)
    return record


def install_exact_state_dict(model: nn.Module, record: CastRecord, skip: Set[int] = frozenset()) -> None:
    """``model.state_dict()`` gives back the exact originals of what was cast, and loading one sets them.

    Parameters whose ``id`` is in ``skip`` (those with fp32 master weights, saved and loaded through the
    masters) are left alone. A value is returned exactly while the half tensor still holds its rounding;
    once the model changed the tensor, its current value is returned, widened to the original dtype.
    """
    entries: List[Tuple[str, dict, str, torch.Tensor]] = []   # (key, owning dict, name in it, exact value)
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = module_name + "." if module_name else ""
        for pname, p in module._parameters.items():
            if p is not None and id(p) not in skip and id(p) in record.params:
                entries.append((prefix + pname, module._parameters, pname, record.params[id(p)]))
        for bname in module._buffers:
            if (id(module), bname) in record.buffers:
                entries.append((prefix + bname, module._buffers, bname, record.buffers[(id(module), bname)]))
    if not entries:
        return

    def save_exact(module, state_dict, prefix, local_metadata):
        for name, owner, attr, exact in entries:
            key, current = prefix + name, owner.get(attr)
            if key not in state_dict or current is None:
                continue
            unchanged = current.shape == exact.shape and torch.equal(current, exact.to(current.dtype))
            state_dict[key] = exact if unchanged else current.detach().to(exact.dtype)
        return state_dict

    def load_exact(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        for name, owner, attr, exact in entries:
            value = state_dict.get(prefix + name)
            if torch.is_tensor(value) and value.shape == exact.shape:  # a mismatch is left to torch to report
                with torch.no_grad():
                    exact.copy_(value)

    model._register_state_dict_hook(save_exact)
    model._register_load_state_dict_pre_hook(load_exact, with_module=True)

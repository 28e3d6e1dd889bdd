"""Which operations ``torch.autocast`` runs in fp32, read from torch itself.

Autocast sorts operations in three lists (the "CUDA Ops that can autocast to float32" and their CPU counterparts
in the ``torch.amp`` documentation, kept in ``aten/src/ATen/autocast_mode.cpp``): ops cast to the half dtype
(matrix products, convolutions), ops cast to fp32 (losses, ``torch.linalg``, ``quantile``, ``cdist``; on CUDA
also ``exp``, ``softmax``, ``layer_norm``), and ops cast to the widest input type (``cat``, ``stack``). The lists
differ by device and torch version and are not exposed to Python, so an O2 region asks torch instead: it runs the
operation once, under autocast, on fake tensors of the call's shapes in the half dtype (``FakeTensorMode``: no
data, no kernel, no side effect) and sees whether autocast handed back fp32. The answer is kept per operation and
device.

`aiak.amp.region_state` uses it where the user's fp32 tensor meets half tensors: an operation autocast runs in
fp32 gets the fp32 value itself, not a rounded half copy of it.
"""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_map

_known: Dict[Tuple[Callable, str, torch.dtype], bool] = {}


def runs_in_fp32(func: Callable, args, kwargs, device_type: str, dtype: torch.dtype) -> bool:
    """Autocast (``dtype`` on ``device_type``) runs ``func`` in fp32 even when every floating input is in
    ``dtype``. ``args``/``kwargs`` give the shapes for the one probe per operation; a call the probe cannot make
    (an op with no fake kernel) counts as not fp32, which is what the region did without asking."""
    key = (func, device_type, dtype)
    known = _known.get(key)
    if known is None:
        known = _known[key] = _probe(func, args, kwargs, device_type, dtype)
    return known


def _probe(func: Callable, args, kwargs, device_type: str, dtype: torch.dtype) -> bool:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()

    def fake(t):
        if not isinstance(t, torch.Tensor):
            return t
        with torch._C.DisableTorchFunctionSubclass():
            meta = (tuple(t.shape), t.stride(), t.dtype, t.device)
        half = dtype if meta[2].is_floating_point else meta[2]
        with mode:
            return torch.empty_strided(meta[0], meta[1], dtype=half, device=meta[3])

    try:
        with torch.inference_mode(False), torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            fake_args, fake_kwargs = tree_map(fake, args), tree_map(fake, kwargs)
            with mode, torch.autocast(device_type, dtype=dtype):
                out = func(*fake_args, **fake_kwargs)
    except Exception:  # noqa: BLE001 - no fake kernel, a data-dependent shape: not answerable here
        return False
    floats = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return bool(floats) and all(t.dtype == torch.float32 for t in floats)

"""Mixed precision O1 / O2 with apex's semantics, without apex.

O1 runs the forward under ``torch.autocast`` (fp32 weights). O2 (apex's "almost fp16") casts the model to
the half dtype except normalization layers, which are never cast and keep their exact fp32 values (see
:mod:`aiak.amp.half_cast`); floating inputs are cast to the half dtype on the way in and outputs come back
as fp32; the optimizer steps fp32 master copies of the half parameters (Micikevicius et al., "Mixed
Precision Training", ICLR 2018, figure 1), built from the values before the cast. fp16 uses a
:class:`~aiak.amp.loss_scaler.LossScaler`; bf16 has fp32's exponent range and needs none. A precision the
device only emulates (fp16 on a CPU, say) warns once, with its measured cost (:mod:`aiak.amp.emulation`).

Loss scaling and gradient-accumulation averaging are applied by an identity autograd function on the
model's outputs that multiplies the incoming gradient by ``loss_scale / accumulation``, so the user's plain
``loss.backward()`` stays as it is. Terms of the loss that do not flow through the model's outputs (an L2
penalty computed directly on the parameters, say) are not scaled.
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from aiak._nested import map_tensors
from aiak.amp.emulation import warn_if_emulated
from aiak.amp.half_cast import NATIVE_MIXED_NORMS, cast_outside_norms, install_exact_state_dict, is_norm_layer
from aiak.amp.loss_scaler import LossScaler
from aiak.strategy.schema import Precision
from aiak.strategy.select import model_device

logger = logging.getLogger("aiak")

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
HALF_DTYPES = (torch.float16, torch.bfloat16)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by ``factor()``, read at backward time.

    The forward returns ``x.detach()``: the same memory and version counter as ``x``, no copy, and not a view
    in autograd's sense. A view made inside a custom Function (``x.view_as(x)``) cannot be modified in place,
    so a ``loss *= w`` on the model's output (which Hugging Face's Trainer does with its default
    ``average_tokens_across_devices=True``) raised "Output 0 of _ScaleGrad is a view and is being modified
    inplace". An in-place op on the output now behaves as it would on the model's own output without aiak.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: Callable[[], float]) -> torch.Tensor:
        ctx.factor = factor
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor(), None


def install_output_hook(model: nn.Module, *, to_fp32: bool, grad_factor: Optional[Callable[[], float]]):
    """Outputs: floating tensors cast to fp32 (O1/O2) and gradient-scaled (loss scale, accumulation)."""

    def on_output(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        if to_fp32 and t.dtype != torch.float32:
            t = t.float()
        if grad_factor is not None and t.requires_grad:
            t = _ScaleGrad.apply(t, grad_factor)
        return t

    def hook(module, args, output):
        return map_tensors(output, on_output)

    return model.register_forward_hook(hook)


def install_input_cast(module: nn.Module, dtype: torch.dtype, *, output_dtype: Optional[torch.dtype] = None):
    """Cast floating inputs of ``module`` to ``dtype`` (and its floating outputs to ``output_dtype``)."""

    def cast_to(target):
        return lambda t: t.to(target) if t.is_floating_point() and t.dtype != target else t

    def pre_hook(mod, args, kwargs):
        return map_tensors(args, cast_to(dtype)), map_tensors(kwargs, cast_to(dtype))

    handles = [module.register_forward_pre_hook(pre_hook, with_kwargs=True)]
    if output_dtype is not None:
        handles.append(module.register_forward_hook(lambda mod, args, out: map_tensors(out, cast_to(output_dtype))))
    return handles


class MasterWeights:
    """fp32 master copies of an optimizer's half-precision parameters (apex O2 ``master_params``).

    The optimizer's ``param_groups`` (and any existing state) are re-pointed to the masters; the model keeps
    its half parameters. ``exact_values`` (``id(model parameter)`` -> its value before the cast) makes each
    master exact; a parameter missing there (half before O2 already) gets its half value widened.
    ``grads_to_master`` and ``master_to_model`` move gradients and weights across.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, exact_values: Dict[int, torch.Tensor]):
        self.pairs: List[Tuple[nn.Parameter, nn.Parameter]] = []
        for group in optimizer.param_groups:
            new_params = []
            for p in group["params"]:
                if p.dtype in HALF_DTYPES:
                    value = exact_values.get(id(p), p.detach())
                    master = nn.Parameter(value.float() if value.dtype != torch.float32 else value,
                                          requires_grad=p.requires_grad)
                    if p in optimizer.state:
                        optimizer.state[master] = optimizer.state.pop(p)
                    self.pairs.append((p, master))
                    new_params.append(master)
                else:
                    new_params.append(p)
            group["params"] = new_params
        self.model_param_of = {id(m): p for p, m in self.pairs}  # the pairs never change after this

    def grads_to_master(self) -> None:
        for p, master in self.pairs:
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        if self.pairs:
            torch._foreach_copy_([p for p, _ in self.pairs], [m for _, m in self.pairs])

    @torch.no_grad()
    def model_to_master_from(self, values: Dict[int, torch.Tensor]) -> None:
        """Set masters from exact fp32 values keyed by ``id(model_param)`` (used when loading checkpoints)."""
        for p, master in self.pairs:
            value = values.get(id(p))
            if value is not None and value.shape == master.shape:  # a mismatch is left to torch to report
                master.copy_(value)
        self.master_to_model()

    @torch.no_grad()
    def broadcast_(self, src: int = 0) -> None:
        """Make every rank's masters equal to rank ``src``'s (exact fp32, before DDP broadcasts half weights)."""
        import torch.distributed as dist

        for _, master in self.pairs:
            dist.broadcast(master.data, src=src)
        self.master_to_model()

    def clear_model_grads(self) -> None:
        for p, _ in self.pairs:
            p.grad = None


class PrecisionState:
    """Everything precision attaches to a model/optimizer pair; kept on ``model._aiak_precision``."""

    def __init__(self, config: Precision, scaler: Optional[LossScaler], master: Optional[MasterWeights],
                 emulated: Optional[str] = None):
        self.config = config
        self.scaler = scaler
        self.master = master
        self.emulated = emulated  # a note when the device only emulates the dtype (it was warned about)

    def describe(self) -> str:
        c = self.config
        if c.level == "O0":
            return "O0 (fp32)"
        parts = [f"{c.level} {c.dtype}"]
        if self.master is not None:
            parts.append(f"{len(self.master.pairs)} fp32 master weights")
        parts.append(repr(self.scaler) if self.scaler else "no loss scaling")
        if self.emulated:
            parts.append(self.emulated)
        return ", ".join(parts)


def make_scaler(config: Precision) -> Optional[LossScaler]:
    if config.level == "O0" or config.loss_scale == "none":
        return None
    if config.dtype == "bf16":
        if config.loss_scale != "dynamic":
            logger.info("aiak: precision.loss_scale=%s ignored: bf16 has fp32's exponent range and needs no "
                        "loss scaling", config.loss_scale)
        return None
    if config.loss_scale == "dynamic":
        return LossScaler(dynamic=True)
    return LossScaler(init_scale=float(config.loss_scale), dynamic=False)


def apply_precision(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], config: Precision,
                    device_type: str, *, device: Optional[torch.device] = None) -> PrecisionState:
    """Apply O0/O1/O2 to ``model`` (in place) and, for O2, give ``optimizer`` fp32 master weights.

    ``device`` (default: where the model's parameters are) is only used to tell
    whether the device computes the half dtype natively. Gradient scaling is installed separately (see
    :func:`install_output_hook`) because gradient accumulation shares it.
    """
    if config.level == "O0":
        return PrecisionState(config, None, None)
    dtype = DTYPES[config.dtype]
    scaler = make_scaler(config)
    emulated = warn_if_emulated(config.dtype, model_device(model, device))
    if config.level == "O1":
        _patch_forward_autocast(model, device_type, dtype)
        return PrecisionState(config, scaler, None, emulated)

    # O2: cast everything outside norm layers (keeping exact originals), cast inputs at the model's entry.
    record = cast_outside_norms(model, dtype)
    for module in model.modules():
        if is_norm_layer(module) and not isinstance(module, NATIVE_MIXED_NORMS):
            install_input_cast(module, torch.float32, output_dtype=dtype)
    install_input_cast(model, dtype)
    master = MasterWeights(optimizer, record.params) if optimizer is not None else None
    if master is not None:
        _install_master_state_dict(model, master)
    install_exact_state_dict(model, record, skip={id(p) for p, _ in master.pairs} if master else frozenset())
    return PrecisionState(config, scaler, master, emulated)


def _patch_forward_autocast(model: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    original = model.forward

    def forward(*args, **kwargs):
        with torch.autocast(device_type=device_type, dtype=dtype):
            return original(*args, **kwargs)

    forward.__wrapped__ = original
    model.forward = forward


def _install_master_state_dict(model: nn.Module, master: MasterWeights) -> None:
    """``model.state_dict()`` returns the exact fp32 masters under the user's keys; loading one sets them."""
    master_of = {id(p): m for p, m in master.pairs}
    keyed = [(name, p, master_of[id(p)]) for name, p in model.named_parameters(remove_duplicate=False)
             if id(p) in master_of]

    def save_masters(module, state_dict, prefix, local_metadata):
        for name, _, m in keyed:
            if prefix + name in state_dict:
                state_dict[prefix + name] = m.detach()
        return state_dict

    def load_masters(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        values = {id(p): state_dict[prefix + name] for name, p, _ in keyed
                  if torch.is_tensor(state_dict.get(prefix + name))}
        if values:
            # Masters take the exact values; the model's half weights are cast from them after the load.
            master.model_to_master_from(values)

    model._register_state_dict_hook(save_masters)
    model._register_load_state_dict_pre_hook(load_masters, with_module=True)

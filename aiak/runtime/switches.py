"""Global switches: TF32 matmuls/convolutions and cuDNN autotuning (CUDA only), and the channels_last layout.

TF32 runs fp32 matmuls and convolutions on Ampere+ tensor cores with a 10-bit mantissa (NVIDIA,
"Accelerating AI Training with NVIDIA TF32 Tensor Cores", 2020): several times faster, slightly different
numerics, so it is off in the ``default`` profile. Without CUDA these knobs cannot apply: they warn and
are skipped (`aiak.util.machine.devices.cuda_capability` says which device they act on).

A knob that is off writes nothing: the process keeps its own setting (the script's, or PyTorch's default).
`process_switches` is the one list of the process-wide settings a strategy may change:
`aiak.runtime.rollback` puts them back when ``optimize()`` fails, and the trials and the timing engine
write each contender's before its steps, so that every candidate is timed under its own switches.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Tuple

import torch

from aiak.runtime import malloc
from aiak.util.machine import devices
from aiak.util.nested import map_tensors
from aiak.util.warn import warn


def apply_tf32(enabled: bool, device: torch.device) -> str:
    """Set matmul and cuDNN TF32; returns what was done, for the summary."""
    if not enabled:
        return "off"
    capability = devices.cuda_capability(device)
    if capability is None:
        warn(f"aiak: tf32 requested but the model runs on {device.type}, not CUDA: skipped")
        return f"skipped (no CUDA: model on {device.type})"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    major, _ = capability
    if major < 8:
        return f"on (no effect: compute capability {major}.x has no TF32 tensor cores)"
    return "on (matmul + cuDNN)"


def apply_channels_last(model: torch.nn.Module, optimizer: Any = None) -> str:
    """NHWC weights and 4-D inputs: cuDNN's fastest layout for convolutions with tensor cores. The optimizer's state
    follows its parameters' layout, now and whenever a checkpoint is loaded into it (`lay_out_state`)."""
    layout, _ = attach_layout(model)
    layout.switch(model, True, optimizer)
    hooks = getattr(optimizer, "_optimizer_load_state_dict_post_hooks", None)
    if hooks is not None and not any(h is lay_out_state for h in hooks.values()):
        optimizer.register_load_state_dict_post_hook(lay_out_state)
    n_conv = sum(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    return f"on (model and 4-D inputs NHWC; {n_conv} Conv2d layers)"


class ChannelsLast:
    """The channels_last layout of one model, switchable between steps (the run-time guard, `aiak.tune.guard`, times
    it against the contiguous one): `switch` moves every 4-D parameter and buffer in place (the same tensors the
    optimizer holds, their data in the other layout), and the optimizer's state with them (`lay_out_state`), and
    `inputs`, the model's forward pre-hook, gives its 4-D inputs the same layout. A bound method, not a closure: a
    deep copy of the model gets its own."""

    def __init__(self):
        self.on = False

    def switch(self, model: torch.nn.Module, on: bool, optimizer: Any = None) -> None:
        model.to(memory_format=torch.channels_last if on else torch.contiguous_format)
        if optimizer is not None:
            lay_out_state(optimizer)
        self.on = on

    def inputs(self, module, args, kwargs):
        layout = torch.channels_last if self.on else torch.contiguous_format

        def to_layout(t: torch.Tensor) -> torch.Tensor:
            return t.contiguous(memory_format=layout) if t.dim() == 4 else t

        return map_tensors(args, to_layout), map_tensors(kwargs, to_layout)


def lay_out_state(optimizer: Any) -> None:
    """Each 4-D tensor of ``optimizer``'s per-parameter state (a momentum buffer, Adam's moments) in its parameter's
    layout, in place (``.data``, as ``Module.to`` moves parameters): an elementwise update over two layouts is much
    slower than over one (SGD with momentum over timm's ResNet-50's parameters: 17.7 ms a step with both contiguous or
    both channels_last, 26.6 ms with the buffers in the other layout; 2 cores). Values are unchanged. Also the
    optimizer's ``load_state_dict`` post hook where channels_last is applied: a checkpoint's state arrives
    contiguous."""
    for param, state in getattr(optimizer, "state", {}).items():
        if not isinstance(param, torch.Tensor) or param.dim() != 4 or not isinstance(state, dict):
            continue
        layout = (torch.channels_last if param.is_contiguous(memory_format=torch.channels_last)
                  else torch.contiguous_format)
        for tensor in state.values():
            if isinstance(tensor, torch.Tensor) and tensor.shape == param.shape \
                    and not tensor.is_contiguous(memory_format=layout):
                tensor.data = tensor.contiguous(memory_format=layout)


def attach_layout(model: torch.nn.Module) -> Tuple["ChannelsLast", Any]:
    """A `ChannelsLast`, off, hooked on a model that was not given channels_last, so that it can be switched on
    between steps (the run-time guard times it); returns it and its hook's handle (removing it detaches it)."""
    layout = ChannelsLast()
    return layout, model.register_forward_pre_hook(layout.inputs, with_kwargs=True)


def channels_last_of(model: torch.nn.Module):
    """The `ChannelsLast` hooked on ``model`` by `apply_channels_last`, or None."""
    return next((h.__self__ for h in model._forward_pre_hooks.values()
                 if isinstance(getattr(h, "__self__", None), ChannelsLast)), None)


def apply_cudnn_benchmark(enabled: bool, device: torch.device) -> str:
    if not enabled:
        return "off"
    if devices.cuda_capability(device) is None:
        warn("aiak: cudnn_benchmark requested without CUDA: skipped")
        return "skipped (no CUDA)"
    torch.backends.cudnn.benchmark = True
    return "on"


# -- the one list of process switches ---------------------------------------------------------------
# Switches that change no computation, only how the process gets its memory: every contender of a comparison, plain
# PyTorch's compute among them, runs with them as the strategy applied them (the trials' shared copy, the run-time
# guard's arms), as with the optimizer's fused step; the timing engine leaves them as they are (`aiak.measure.rounds`).
MEMORY_SWITCHES = ("malloc_retain",)


def with_memory_switches(switches: Dict[str, Any], applied: Dict[str, Any]) -> Dict[str, Any]:
    """``switches`` with the `MEMORY_SWITCHES` as in ``applied``."""
    return {**switches, **{name: applied[name] for name in MEMORY_SWITCHES if name in applied}}


def read_switches() -> Dict[str, Any]:
    """The process-wide settings a strategy may change (TF32, cuDNN autotuning, threads, CPU affinity, glibc malloc's
    thresholds), by name."""
    return {name: read() for name, (read, _) in process_switches().items()}


def write_switches(values: Dict[str, Any]) -> None:
    """Put back settings read by `read_switches` (only those that differ are written)."""
    switches = process_switches()
    for name, value in values.items():
        read, write = switches[name]
        if read() != value:
            write(value)


def process_switches() -> Dict[str, Tuple[Callable[[], Any], Callable[[Any], None]]]:
    """Process-wide settings ``optimize()`` may change: name -> (read, write)."""
    switches = {
        "matmul.allow_tf32": (lambda: torch.backends.cuda.matmul.allow_tf32,
                              lambda v: setattr(torch.backends.cuda.matmul, "allow_tf32", v)),
        "cudnn.allow_tf32": (lambda: torch.backends.cudnn.allow_tf32,
                             lambda v: setattr(torch.backends.cudnn, "allow_tf32", v)),
        "cudnn.benchmark": (lambda: torch.backends.cudnn.benchmark,
                            lambda v: setattr(torch.backends.cudnn, "benchmark", v)),
        "num_threads": (torch.get_num_threads, torch.set_num_threads),
        "malloc_retain": (malloc.read, malloc.write),
    }
    if hasattr(os, "sched_getaffinity"):
        switches["cpu_affinity"] = (lambda: os.sched_getaffinity(0), lambda v: os.sched_setaffinity(0, v))
    return switches

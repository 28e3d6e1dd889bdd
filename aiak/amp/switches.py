"""Global switches: TF32 matmuls/convolutions and cuDNN autotuning (CUDA only), and the channels_last layout.

TF32 runs fp32 matmuls and convolutions on Ampere+ tensor cores with a 10-bit mantissa (NVIDIA,
"Accelerating AI Training with NVIDIA TF32 Tensor Cores", 2020): several times faster, slightly different
numerics, so it is off in the ``default`` profile. Without CUDA these knobs cannot apply: they warn and
are skipped (:func:`aiak.strategy.probes.cuda_capability` says which device they act on).

A knob that is off writes nothing: the process keeps its own setting (the script's, or PyTorch's default).
The measured trials time each candidate under the switches its own run would have, written before each of
its steps through :mod:`aiak.rollback`'s one list of process switches (:mod:`aiak.tune.trials`).
"""
from __future__ import annotations

import torch

from aiak.amp.warn import warn
from aiak.strategy import probes


def apply_tf32(enabled: bool, device: torch.device) -> str:
    """Set matmul and cuDNN TF32; returns what was done, for the summary."""
    if not enabled:
        return "off"
    capability = probes.cuda_capability(device)
    if capability is None:
        warn(f"aiak: tf32 requested but the model runs on {device.type}, not CUDA: skipped")
        return f"skipped (no CUDA: model on {device.type})"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    major, _ = capability
    if major < 8:
        return f"on (no effect: compute capability {major}.x has no TF32 tensor cores)"
    return "on (matmul + cuDNN)"


def apply_channels_last(model: torch.nn.Module) -> str:
    """NHWC weights and 4-D inputs: cuDNN's fastest layout for convolutions with tensor cores."""
    from aiak._nested import map_tensors

    model.to(memory_format=torch.channels_last)

    def to_nhwc(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t

    model.register_forward_pre_hook(lambda mod, args, kwargs: (map_tensors(args, to_nhwc), map_tensors(kwargs, to_nhwc)),
                                    with_kwargs=True)
    n_conv = sum(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    return f"on (model and 4-D inputs NHWC; {n_conv} Conv2d layers)"


def apply_cudnn_benchmark(enabled: bool, device: torch.device) -> str:
    if not enabled:
        return "off"
    if probes.cuda_capability(device) is None:
        warn("aiak: cudnn_benchmark requested without CUDA: skipped")
        return "skipped (no CUDA)"
    torch.backends.cudnn.benchmark = True
    return "on"

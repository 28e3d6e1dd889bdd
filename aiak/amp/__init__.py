"""Precision and compile switches: TF32, AMP O1 (autocast) and O2 (half-precision compute copies of the fp32
parameters), loss scaling, warnings for precisions the device only emulates, torch.compile with a per-model
eager fallback, and torch's gradient clipping routed to the step controller for optimized parameters."""
from aiak.amp.compile import apply_compile
from aiak.amp.emulation import emulation_warning
from aiak.amp.half_compute import HalfCompute, is_norm_layer
from aiak.amp.loss_scaler import LossScaler
from aiak.amp.precision import PrecisionState, apply_precision
from aiak.amp.switches import apply_channels_last, apply_cudnn_benchmark, apply_tf32

__all__ = ["HalfCompute", "LossScaler", "PrecisionState", "apply_precision", "is_norm_layer", "apply_tf32",
           "apply_cudnn_benchmark", "apply_channels_last", "apply_compile", "emulation_warning"]

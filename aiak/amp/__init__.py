"""Mixed precision: AMP O1 (autocast) and O2 (half-precision compute copies of the fp32 parameters), loss scaling,
a script's own ``GradScaler`` beside them, and warnings for precisions the device only emulates.

The process switches that ``aiak.amp`` also names (TF32, cuDNN autotuning, channels_last, compile) live in
:mod:`aiak.runtime` and are re-exported here, where the public contract lists them."""
from aiak.amp.emulation import emulation_warning
from aiak.amp.half_compute import HalfCompute
from aiak.util.norm_layers import is_norm_layer
from aiak.amp.loss_scaler import LossScaler
from aiak.amp.precision import PrecisionState, apply_precision
from aiak.runtime.compile import apply_compile
from aiak.runtime.switches import apply_channels_last, apply_cudnn_benchmark, apply_tf32

__all__ = ["HalfCompute", "LossScaler", "PrecisionState", "apply_precision", "is_norm_layer", "apply_tf32",
           "apply_cudnn_benchmark", "apply_channels_last", "apply_compile", "emulation_warning"]

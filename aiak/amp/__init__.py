"""Precision and compile switches: TF32, AMP O1 (autocast) and O2 (half model + fp32 master weights), loss
scaling, warnings for precisions the device only emulates, torch.compile with a per-model eager fallback,
and torch's gradient clipping routed to the step controller for optimized parameters."""
from aiak.amp.compile import apply_compile
from aiak.amp.emulation import emulation_warning
from aiak.amp.loss_scaler import LossScaler
from aiak.amp.precision import (MasterWeights, PrecisionState, apply_precision, install_output_hook,
                                is_norm_layer)
from aiak.amp.switches import apply_channels_last, apply_cudnn_benchmark, apply_tf32

__all__ = ["LossScaler", "MasterWeights", "PrecisionState", "apply_precision", "install_output_hook",
           "is_norm_layer", "apply_tf32", "apply_cudnn_benchmark",
           "apply_channels_last", "apply_compile", "emulation_warning"]

"""Precision: TF32 switch, AMP O1 (autocast) and O2 (half model + fp32 master weights), loss scaling."""
from aiak.amp.loss_scaler import LossScaler
from aiak.amp.precision import (MasterWeights, PrecisionState, apply_precision, install_output_hook,
                                is_norm_layer)
from aiak.amp.switches import apply_channels_last, apply_compile, apply_cudnn_benchmark, apply_tf32

__all__ = ["LossScaler", "MasterWeights", "PrecisionState", "apply_precision", "install_output_hook",
           "is_norm_layer", "apply_tf32", "apply_cudnn_benchmark",
           "apply_channels_last", "apply_compile"]

"""aiak.optim: layer-wise large-batch optimizers and the optimizer swap used by ``aiak.optimize``.

* `Lamb` (You et al. 2019) and `Lars` (You et al. 2017): ``torch.optim.Optimizer``
  subclasses with a single-tensor and a bucketed multi-tensor (``torch._foreach_*``) path.
* `layerwise_param_groups`: biases and normalization weights out of decay and adaptation.
* `create` (by name) and `swap_optimizer` (apply a strategy's ``optimizer:`` section).
* `use_fused_step`: torch's fused step for the script's Adam, AdamW, SGD or Adagrad (``optimizer.fused``).
"""
from aiak.optim.factory import HYPERPARAMETERS, OPTIMIZERS, create, swap_optimizer
from aiak.optim.fused_step import fused_step_refusal, use_fused_step
from aiak.optim.lamb import Lamb, lamb
from aiak.optim.lars import Lars, lars
from aiak.optim.param_groups import excluded_parameters, layerwise_param_groups, split_param_groups
from aiak.optim.scheduler import rebind_scheduler

__all__ = ["Lamb", "Lars", "lamb", "lars", "create", "swap_optimizer", "layerwise_param_groups", "split_param_groups",
           "excluded_parameters", "OPTIMIZERS", "HYPERPARAMETERS",
           "rebind_scheduler", "use_fused_step", "fused_step_refusal"]

"""Build LAMB / LARS by name, and swap a user's optimizer for one of them (``optimizer:`` in a strategy).

Mapping applied by `swap_optimizer` (the strategy's ``optimizer: {name: lamb|lars, ...}``):

* Parameter groups: each of the user's groups is kept, in order, and split in two: its weights, and its
  excluded parameters (biases, normalization weights by module type, 1-D tensors) with
  ``weight_decay=0`` and ``adapt=False`` (see `aiak.optim.param_groups`). Parameters the user left
  out of the optimizer stay out.
* Carried over per group from the user's optimizer: ``lr``; ``weight_decay`` (for an Adam- or SGD-style
  L2 decay this becomes LAMB's decoupled decay / LARS's decay); ``betas`` into LAMB; ``momentum`` and
  ``nesterov`` into LARS; ``initial_lr`` and any key of the user's own (one that is not a
  hyper-parameter of the user's optimizer class). Not carried: ``eps`` (it means something else in
  each algorithm; LAMB's default is the paper's 1e-6), Adam's ``amsgrad``, SGD's ``dampening``, and
  the optimizer state (moments are algorithm-specific; a warning says when state is dropped).
* A hyper-parameter given in the strategy overrides the carried value in every group, with one
  exception: when some of the user's groups have weight decay and others have 0 (the user's own
  no-decay list, e.g. position embeddings), the 0 groups keep 0. With no user
  optimizer (``optimizer=None``) every model parameter that requires grad is used and ``lr`` must be
  given in the strategy.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, Iterable, List, Mapping, Optional, Union

import torch
from torch import nn

from aiak.optim.lamb import Lamb
from aiak.optim.lars import Lars
from aiak.optim.param_groups import excluded_parameters, split_param_groups
from aiak.util.text import did_you_mean
from aiak.util.warn import warn

__all__ = ["OPTIMIZERS", "HYPERPARAMETERS", "create", "swap_optimizer", "hyperparameter_problems"]

OPTIMIZERS = {"lamb": Lamb, "lars": Lars}

# Keys accepted in a strategy's ``optimizer:`` section / by ``create`` for each optimizer.
# ``exclude_bias_and_norm`` (default true) turns the bias / normalization exclusion off when false.
HYPERPARAMETERS = {
    "lamb": ("lr", "betas", "eps", "weight_decay", "bias_correction", "trust_clip", "max_grad_norm", "foreach",
             "bucket_elems", "exclude_bias_and_norm"),
    "lars": ("lr", "momentum", "weight_decay", "trust_coefficient", "eps", "nesterov", "clip", "foreach",
             "bucket_elems", "exclude_bias_and_norm"),
}
_BOOLEAN_KEYS = ("bias_correction", "nesterov", "clip", "exclude_bias_and_norm")
_OPTIONAL_BOOLEAN_KEYS = ("foreach",)
# Per-group keys carried from the user's optimizer into each optimizer.
_CARRIED = {"lamb": ("lr", "weight_decay", "betas"), "lars": ("lr", "weight_decay", "momentum", "nesterov")}
# Constructor-level (not per-group) options.
_GLOBAL_KEYS = ("max_grad_norm", "bucket_elems")


def _check_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or name.lower() not in OPTIMIZERS:
        raise ValueError(f"{where} must be one of {sorted(OPTIMIZERS)}, got {name!r}")
    return name.lower()


def hyperparameter_problems(name: str, hyperparameters: Mapping[str, Any], prefix: str) -> List[str]:
    """Every problem with ``hyperparameters`` for optimizer ``name``, each naming ``<prefix><key>``.

    Unknown keys get a "did you mean" and the valid keys; values are checked by type and by the optimizer
    constructor's own range checks, one key at a time. Used at strategy load time (``aiak.strategy.schema``)
    and again by `create` / `swap_optimizer`, so there is one list of rules.
    """
    valid = HYPERPARAMETERS[name]
    problems = []
    for key, value in hyperparameters.items():
        if key not in valid:
            problems.append(f"{prefix}{key}: unknown hyper-parameter for {name}{did_you_mean(key, valid)}; "
                            f"valid keys: {list(valid)}")
            continue
        problem = _hyperparameter_problem(name, key, value)
        if problem is not None:
            problems.append(f"{prefix}{key}{problem}")
    return problems


def _hyperparameter_problem(name: str, key: str, value: Any) -> Optional[str]:
    """What is wrong with one value (the text that follows the key), or None."""
    if key in _BOOLEAN_KEYS:
        return None if isinstance(value, bool) else f" must be true or false, got {value!r}"
    if key in _OPTIONAL_BOOLEAN_KEYS:
        return None if value is None or isinstance(value, bool) else f" must be true, false or null, got {value!r}"
    try:
        with warnings.catch_warnings():  # the constructor's own range checks
            warnings.simplefilter("ignore")
            OPTIMIZERS[name]([torch.zeros(1)], **{"lr": 1.0, key: tuple(value) if isinstance(value, list) else value})
    except (ValueError, TypeError) as e:
        return f": {e}"
    return None


def _validated(name: str, hyperparameters: Mapping[str, Any], prefix: str) -> Dict[str, Any]:
    """``hyperparameters`` checked by `hyperparameter_problems` (one ValueError listing every problem)."""
    problems = hyperparameter_problems(name, hyperparameters, prefix)
    if problems:
        raise ValueError("; ".join(problems))
    return {k: tuple(v) if k == "betas" and isinstance(v, list) else v for k, v in hyperparameters.items()}


def create(name: str, model_or_params: Union[nn.Module, Iterable], **hyperparameters: Any) -> torch.optim.Optimizer:
    """``create("lamb", model, lr=1e-3, weight_decay=0.01)``: a LAMB or LARS optimizer (``lr`` defaults to the
    optimizer's: 1e-3 for LAMB, 1.0 for LARS, as timm's).

    Given a module, parameters are grouped with biases and normalization weights excluded from decay and
    adaptation (unless ``exclude_bias_and_norm=False``); given parameters or groups, they are used as-is.
    """
    name = _check_name(name, "create(name)")
    kw = _validated(name, hyperparameters, prefix="")
    exclude = kw.pop("exclude_bias_and_norm", True)
    if isinstance(model_or_params, nn.Module):
        params = [p for p in model_or_params.parameters() if p.requires_grad]
        groups = [{"params": params}]
        if exclude:
            groups = split_param_groups(groups, excluded_parameters(model_or_params))
        return OPTIMIZERS[name](groups, **kw)
    return OPTIMIZERS[name](model_or_params, **kw)


def swap_optimizer(model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                   cfg: Any) -> Optional[torch.optim.Optimizer]:
    """Apply an ``OptimizerConfig``: ``keep`` returns ``optimizer`` itself; ``lamb``/``lars`` a new optimizer.

    ``cfg`` has ``name`` and ``hyperparameters`` (the extra keys of the YAML section). The new optimizer
    covers the parameters of ``optimizer`` (or of ``model`` when it is None) with the mapping described
    in this module's docstring. Errors name ``optimizer.<key>``.
    """
    cfg_name = getattr(cfg, "name", "keep")
    if cfg_name == "keep":
        return optimizer
    if not isinstance(cfg_name, str) or cfg_name.lower() not in OPTIMIZERS:
        raise ValueError(f"optimizer.name must be one of {['keep'] + sorted(OPTIMIZERS)}, got {cfg_name!r}")
    name = cfg_name.lower()
    hp = _validated(name, dict(getattr(cfg, "hyperparameters", None) or {}), prefix="optimizer.")
    exclude = hp.pop("exclude_bias_and_norm", True)
    global_kw = {k: hp.pop(k) for k in _GLOBAL_KEYS if k in hp}

    if optimizer is None:
        if "lr" not in hp:
            raise ValueError(f"optimizer.lr is required for {name} when optimize() is given no optimizer "
                             f"(there is no learning rate to keep)")
        groups: List[Dict[str, Any]] = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    else:
        groups = [_carried_group(name, optimizer, g) for g in optimizer.param_groups]
        if any(optimizer.state.get(p) for g in optimizer.param_groups for p in g["params"]):
            warn(f"optimizer: {type(optimizer).__name__} already has state (moments, momentum); "
                 f"{name} starts from fresh state")
    # The strategy's explicit hyper-parameters win over carried ones, except that a user group with
    # weight_decay 0 beside groups with decay (the user's own no-decay list) keeps 0.
    keep_zero_decay = any(g.get("weight_decay", 0) for g in groups) and optimizer is not None
    for g in groups:
        zero = keep_zero_decay and not g.get("weight_decay", 0)
        g.update(hp)
        if zero:
            g["weight_decay"] = 0.0
    if exclude:
        excluded = excluded_parameters(model)
        excluded |= {id(p) for g in groups for p in g["params"] if p.ndim < 2}  # parameters outside the model
        groups = split_param_groups(groups, excluded)
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError(f"optimizer: no parameters to optimize with {name} (the model has none that requires grad)")
    # Every group carries its own lr (and the strategy's keys); the constructor defaults fill the rest.
    return OPTIMIZERS[name](groups, **{"lr": groups[0]["lr"], **hp, **global_kw})


def _carried_group(name: str, optimizer: torch.optim.Optimizer, group: Dict[str, Any]) -> Dict[str, Any]:
    """The part of one user param group that survives the swap (see the module docstring)."""
    user_hyper = set(getattr(optimizer, "defaults", {}))
    out: Dict[str, Any] = {"params": list(group["params"])}
    for key, value in group.items():
        if key == "params":
            continue
        if key in _CARRIED[name] or key == "initial_lr" or key not in user_hyper:
            out[key] = value
    if "betas" in out:
        out["betas"] = tuple(float(b) for b in out["betas"])
    if isinstance(out.get("lr"), torch.Tensor):
        out["lr"] = float(out["lr"])
    if name == "lars" and out.get("nesterov") and not out.get("momentum"):
        out.pop("nesterov")
    return out

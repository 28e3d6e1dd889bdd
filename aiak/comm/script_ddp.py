"""A script's own ``DistributedDataParallel(model, ...)`` line, run on the DDP that ``optimize()`` returned.

torchvision's and timm's reference scripts wrap the model in DDP themselves after building it. With the aiak line
before theirs, ``optimize()`` has already returned a DDP under torchrun, and their line would build a DDP of a
DDP: two reducers on the same parameters, so every gradient is all-reduced twice, and ``model.module`` is aiak's
DDP instead of the script's model (torchvision's EMA copy of it then fails: "cannot pickle '_thread.lock'").

So constructing a ``DistributedDataParallel`` whose module is a DDP that aiak built returns that DDP itself:
``DistributedDataParallel.__new__`` hands it back, and ``__init__``, which Python then runs on it, leaves it as
it is. The script's arguments are honoured where they can be: ``broadcast_buffers`` is set on it; the devices and
the process group must be the ones aiak used; settings of the buckets (``bucket_cap_mb``,
``gradient_as_bucket_view``) are the strategy's (logged); an argument that changes what DDP computes and cannot
be set on a built DDP (``static_graph=True``, ...) is an error saying to put the aiak line after the script's DDP
line (aiak then keeps the script's DDP and registers its hook on it); ``find_unused_parameters=True`` is accepted
when the strategy set ``comm.find_unused_parameters: true``, and otherwise the error names that key. Every
other construction of a DDP, subclasses included, runs as it always does. The two methods are the
``ddp-constructor`` patch of `aiak.runtime.patches`, installed with the first DDP aiak builds.
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Dict

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from aiak.runtime import patches
from aiak.runtime.marks import mark, marked

logger = logging.getLogger("aiak")

# Arguments of the script's DDP line that aiak's DDP takes as they are (the strategy chose its buckets).
_BUCKET_SETTINGS = ("bucket_cap_mb", "gradient_as_bucket_view", "init_sync", "check_reduction", "bucket_cap_mb_list")
_ORIGINAL_INIT = DistributedDataParallel.__init__
_SIGNATURE = inspect.signature(_ORIGINAL_INIT)


def mark_built_by_aiak(ddp: DistributedDataParallel) -> None:
    """``ddp`` is aiak's: a script's ``DistributedDataParallel(ddp, ...)`` line will return it (see the module
    docstring)."""
    mark(ddp, "_aiak_built", True)
    if not patches.installed("ddp-constructor"):
        patches.replace("ddp-constructor", DistributedDataParallel, "__new__", staticmethod(_new))
        patches.replace("ddp-constructor", DistributedDataParallel, "__init__", _init)


def _module_of(args, kwargs) -> Any:
    return args[0] if args else kwargs.get("module")


def _new(cls, *args, **kwargs):
    module = _module_of(args, kwargs)
    if cls is DistributedDataParallel and marked(module, "_aiak_built", False):
        _take_the_scripts_arguments(module, args, kwargs)
        return module
    return object.__new__(cls)


@functools.wraps(_ORIGINAL_INIT)
def _init(self, *args, **kwargs):
    if _module_of(args, kwargs) is self:  # __new__ handed back aiak's DDP: it is built already
        return
    _ORIGINAL_INIT(self, *args, **kwargs)


def _take_the_scripts_arguments(ddp: DistributedDataParallel, args, kwargs) -> None:
    given: Dict[str, Any] = dict(_SIGNATURE.bind(ddp, *args, **kwargs).arguments)
    given.pop("self"), given.pop("module")
    changed = {k: v for k, v in given.items() if v != _SIGNATURE.parameters[k].default}
    if "broadcast_buffers" in changed and changed["broadcast_buffers"] is not None:
        ddp.broadcast_buffers = bool(changed.pop("broadcast_buffers"))
    problems = []
    if changed.pop("device_ids", None) not in (None, ddp.device_ids):
        problems.append(f"device_ids={given['device_ids']} (aiak's DDP uses {ddp.device_ids})")
    if changed.pop("output_device", None) not in (None, ddp.output_device):
        problems.append(f"output_device={given['output_device']} (aiak's DDP uses {ddp.output_device})")
    group = changed.pop("process_group", None)
    if group is not None and group is not ddp.process_group and not (
            group is dist.group.WORLD and ddp.process_group is dist.distributed_c10d._get_default_group()):
        problems.append("process_group (aiak's DDP uses the default group)")
    if "find_unused_parameters" in changed and bool(changed["find_unused_parameters"]) == ddp.find_unused_parameters:
        changed.pop("find_unused_parameters")   # the strategy's comm.find_unused_parameters already says so
    kept = {k: changed.pop(k) for k in _BUCKET_SETTINGS if k in changed}
    problems += [f"{k}={v!r}" for k, v in changed.items()]
    if problems:
        unused = " Set comm.find_unused_parameters: true in the strategy for that argument." \
            if "find_unused_parameters" in changed else ""
        raise ValueError(
            "DistributedDataParallel(model, ...): the model is the DDP aiak.optimize() returned, and "
            f"{', '.join(problems)} cannot be applied to it.{unused} Or call aiak.optimize after your "
            "DistributedDataParallel line (aiak then keeps your DDP and registers its communication hook on it; "
            "comm algorithms other than allreduce need aiak's DDP), or drop the line")
    logger.info("aiak.comm: the script's DistributedDataParallel line returned aiak's DDP (one reducer, aiak's "
                "communication settings)%s", f"; its {', '.join(kept)} left to the strategy" if kept else "")

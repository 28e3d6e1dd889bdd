"""What aiak keeps on the user's objects (and on the classes it makes), declared once.

``aiak.optimize()`` changes objects in place rather than wrapping them, so what it must find again later lives on
the objects themselves: an optimizer's step controller, what was applied to a model, a module kept in fp32. Each
such attribute is a row of `MARKS` (what it holds, on which objects), and every read and write goes
through `mark`, `marked` and `unmark`, which refuse a name not declared here. The attribute
names are the ones aiak has always used: a checkpoint, a pickled model or a script may see them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict


@dataclass(frozen=True)
class Mark:
    """The attribute ``name`` that aiak sets ``on`` some objects, and what it ``holds``. ``own``: read from the
    object's own ``__dict__`` only, so that a wrapper forwarding its attribute reads to what it wraps
    (``torch.compile``'s ``OptimizedModule``) does not pass the mark on."""

    name: str
    holds: str
    on: str
    own: bool = False


MARKS: Dict[str, Mark] = {row.name: row for row in (
    Mark("_aiak_steps", "the StepController that owns its step() and zero_grad() (aiak.step.controller)",
         "an optimizer aiak steps"),
    Mark("_aiak_applied", "the ModelRecord of what optimize() applied (strategy, loss scaler, decision), which a "
                          "later optimize() of the same model keeps (aiak.api)",
         "a model optimize() was given (the module inside a DDP)"),
    Mark("_aiak_keep_fp32", "True: O2 computes the module and its subtree in fp32 (copies of the module carry it; "
                            "aiak.amp.fp32_modules)",
         "a module named by precision.keep_fp32, or whose forward had no half-precision kernel", own=True),
    Mark("_aiak_fp8", "(recipe, emulated, module path): the layer computes with torchao's float8 matmul "
                      "(aiak.amp.fp8)",
         "an nn.Linear precision.fp8 converted", own=True),
    Mark("_aiak_fp32_tried", "True: a module already ran its forward again in fp32 for this error (one retry per "
                             "error, however deep it was raised; aiak.amp.fp32_modules)",
         "an exception raised inside a half-precision region"),
    Mark("_aiak_original_class", "the class a module had before its class was swapped, which restore_class puts "
                                 "back (aiak.runtime.class_swap)",
         "the classes aiak.runtime.class_swap makes (Fused<Name> of module surgery, Float8<Name> of fp8)"),
    Mark("_aiak_built", "True: optimize() built this DDP, so a script's DistributedDataParallel(ddp) line returns it "
                        "(aiak.comm.script_ddp)",
         "a DistributedDataParallel"),
    Mark("_aiak_fused_step", "the fused and foreach settings of each param group, and of the defaults, as the script "
                             "set them, which its checkpoints keep (aiak.optim.fused_step)",
         "an optimizer optimizer.fused turned to torch's fused step"),
    Mark("_aiak_fused_step_loop", "the param groups this step runs in torch's loop, fused again after it "
                                  "(aiak.optim.fused_step)",
         "an SGD with momentum stepping fused, during a step where a parameter has its first gradient"),
    Mark("_aiak_callback_wrapped", "True: AiakCallback wrapped its configure_optimizers already, so a second fit "
                                   "does not wrap it again (aiak.integrations.lightning)",
         "a LightningModule"),
)}


def _declared(name: str) -> Mark:
    if name not in MARKS:
        raise KeyError(f"aiak: {name!r} is not a mark aiak puts on objects; the declared ones are {sorted(MARKS)}")
    return MARKS[name]


def mark(obj: Any, name: str, value: Any) -> None:
    """Put mark ``name`` on ``obj``, holding ``value``."""
    setattr(obj, _declared(name).name, value)


def marked(obj: Any, name: str, default: Any = None) -> Any:
    """What mark ``name`` holds on ``obj``, or ``default`` where it has none."""
    if _declared(name).own:
        return vars(obj).get(name, default) if hasattr(obj, "__dict__") else default
    return getattr(obj, name, default)


def unmark(obj: Any, name: str) -> None:
    """Take mark ``name`` off ``obj`` (nothing to do where it has none)."""
    _declared(name)
    if name in getattr(obj, "__dict__", {}):
        delattr(obj, name)

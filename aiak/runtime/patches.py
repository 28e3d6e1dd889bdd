"""Every function aiak replaces process-wide, declared once, and the one mechanism that replaces and puts back.

aiak leaves the script's own lines as they are (``loss.backward()``, ``torch.nn.utils.clip_grad_norm_(...)``,
``scheduler.step()``, ``DistributedDataParallel(model)``), so to act on them it replaces a few functions of torch
(and timm's adaptive clipping) for the whole process. `DECLARED` says, for each, what is replaced, when,
why, which module owns the replacement and what undoing it means. The owners install lazily, on first use, with
`replace` (or, for a global hook torch lets aiak register, `hook`); `patches`
(``aiak.patches()``) lists what is installed now, `undo`
(``aiak.undo_patches()``) puts torch's originals back.

`replace` records an attribute's original the first time it is replaced (a second replacement of the same
attribute, before an undo, keeps the first record), so an undo restores the true original, and an attribute
that a class only inherited is deleted again rather than set to the inherited value. It knows what it installed
(`is_replacement`), so an owner that installs again skips what is already its own: installing twice wraps
once.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple


@dataclass(frozen=True)
class DeclaredPatch:
    """One global patch aiak may install: ``key``, the dotted names it ``replaces`` (in words where the set is only
    known at run time), ``when`` it is installed, ``why`` (what the user gets from it), the module that ``owns``
    the replacement functions, and what ``undone`` puts back."""

    key: str
    replaces: str
    when: str
    why: str
    owner: str
    undone: str


DECLARED: Dict[str, DeclaredPatch] = {row.key: row for row in (
    DeclaredPatch(
        "backward-root",
        "torch.autograd.graph._engine_run_backward and torch.autograd._engine_run_backward",
        "when a model first computes in fp16 with aiak's loss scaling, or a step controller first counts items",
        "fp16 loss scaling and counted items act at the root of every backward pass, so the script's own "
        "loss.backward() needs no change",
        "aiak.amp.scaling.root_scaling",
        "torch's function back in both modules (also root_scaling.unwatch()): fp16 losses no longer scaled, "
        "counted items no longer weighed"),
    DeclaredPatch(
        "fp16-steps",
        "torch.optim.optimizer._global_optimizer_pre_hooks and _global_optimizer_post_hooks (a hook on every "
        "optimizer's step, through torch's register_optimizer_step_pre_hook and _post_hook)",
        "when a model first computes in fp16 with aiak's loss scaling",
        "an optimizer aiak was not given (a new one after unfreezing, a deep copy's, one per parameter stepped "
        "in the backward pass) skips a step whose gradients hold inf/NaN and backs the model's loss scale off, as "
        "GradScaler.step does",
        "aiak.amp.scaling.fp16_steps",
        "torch's optimizers without aiak's hooks: such an optimizer steps inf/NaN gradients into the weights"),
    DeclaredPatch(
        "grad-scaler",
        "torch.amp.GradScaler.scale and torch.amp.GradScaler.unscale_",
        "when a strategy first asks for fp16 loss scaling, or the first step controller is made",
        "a script's own GradScaler makes aiak's loss scaler stand aside (two scalers would multiply), and its "
        "unscale_ under aiak's grad_accumulation is refused with what to change",
        "aiak.amp.scaling.script_scaler",
        "torch's methods back: a script's GradScaler and aiak's loss scaler no longer know of each other"),
    DeclaredPatch(
        "clip",
        "clip_grad_norm_, clip_grad_value_, get_total_norm, clip_grads_with_norm_ of torch.nn.utils and "
        "torch.nn.utils.clip_grad, with the helpers clip_grad.py looks up at call time (_get_total_norm, "
        "_clip_grads_with_norm_, _group_tensors_by_device_and_dtype), and timm's adaptive_clip_grad where timm is "
        "imported by then",
        "when the first step controller is made (optimize() with an optimizer aiak steps)",
        "the script's unchanged clipping call clips the real step's true gradient (the accumulation window's "
        "average, unscaled), not a micro-step's partial sum",
        "aiak.step.clip",
        "torch's and timm's functions back, and the step controllers forgotten: clip calls are no longer routed"),
    DeclaredPatch(
        "schedulers",
        "step of torch.optim.lr_scheduler.LRScheduler and of every subclass defining its own (and of the class of a "
        "scheduler given to optimize())",
        "at the first optimize() with grad_accumulation > 1, or with a scheduler= whose optimizer aiak steps",
        "a scheduler the script steps after every optimizer.step() advances once per real step, not on "
        "accumulation micro-steps",
        "aiak.step.scheduler_steps",
        "each class's own step back: schedulers step on every call again"),
    DeclaredPatch(
        "ddp-constructor",
        "torch.nn.parallel.DistributedDataParallel.__new__ and __init__",
        "when optimize() first wraps a model in DDP (a process group of more than one rank)",
        "a script's own DistributedDataParallel(model) line after the aiak line returns aiak's DDP instead of a "
        "DDP of a DDP (every gradient all-reduced twice)",
        "aiak.comm.script_ddp",
        "DDP's constructor back (its __new__ inherited again): such a line builds a DDP of the DDP, as torch does"),
    DeclaredPatch(
        "deadlock-guard",
        "the collectives of torch.distributed named in aiak.comm.diagnostics.deadlock.GUARDED (all_reduce, "
        "broadcast, all_gather, barrier, ...)",
        "only while the debug deadlock guard is on (comm.deadlock_guard: true, aiak.comm.enable_deadlock_guard)",
        "the ranks compare each collective before running it, so a mismatch raises naming it instead of hanging",
        "aiak.comm.diagnostics.deadlock",
        "torch.distributed's functions back (also aiak.comm.disable_deadlock_guard())"),
)}


@dataclass(frozen=True)
class Patch:
    """A global patch installed in this process: its ``key`` (a row of `DECLARED`), the dotted ``targets``
    replaced, ``why``, and the module that holds the replacements (``owner``)."""

    key: str
    targets: Tuple[str, ...]
    why: str
    owner: str

    def __str__(self) -> str:
        return f"{self.key}: {', '.join(self.targets)} replaced by {self.owner} ({self.why})"


@dataclass
class _Hook:
    target: str       # what the hook is on, in words
    handle: Any       # torch's RemovableHandle of the hook


@dataclass
class _Replaced:
    holder: Any       # the module or class whose attribute was replaced
    attribute: str
    original: Any     # the holder's own value before aiak's first replacement, or _ABSENT (inherited, or none)
    value: Any        # what aiak put there


_ABSENT = object()
_lock = threading.RLock()
_replaced: Dict[str, List[_Replaced]] = {}       # key -> its replacements, keys in install order
_resets: Dict[str, List[Callable[[], None]]] = {}  # key -> what its owner forgets when it is undone


def _declared(key: str) -> DeclaredPatch:
    if key not in DECLARED:
        raise KeyError(f"aiak: no global patch is declared as {key!r}; the declared ones are {sorted(DECLARED)}")
    return DECLARED[key]


def replace(key: str, holder: Any, attribute: str, value: Any) -> Any:
    """Set ``holder.attribute`` (a module's function, a class's method) to ``value`` as part of patch ``key``;
    returns the original it had before aiak first replaced it (as stored in the holder, None if it only inherited
    one)."""
    _declared(key)
    with _lock:
        record = next((r for records in _replaced.values() for r in records
                       if isinstance(r, _Replaced) and r.holder is holder and r.attribute == attribute), None)
        if record is None:
            record = _Replaced(holder, attribute, vars(holder).get(attribute, _ABSENT), value)
            _replaced.setdefault(key, []).append(record)
        record.value = value
        setattr(holder, attribute, value)
        return None if record.original is _ABSENT else record.original


def hook(key: str, target: str, handle: Any) -> None:
    """Record a global hook torch lets aiak register (``handle``, torch's ``RemovableHandle``; ``target``, what it is
    on) as part of patch ``key``: listed with the patch, removed by its undo."""
    _declared(key)
    with _lock:
        _replaced.setdefault(key, []).append(_Hook(target, handle))


def on_undo(key: str, reset: Callable[[], None]) -> None:
    """Call ``reset`` when patch ``key`` is undone: what its owner kept while installed (the routed optimizers, a
    cached original) is forgotten, so a later install starts afresh. Registered by each install."""
    _declared(key)
    with _lock:
        resets = _resets.setdefault(key, [])
        if reset not in resets:
            resets.append(reset)


def installed(key: str) -> bool:
    """Patch ``key`` is installed in this process."""
    _declared(key)
    return bool(_replaced.get(key))


def is_replacement(value: Any) -> bool:
    """``value`` is one that `replace` put in place and no undo has taken back."""
    with _lock:
        return any(isinstance(r, _Replaced) and r.value is value for records in _replaced.values() for r in records)


def undo(key: Optional[str] = None) -> None:
    """Put back every original of patch ``key`` (of every patch when None), the last replaced first, and call
    what their owners registered with `on_undo`."""
    if key is not None:
        _declared(key)
    with _lock:
        keys = [key] if key is not None else list(_replaced)[::-1]
        resets = []
        for k in keys:
            for record in reversed(_replaced.pop(k, [])):
                if isinstance(record, _Hook):
                    record.handle.remove()
                elif record.original is _ABSENT:
                    if record.attribute in vars(record.holder):
                        delattr(record.holder, record.attribute)
                else:
                    setattr(record.holder, record.attribute, record.original)
            resets += _resets.pop(k, [])
    for reset in resets:
        reset()


def patches() -> List[Patch]:
    """The global patches of torch aiak installed in this process, in the order they were installed.

    To reach a script's unchanged lines (its clip call, its scheduler, its `loss.backward()`), aiak replaces a few of
    torch's functions for the whole process, each on first need; this says which, so nothing is hidden. Every patch
    aiak may install, with when, is `DECLARED` (`aiak doctor` lists them).

    Returns:
        One `Patch` per installed patch (none until the first `aiak.optimize()` needs one): its `key`
            (`"backward-root"`, `"fp16-steps"`, `"grad-scaler"`, `"clip"`, `"schedulers"`, `"ddp-constructor"`,
            `"deadlock-guard"`), the dotted `targets` it replaced, `why`, and the module that holds the
            replacements (`owner`); `str()` of one is a line saying all that.
    """
    with _lock:
        return [Patch(key, tuple(r.target if isinstance(r, _Hook) else _dotted(r.holder, r.attribute)
                                 for r in records), DECLARED[key].why,
                      DECLARED[key].owner) for key, records in _replaced.items()]


def undo_patches() -> None:
    """Undo every global patch aiak installed in this process, putting torch's own functions back.

    For tests and notebooks that want plain torch again. Objects `aiak.optimize()` returned before then run with
    torch's functions: a `clip_grad_norm_` call on their parameters is no longer routed to the real step (it clips a
    micro-step's partial sum under accumulation), their schedulers are no longer gated (they advance on every
    `scheduler.step()`), and fp16 models' losses are no longer loss-scaled at the backward pass. The next
    `aiak.optimize()` installs what it needs again; [aiak.patches][aiak.runtime.patches.patches] says what is
    installed.
    """
    undo()


def _dotted(holder: Any, attribute: str) -> str:
    if isinstance(holder, type):
        return f"{holder.__module__}.{holder.__qualname__}.{attribute}"
    return f"{getattr(holder, '__name__', type(holder).__name__)}.{attribute}"

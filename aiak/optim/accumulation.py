"""The step controller: gradient accumulation and mixed-precision stepping behind a plain ``optimizer.step()``.

``aiak.optimize`` patches the user's optimizer *in place* (the same object comes back, so ``isinstance``
checks and schedulers built earlier keep working). Its ``step()`` then:

1. counts micro-steps and really steps only on every ``accumulation``-th call (the gradient average over
   micro-batches comes from the output hook's ``1/accumulation`` factor, see ``aiak.amp.precision``);
   under DDP, gradients are synchronised only on the last micro-step (``no_sync`` semantics);
2. moves half gradients to the fp32 master weights (O2), unscales them and checks for inf/NaN (fp16);
   an overflowing step is skipped: weights and optimizer state unchanged, the loss scale reduced;
3. runs the real optimizer step, copies masters back to the model, and clears the gradients.

``zero_grad()`` is a no-op inside an accumulation window. Gradient clipping goes through
:func:`clip_grad_norm_` (or ``optimizer._aiak_steps.clip_grad_norm_``), which clips the true, unscaled
gradient of the real step and does nothing on micro-steps. ``state_dict()`` carries the master weights, the
loss-scaler state and the micro-step counter, so a resumed run continues bit-identically.
"""
from __future__ import annotations

import logging
import types
import warnings
from typing import Any, Dict, Optional

import torch

from aiak.amp.loss_scaler import LossScaler
from aiak.amp.precision import MasterWeights

logger = logging.getLogger("aiak")


def _patched_zero_grad(optimizer, set_to_none: bool = True):
    return optimizer._aiak_steps.zero_grad(set_to_none)


def _make_patched_step(inner):
    """A plain function bound to the optimizer, as torch's LR schedulers expect ``optimizer.step`` to be."""

    def step(optimizer, closure=None):
        return optimizer._aiak_steps.step(closure)

    if getattr(inner, "_wrapped_by_lr_sched", False):
        step._wrapped_by_lr_sched = True  # a scheduler built earlier wrapped it; we call that wrapper on real steps
    return step


class StepController:
    """Owns ``step``/``zero_grad`` of one optimizer. Attached as ``optimizer._aiak_steps``."""

    def __init__(self, optimizer: torch.optim.Optimizer, accumulation: int = 1,
                 scaler: Optional[LossScaler] = None, master: Optional[MasterWeights] = None):
        if accumulation < 1:
            raise ValueError(f"grad_accumulation must be >= 1, got {accumulation}")
        if getattr(optimizer, "_aiak_steps", None) is not None:
            raise RuntimeError("this optimizer was already passed through aiak.optimize(); pass the original one")
        self.optimizer = optimizer
        self.accumulation = accumulation
        self.scaler = scaler
        self.master = master
        self.micro_step = 0          # micro-steps taken since the last real step
        self.step_events = 0         # real or skipped steps (what a scheduler counts)
        self._events_at_scheduler = 0
        self.ddp = None
        self._inner_step = optimizer.step
        self._inner_zero_grad = optimizer.zero_grad
        optimizer._aiak_steps = self
        optimizer.step = types.MethodType(_make_patched_step(self._inner_step), optimizer)
        optimizer.zero_grad = types.MethodType(_patched_zero_grad, optimizer)
        optimizer.register_state_dict_post_hook(self._save_extra)
        optimizer.register_load_state_dict_pre_hook(self._take_extra)
        optimizer.register_load_state_dict_post_hook(self._restore_extra)
        self._pending_extra: Optional[Dict[str, Any]] = None
        self._prepared: Optional[bool] = None  # gradients already moved/unscaled for the coming step (inf found?)

    # -- what the output hook multiplies incoming gradients by -------------------------------
    def grad_factor(self) -> float:
        scale = self.scaler.scale if self.scaler is not None else 1.0
        return scale / self.accumulation

    # -- DDP no_sync ------------------------------------------------------------------------
    def attach_ddp(self, ddp_model) -> None:
        """Gradients of ``ddp_model`` are allreduced only on the last micro-step of each window."""
        self.ddp = ddp_model
        self._set_sync()

    def _set_sync(self) -> None:
        if self.ddp is not None:
            self.ddp.require_backward_grad_sync = (self.micro_step == self.accumulation - 1)

    # -- the patched methods ------------------------------------------------------------------
    def step(self, closure=None):
        if closure is not None and (self.master is not None or self.scaler is not None or self.accumulation > 1):
            raise RuntimeError("optimizer.step(closure) is not supported with aiak's gradient accumulation or "
                               "mixed precision (set grad_accumulation: 1 and precision.level: O0)")
        self.micro_step += 1
        if self.micro_step < self.accumulation:
            self._set_sync()
            return None
        self.micro_step = 0
        self._set_sync()
        self.step_events += 1

        found_inf = self._prepare_grads()
        self._prepared = None
        if self.scaler is not None:
            self.scaler.update(found_inf)
            if found_inf:
                logger.info("aiak: inf/NaN gradients, step skipped; loss scale now %g", self.scaler.scale)
                self._clear_grads()
                return None
        loss = self._inner_step()
        if self.master is not None:
            self.master.master_to_model()
        self._clear_grads()
        return loss

    def _prepare_grads(self) -> bool:
        """Half gradients to the fp32 masters, then unscaled; True if any is inf/NaN. Once per real step."""
        if self._prepared is None:
            if self.master is not None:
                self.master.grads_to_master()
            found_inf = False
            if self.scaler is not None:
                found_inf = self.scaler.unscale_(p.grad for g in self.optimizer.param_groups for p in g["params"])
            self._prepared = found_inf
        return self._prepared

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Optional[torch.Tensor]:
        """Clip the gradients the coming real step will use (fp32 masters, unscaled); None on micro-steps.

        Call it where plain PyTorch clips, between ``backward()`` and ``step()``: on accumulation micro-steps
        it does nothing (the gradient is still a partial sum); before a real step it moves and unscales the
        gradients first, so the norm is the true one. An inf/NaN norm is left to ``step()``, which skips.
        """
        if self.micro_step + 1 < self.accumulation:
            return None
        found_inf = self._prepare_grads()
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if found_inf:
            return torch.tensor(float("inf"))
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.micro_step != 0:
            return  # inside an accumulation window: the gradients are being summed
        self._clear_grads(set_to_none)

    def _clear_grads(self, set_to_none: bool = True) -> None:
        self._prepared = None
        self._inner_zero_grad(set_to_none=set_to_none)
        if self.master is not None:
            self.master.clear_model_grads()

    # -- scheduler: advance once per real step -------------------------------------------------
    def attach_scheduler(self, scheduler) -> None:
        """``scheduler.step()`` does nothing unless the optimizer stepped since the scheduler last did.

        Done by giving the scheduler a subclass of its own class (so ``isinstance`` and ``state_dict()``, which
        saves the instance ``__dict__``, are unchanged) whose ``step`` consults this controller.
        """
        controller, base = self, type(scheduler)

        def step(sched, *args, **kwargs):
            if controller.step_events == controller._events_at_scheduler:
                return None  # no optimizer step since the last scheduler step (accumulation micro-step)
            controller._events_at_scheduler = controller.step_events
            return base.step(sched, *args, **kwargs)

        scheduler.__class__ = type(base.__name__, (base,), {"step": step, "__module__": base.__module__,
                                                           "__doc__": base.__doc__})

    # -- checkpoints ----------------------------------------------------------------------------
    def _save_extra(self, optimizer, state_dict):
        if self.micro_step != 0:
            warnings.warn(f"aiak: optimizer.state_dict() taken {self.micro_step} micro-step(s) into a "
                          f"{self.accumulation}-step accumulation window: the partial gradients are not saved; "
                          "save right after a real step to resume exactly")
        extra: Dict[str, Any] = {"micro_step": self.micro_step, "step_events": self.step_events}
        if self.scaler is not None:
            extra["loss_scaler"] = self.scaler.state_dict()
        if self.master is not None:
            extra["master_weights"] = [m.detach().clone() for _, m in self.master.pairs]
        state_dict["aiak"] = extra
        return state_dict

    def _take_extra(self, optimizer, state_dict):
        state_dict = dict(state_dict)
        self._pending_extra = state_dict.pop("aiak", None)
        return state_dict

    def _restore_extra(self, optimizer) -> None:
        extra, self._pending_extra = self._pending_extra, None
        if extra is None:
            return
        self.micro_step = int(extra.get("micro_step", 0))
        self.step_events = self._events_at_scheduler = int(extra.get("step_events", 0))
        if self.scaler is not None and "loss_scaler" in extra:
            self.scaler.load_state_dict(extra["loss_scaler"])
        if self.master is not None and "master_weights" in extra:
            saved = extra["master_weights"]
            if len(saved) != len(self.master.pairs):
                raise ValueError(f"checkpoint holds {len(saved)} master weights, this optimizer has "
                                 f"{len(self.master.pairs)}")
            with torch.no_grad():
                for (_, m), value in zip(self.master.pairs, saved):
                    m.copy_(value)
            self.master.master_to_model()
        self._set_sync()


def clip_grad_norm_(optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0):
    """``torch.nn.utils.clip_grad_norm_`` over ``optimizer``'s parameters that is right under aiak.

    With loss scaling the model's gradients are scaled, with O2 the step uses fp32 master copies, with
    accumulation they are partial sums until the last micro-step: this clips what the real step will use
    and returns its norm (None on a micro-step). On an optimizer aiak did not patch it is the plain clip.
    """
    controller = getattr(optimizer, "_aiak_steps", None)
    if controller is not None:
        return controller.clip_grad_norm_(max_norm, norm_type)
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

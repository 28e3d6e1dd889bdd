"""The step controller: gradient accumulation and mixed-precision stepping behind a plain ``optimizer.step()``.

``aiak.optimize`` patches the user's optimizer *in place* (the same object comes back, so ``isinstance``
checks and schedulers built earlier keep working). Its ``step()`` then:

1. counts micro-steps and really steps only on every ``accumulation``-th call, or on the call that trains an
   epoch's last batch (the loader ``optimize`` returned reports what it hands out, `aiak.step.loader_steps`; a
   framework's integration calls `StepController.close_window`); under DDP, gradients are
   synchronised only on the last micro-step (``no_sync`` semantics);
2. on the real step, divides the summed gradients by the window's micro-steps, or by its counted items summed over
   the ranks (`count_items`, `aiak.step.window_items`; they are the model's fp32 parameters'
   own gradients under every precision, summed in fp32) and, under fp16 loss scaling, checks them for inf/NaN
   in the same fused pass (`aiak.amp.scaling.root_scaling` has already unscaled them during the backward); an
   overflowing step is skipped: weights and optimizer state unchanged, the loss scale reduced;
3. runs the real optimizer step and clears the gradients.

``step(closure)`` (how Lightning always steps) runs the closure with grad enabled (it does the forward and
backward), then the controlled step, and returns the closure's loss, on micro-steps too.

``zero_grad()`` is a no-op inside an accumulation window, and the partial sum survives a framework that
clears gradients itself: Hugging Face's ``Trainer`` calls ``model.zero_grad()`` after each of its steps, which
sets every ``.grad`` to None. Each micro-step keeps a reference to the gradients it leaves (no copy); a hook on
each parameter, run by autograd right after the next backward accumulated into ``.grad`` (and before DDP's
reducer reads it), adds the kept sum back when the gradient was started anew, and refuses to go on when it was
zeroed in place. A framework that accumulates gradients itself (Lightning's ``accumulate_grad_batches``,
Accelerate's and the Trainer's ``gradient_accumulation_steps``) wins over ``grad_accumulation``, with one
warning (`aiak.step.stacking`), so the two never multiply. Gradient clipping is implemented here
once (`StepController.clip_grad_norm_`, `StepController.clip_grad_value_`): it clips the true
gradient of the real step and nothing on micro-steps. The user's unchanged
``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` / ``clip_grad_value_`` reach it through
`aiak.step.clip`; `clip_grad_norm_` / `clip_grad_value_` here take the optimizer.
``state_dict()`` carries the loss-scaler state and the micro-step counter, so a resumed run continues
bit-identically.
"""
from __future__ import annotations

import io
import logging
import types
import weakref
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from aiak.amp.scaling import root_scaling, script_scaler
from aiak.amp.scaling.loss_scaler import LossScaler
from aiak.step import clip as grad_clip
from aiak.step import scheduler_steps
from aiak.step.loader_steps import LoaderSteps
from aiak.step.stacking import framework_accumulation
from aiak.step.window_items import WindowItems, at_least_one
from aiak.runtime.callers import DCP_STATE_DICT, called_from
from aiak.util.dist import is_distributed, process_group_exists, world_size
from aiak.runtime.marks import mark, marked
from aiak.util.warn import warn, warn_once

logger = logging.getLogger("aiak")


def _patched_zero_grad(optimizer, set_to_none: bool = True):
    return marked(optimizer, "_aiak_steps").zero_grad(set_to_none)


def _make_patched_step(inner):
    """A plain function bound to the optimizer, as torch's LR schedulers expect ``optimizer.step`` to be."""

    def step(optimizer, closure=None):
        return marked(optimizer, "_aiak_steps").step(closure)

    if getattr(inner, "_wrapped_by_lr_sched", False):
        step._wrapped_by_lr_sched = True  # a scheduler built earlier wrapped it; we call that wrapper on real steps
    return step


class _AfterAccumulation:
    """The hook autograd runs on a parameter right after a backward accumulated into its ``.grad``: hands the
    parameter to its step controller (copies of the model never carry it). The controller is held weakly: the
    parameter keeps its hooks on the C++ side, where the garbage collector cannot see a cycle (parameter ->
    hook -> controller -> DDP -> parameter); a strong reference left DDP's reducer to interpreter shutdown, where
    gloo ranks can abort ("terminate called without an active exception")."""

    __slots__ = ("controller", "leaf")

    def __init__(self, controller: "StepController", leaf: bool = False):
        self.controller = weakref.ref(controller)
        self.leaf = leaf  # an FSDP2 unsharded parameter (aiak.comm.sharded): its pass is counted, nothing kept

    def __call__(self, param: torch.Tensor) -> None:
        controller = self.controller()
        if controller is not None and controller.active():
            if self.leaf:
                controller.after_leaf_accumulation(param)
            else:
                controller.after_accumulation(param)


_eager_steps = False


def _run_eagerly_under_torch_compile() -> None:
    """A script that compiles its whole train step (forward, ``loss.backward()``, ``optimizer.step()``) has dynamo
    meet the controller's ``step`` and ``zero_grad``: traced, their bookkeeping (counters, the overflow check's
    ``.item()``) cut the step into a graph per branch. They run eagerly instead, as torch's ``GradScaler.step`` does
    under dynamo. Done once, at the first controller, because ``torch.compiler.disable`` imports ``torch._dynamo``
    (heavy for ``import aiak``)."""
    global _eager_steps
    if not _eager_steps:
        _eager_steps = True
        StepController.step = torch.compiler.disable(StepController.step, reason="aiak's step controller")
        StepController.zero_grad = torch.compiler.disable(StepController.zero_grad, reason="aiak's step controller")


class StepController:
    """Owns ``step``/``zero_grad`` of one optimizer. Attached as ``optimizer._aiak_steps``."""

    def __init__(self, optimizer: torch.optim.Optimizer, accumulation: int = 1,
                 scaler: Optional[LossScaler] = None, model: Optional[torch.nn.Module] = None):
        if accumulation < 1:
            raise ValueError(f"grad_accumulation must be >= 1, got {accumulation}")
        if marked(optimizer, "_aiak_steps") is not None:
            raise RuntimeError("this optimizer was already passed through aiak.optimize(); pass the original one")
        self.optimizer = optimizer
        self.accumulation = accumulation
        self.requested_accumulation = accumulation  # before a framework's own accumulation took over
        self._framework_checked = accumulation == 1
        self._model = model
        self._partial: Dict[int, Tuple[torch.Tensor, torch.Tensor, int]] = {}  # id(param) -> (param, its grad, version)
        self._after_backward: Dict[int, Tuple[torch.Tensor, int]] = {}  # id(param) -> (its grad, version) after backward
        self._backward_passes = 0    # the most backward passes any parameter got since the last step() call
        self._hooked: set = set()    # ids of the parameters carrying an _AfterAccumulation hook
        self._hook = _AfterAccumulation(self)
        self._leaves: List[torch.Tensor] = []  # what autograd accumulates into in place of the parameters (FSDP2)
        self._leaf_passes: Dict[int, int] = {}  # id(leaf) -> backward passes since the last step() call
        self._params: List[torch.Tensor] = []
        self._params_for: Optional[tuple] = None
        self.scaler = scaler
        self.micro_step = 0          # micro-steps taken since the last real step
        self.stepped = False         # the last step() call updated the weights (see `stepped`)
        self._unsaved_windows = 0    # state_dict() calls taken inside a window (their warning is rate-limited)
        self.step_calls = 0          # step() calls: micro, real and skipped steps
        self.step_events = 0         # real or skipped steps (what a scheduler counts)
        self.ddp = None
        self.comm_algorithm = None   # a synchronisation that runs at real steps (see attach_comm_algorithm)
        self.comm_state = None       # the DDP hook's state kept across steps (see attach_comm_state)
        self.items = WindowItems()   # counted items of the window (see count_items)
        self._counting = False       # the parameters are registered for item weights (root_scaling.weigh)
        self._closing = False        # the coming step() closes the window: the epoch's last batch
        self._framework_closing = False  # a framework said so (close_window)
        self.loader_steps: Optional[LoaderSteps] = None  # the returned loader's batches, followed to the steps
        self.sees_epoch_ends = False  # a loader aiak returned, or a framework, tells where epochs end
        self._inner_step = optimizer.step
        self._inner_zero_grad = optimizer.zero_grad
        _run_eagerly_under_torch_compile()
        mark(optimizer, "_aiak_steps", self)
        optimizer.step = types.MethodType(_make_patched_step(self._inner_step), optimizer)
        optimizer.zero_grad = types.MethodType(_patched_zero_grad, optimizer)
        optimizer.register_state_dict_post_hook(self._save_extra)
        optimizer.register_load_state_dict_pre_hook(self._take_extra)
        optimizer.register_load_state_dict_post_hook(self._restore_extra)
        self._pending_extra: Optional[Dict[str, Any]] = None
        self._prepared: Optional[bool] = None  # gradients already averaged/checked for the coming step (inf found?)
        grad_clip.route_to(self)  # torch.nn.utils.clip_grad_norm_ & co. on these parameters come here
        script_scaler.watch()     # a script's own GradScaler under accumulation is refused with the reason
        if accumulation > 1:
            scheduler_steps.gate_scheduler_classes()  # schedulers advance once per real step
        self._params_of_groups()

    # -- the parameters, and the hooks that keep a window's partial sum -------------------------------
    def _params_of_groups(self) -> List[torch.Tensor]:
        """The optimizer's parameters, rebuilt when its groups change (a group added later gets the hooks too)."""
        groups = tuple((id(g["params"]), len(g["params"])) for g in self.optimizer.param_groups)
        if self._params_for != groups:
            self._params = [p for g in self.optimizer.param_groups for p in g["params"]]
            self._params_for = groups
            if self._counting:
                root_scaling.weigh(self._params, self)
            if self.accumulation > 1 or not self._framework_checked:
                for p in self._params:
                    if id(p) not in self._hooked and p.requires_grad:
                        p.register_post_accumulate_grad_hook(self._hook)
                        self._hooked.add(id(p))
        return self._params

    def after_accumulation(self, param: torch.Tensor) -> None:
        """A backward just accumulated into ``param.grad``: the first of the window asks whether a framework
        accumulates too; a gradient started anew (a framework's ``model.zero_grad()``) gets the kept sum back."""
        self._check_framework_accumulation()
        kept = self._partial.pop(id(param), None)
        if kept is not None:
            _, grad, version = kept
            if param.grad is grad:
                if grad._version > version + 1 and not grad.is_sparse:  # zeroed in place, then accumulated into
                    raise RuntimeError(
                        f"aiak: a gradient was modified in place inside a {self.accumulation}-step accumulation "
                        "window (zero_grad(set_to_none=False) on the model?): the micro-batches summed so far are "
                        "lost. Clear gradients with optimizer.zero_grad() (aiak keeps the sum) or set_to_none=True, "
                        "or let the framework accumulate and set grad_accumulation: 1")
            elif param.grad is not None and param.grad.grad_fn is None:  # cleared to None, then started anew
                with torch.no_grad():
                    param.grad.add_(grad)
        seen = self._after_backward.get(id(param))
        passes = seen[2] + 1 if seen is not None else 1
        grad = param.grad
        self._after_backward[id(param)] = (grad, grad._version if grad is not None else 0, passes)
        self._backward_passes = max(self._backward_passes, passes)

    def after_leaf_accumulation(self, leaf: torch.Tensor) -> None:
        """A backward accumulated into an FSDP2 unsharded parameter (micro-steps keep their gradients there): its
        pass counted, as `after_accumulation` counts a parameter's, holding no reference to the gradient."""
        self._check_framework_accumulation()
        passes = self._leaf_passes[id(leaf)] = self._leaf_passes.get(id(leaf), 0) + 1
        self._backward_passes = max(self._backward_passes, passes)

    def _check_the_scripts_loop(self) -> None:
        """At each ``step()``, before aiak touches a gradient: several backward passes since the last ``step()``
        (the script accumulates too), or a gradient changed in place since its backward on a micro-step (a clip
        function aiak does not route saw a partial sum). Each is said once."""
        self._check_the_scripts_accumulation()
        if self.accumulation > 1 and self._backward_passes > 1:  # seen after the first step: too late to give way
            passes = self._backward_passes
            warn_once("script-accumulation",
                      f"aiak: {passes} backward passes between optimizer.step() calls. If the script accumulates "
                      "gradients itself (timm's --grad-accum-steps, an `if (i + 1) % k == 0: optimizer.step()` "
                      f"loop), aiak's grad_accumulation: {self.accumulation} multiplies with it: a real step every "
                      f"{passes * self.accumulation} batches. Set only one of them (grad_accumulation: 1 in the "
                      "strategy, or 1 in the script)")
        if self.accumulation > 1 and self.micro_step + 1 < self.accumulation and not self._closing:
            for p in self._params_of_groups():
                seen = self._after_backward.get(id(p))
                if seen is not None and p.grad is seen[0] and p.grad is not None and p.grad._version != seen[1]:
                    warn_once("grad-edited-in-window",
                              f"aiak: a gradient was changed in place between backward() and step() inside a "
                              f"{self.accumulation}-step accumulation window: a clipping function aiak does not "
                              "route (bound by name before aiak.optimize(), or of a library aiak does not know) saw "
                              "a partial sum. Clip with torch.nn.utils.clip_grad_norm_ / clip_grad_value_ or "
                              "aiak.clip_grad_norm_(optimizer, max_norm), which clip the real step's gradient; or "
                              "import the function after aiak.optimize()")
                    break
        self._after_backward, self._leaf_passes = {}, {}
        self._backward_passes = 0

    def _keep_partial_sum(self) -> None:
        self._partial = {id(p): (p, p.grad, p.grad._version) for p in self._params_of_groups() if p.grad is not None}

    def _restore_partial_sum(self) -> None:
        """Give back kept sums of parameters no backward reached since (their hook did not run)."""
        partial, self._partial = self._partial, {}
        for p, grad, _ in partial.values():
            if p.grad is None:
                p.grad = grad
            elif p.grad is not grad:
                with torch.no_grad():
                    p.grad.add_(grad)

    def _check_framework_accumulation(self) -> None:
        """Once, at the first backward: if a framework accumulates gradients itself, it wins."""
        if self._framework_checked:
            return
        self._framework_checked = True
        found = framework_accumulation(self._model)
        if found is None or self.micro_step != 0:
            return
        where, steps = found
        self.accumulation = 1
        self._set_sync()
        product = f"{steps * self.requested_accumulation} micro-batches" if steps else "their product"
        warn_once("stacked-accumulation",
                  f"aiak: {where}{f' = {steps}' if steps else ''} already accumulates gradients, so aiak's "
                  f"grad_accumulation: {self.requested_accumulation} is off (the two would multiply to {product} per "
                  "step). The framework's accumulation wins; set only one of them.")

    def _check_the_scripts_accumulation(self) -> None:
        """Before the first step reads a gradient (``step()``, or a clip routed here just before it): several
        backward passes so far mean the script accumulates itself, and nothing of aiak's window is lost yet."""
        if self.step_calls == 0 and self.accumulation > 1 and self._backward_passes > 1:
            self._give_way_to_the_scripts_accumulation(self._backward_passes)

    def _give_way_to_the_scripts_accumulation(self, passes: int) -> None:
        """Several backward passes before the first ``step()``: the script accumulates gradients itself, so aiak's
        accumulation is turned off (as for a framework's). Under DDP those passes ran inside aiak's window, without
        the allreduce the script's last one would have had: the gradients are averaged over the ranks now, once."""
        requested, self.accumulation = self.accumulation, 1
        self._set_sync()
        self._average_over_ranks()
        warn_once("script-accumulation",
                  f"aiak: {passes} backward passes before the first optimizer.step(): the script accumulates "
                  "gradients itself (timm's --grad-accum-steps, an `if (i + 1) % k == 0: optimizer.step()` loop), so "
                  f"aiak's grad_accumulation: {requested} is off (the two would multiply to a real step every "
                  f"{passes * requested} batches). The script's accumulation wins; set only one of them (to keep "
                  "aiak's with several losses per batch, add them and call backward() once)")

    def _average_over_ranks(self) -> None:
        """Average the gradients once, here, over the ranks the DDP model's hook averages over: passes that ran without
        DDP's allreduce (the script's own accumulation found late, a window whose end moved after its last
        backward)."""
        if self.ddp is None:
            return
        if getattr(self.ddp, "cannot_average_later", None):  # FSDP2 (aiak.comm.sharded)
            raise RuntimeError(
                f"aiak: {self.ddp.cannot_average_later}. That happens when the script accumulates gradients itself "
                f"beside grad_accumulation: {self.requested_accumulation} (set only one of them), or when an epoch "
                "ended before the loader's last batch (let each epoch run to its end, or set grad_accumulation: 1)")
        import torch.distributed as dist

        group, state = self.ddp.process_group, self.comm_state
        if state is not None:  # the ranks aiak's hook averages over (a node for local SGD, none for decentralized)
            if state.scope_size() == 1:
                return
            if state.scope == "node":
                group = state.groups.intra
        grads = [p.grad for p in self._params_of_groups() if p.grad is not None and not p.grad.is_sparse]
        if grads:
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=group)
            flat.div_(dist.get_world_size(group))
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)

    # -- DDP no_sync ------------------------------------------------------------------------
    def attach_ddp(self, ddp_model) -> None:
        """Gradients of ``ddp_model`` are allreduced only on the last micro-step of each window. ``ddp_model``
        may be `aiak.comm.sharded.FSDPSync`: FSDP2 reduce-scatters only then, and the unsharded parameters it
        makes at its first forward get this controller's pass counting and item weights."""
        self.ddp = ddp_model
        if hasattr(ddp_model, "when_leaves_appear"):
            ddp_model.when_leaves_appear(self._leaves_appeared)
        self._set_sync()

    def _leaves_appeared(self, leaves: List[torch.Tensor]) -> None:
        self._leaves.extend(leaves)
        if self.accumulation > 1 or not self._framework_checked:
            leaf_hook = _AfterAccumulation(self, leaf=True)
            for t in leaves:
                if t.requires_grad:
                    t.register_post_accumulate_grad_hook(leaf_hook)
        if self._counting:
            root_scaling.weigh(leaves, self)

    def attach_comm_algorithm(self, algorithm) -> None:
        """The comm algorithm of the DDP model whose steps this controller takes, one that acts at real steps or keeps
        state across them (`aiak.comm.algorithms.base.CommAlgorithm` with ``steps_with_optimizer``):
        ``at_real_step()`` is called at each real step before the loss scaler's verdict and the update,
        ``after_real_step(updated)`` after the update, or the skip, and its ``state_dict()`` / ``load_state_dict()``
        travel in the optimizer's checkpoint."""
        self.comm_algorithm = algorithm

    def attach_comm_state(self, state) -> None:
        """The state of the DDP communication hook (`aiak.comm.allreduce.hooks.CommState`): what it keeps from
        step to step (int8 error-feedback residuals) travels in the optimizer's checkpoint through its ``state_dict()`` /
        ``load_state_dict()``."""
        self.comm_state = state

    def _set_sync(self) -> None:
        if self.ddp is not None:
            self.ddp.require_backward_grad_sync = self.micro_step == self.accumulation - 1 or self._closing

    # -- the window's end and its items --------------------------------------------------------------
    def close_window(self) -> None:
        """The coming ``step()`` is the last of its window, whatever its length: a framework's epoch ends with the
        batch about to be computed (the Lightning and Hugging Face integrations call it before that batch's
        forward, so DDP synchronises its backward)."""
        self._framework_closing = self._closing = True
        self._set_sync()

    def follow_loader(self, counts: bool) -> LoaderSteps:
        """The bookkeeping the loader ``optimize()`` returns reports to (`aiak.loaders.WindowLoader`): windows
        close at the step that trains each epoch's last batch, and with ``counts`` each batch's items weigh the
        backward of the step that trains it (`aiak.step.loader_steps`)."""
        self.loader_steps = LoaderSteps(counts, self._follow_the_loaders_count if counts else None)
        self.sees_epoch_ends = True
        return self.loader_steps

    def _follow_the_loaders_count(self) -> None:
        """Under ``count_items=fn``: the count of the batch the coming backward trains is the pending one (called at
        each batch handed out and after each step)."""
        key, n = self.loader_steps.coming()
        if n is None:
            if not self.items.added:
                self.items.clear_pending()
            if self._counting:
                root_scaling.set_pending(self, False)
        else:
            self._count(n, key)

    def _closes_now(self) -> bool:
        return self._framework_closing or (self.loader_steps is not None and self.loader_steps.closes_window())

    def coming_step_closes(self) -> None:
        """Whether the coming ``step()`` closes its window (a framework said so, or it trains the epoch's last batch),
        and DDP's synchronisation of the coming backward (after each step, and once the loader's epoch is known)."""
        self._closing = self._closes_now()
        self._set_sync()

    def count_items(self, n) -> None:
        """The coming micro-batch's loss averages over ``n`` items (see `count_items`)."""
        if self.loader_steps is not None and self.loader_steps.counts:
            raise RuntimeError("aiak.count_items: aiak.optimize(..., count_items=fn) counts each batch of the loader "
                               "it returned already; a second count of the same batch cannot be told apart. Count "
                               "in one place: drop these calls, or pass count_items=True instead of the function")
        self._count(n)

    def _count(self, n, key=None) -> None:
        self.items.count(n, key)
        if not self._counting:
            self._counting = True
            root_scaling.watch()
            root_scaling.weigh(self._params_of_groups() + self._leaves, self)
        root_scaling.set_pending(self, True)

    def root_weight(self, scaled: bool):
        """For `aiak.amp.scaling.root_scaling`: the pending count as ``(weight, items, reference)``."""
        return self.items.root_weight(scaled)

    # -- the patched methods ------------------------------------------------------------------
    def step(self, closure=None):
        """One micro-step; a real step on the last of a window. ``closure`` (forward and backward, as Lightning
        passes it) runs first, with grad enabled; its loss is returned, on micro-steps too. DCP's ``set_state_dict``
        initialising a fresh optimizer's state (zero gradients, learning rate 0; only while the optimizer has no
        state, so the stack is read only then) is not a training step: it goes to the optimizer's own ``step()``."""
        if closure is None and not self.optimizer.state and called_from(DCP_STATE_DICT, "_init_optim_state"):
            return self._inner_step()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_framework_accumulation()
        if self.loader_steps is not None:
            self.loader_steps.begin_step()   # (an epoch that ended early gives way to the next one here)
            self._closing = self._closes_now()
        self._check_the_scripts_loop()
        if self.step_calls == 0 and self.accumulation > 1 and not self.sees_epoch_ends:
            warn_once("no-loader-epochs", f"aiak: grad_accumulation {self.accumulation} without the loader given "
                      "to aiak.optimize: a window open at an epoch's end runs on into the next epoch (an evaluation "
                      "or a checkpoint there sees part of a window). Pass the loader to aiak.optimize and iterate the "
                      "one it returns, so that windows close with each epoch")
        self._restore_partial_sum()
        self.items.micro_step_done(self.micro_step, self.accumulation)
        if self._counting:
            root_scaling.set_pending(self, False)
        self.step_calls += 1
        self.micro_step += 1
        self.stepped = False
        closing, self._framework_closing = self._closing, False
        unsynced = self.ddp is not None and not self.ddp.require_backward_grad_sync
        follows_counts = self.loader_steps is not None and self.loader_steps.counts
        if self.loader_steps is not None:
            self.loader_steps.step_done()
        if self.micro_step < self.accumulation and not closing:
            self.coming_step_closes()
            self._keep_partial_sum()
            if follows_counts:
                self._follow_the_loaders_count()
            return loss
        micro_steps, self.micro_step = self.micro_step, 0
        self.coming_step_closes()
        if unsynced and self.accumulation > 1:  # an epoch that ended early moved this window's end: its last
            self._average_over_ranks()           # backward ran unsynchronised
        self.step_events += 1
        if self.comm_algorithm is not None:
            self.comm_algorithm.at_real_step()

        found_inf = self._prepare_grads(micro_steps)
        self._prepared = None
        self.items.new_window()
        if follows_counts:  # (after the window's items were read: a batch handed out ahead is the next window's)
            self._follow_the_loaders_count()
        if self.scaler is not None:
            self.scaler.update(found_inf, root_scaling.passes_scaled())
            if found_inf:
                logger.info("aiak: inf/NaN gradients, step skipped; loss scale now %g", self.scaler.scale)
                self._clear_grads()
                if self.comm_algorithm is not None:
                    self.comm_algorithm.after_real_step(False)
                return loss
        inner_loss = self._inner_step()
        loss = inner_loss if closure is None else loss
        self.stepped = True
        self._clear_grads()
        if self.comm_algorithm is not None:
            self.comm_algorithm.after_real_step(True)
        return loss

    def _prepare_grads(self, micro_steps: Optional[int] = None) -> bool:
        """The window's summed gradients averaged (over its ``micro_steps``, or its counted items) and, under loss
        scaling, checked for inf/NaN in the same fused pass; True if any is inf/NaN. Once per real step; called
        before ``step()`` (a clip), the window ends with the coming micro-step."""
        if self._prepared is None:
            self._restore_partial_sum()
            grads = [p.grad for p in self._params_of_groups() if p.grad is not None]
            factor = self._window_factor(micro_steps if micro_steps is not None else self.micro_step + 1)
            if self.scaler is not None:
                self._prepared = LossScaler.check_and_multiply_(grads, factor)
            else:  # no loss scaler, nothing to check: average without reading a flag back (no host sync)
                if isinstance(factor, torch.Tensor) or factor != 1.0:
                    dense = [g for g in grads if not g.is_sparse]
                    if dense:
                        torch._foreach_mul_(dense, factor.to(dense[0].device) if isinstance(factor, torch.Tensor)
                                            else factor)
                    for g in grads:
                        if g.is_sparse:
                            g.mul_(factor)
                self._prepared = False
        return self._prepared

    def _window_factor(self, micro_steps: int):
        """What the window's summed gradients are multiplied by (`WindowItems.factor`): ``1 / micro_steps``,
        or for a counted window its ranks over its items summed over them."""
        params = self._params_of_groups()
        return self.items.factor(micro_steps, self.comm_state, self.ddp, params[0].device if params else None)

    # -- gradient clipping: the one implementation (aiak.step.clip routes torch's functions here) --------
    def active(self) -> bool:
        """Still the controller of its optimizer (``optimize()`` rolled back would have removed it)."""
        return marked(self.optimizer, "_aiak_steps") is self

    def clip_targets(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """``(tensor a user may pass, tensor the real step uses)`` for every parameter: each parameter the
        optimizer steps, paired with itself (the model's parameters are the optimizer's under every precision)."""
        return [(p, p) for p in self._params_of_groups()]

    def _in_window(self) -> bool:
        """The coming ``step()`` is an accumulation micro-step (the gradients are still a partial sum)."""
        self._check_the_scripts_accumulation()
        return self.micro_step + 1 < self.accumulation and not self._closing

    def _step_side(self, tensors) -> List[torch.Tensor]:
        """``tensors`` (tensors the real step uses, as `clip_targets` pairs them), or all the optimizer's."""
        return list(tensors) if tensors is not None else list(self._params_of_groups())

    def real_step_grads(self, tensors=None) -> List[torch.Tensor]:
        """The true gradients the real step will use for ``tensors`` (default: all the optimizer's), averaged
        over the window first; empty on a micro-step, or when they overflowed (the step will be skipped)."""
        if self._in_window() or self._prepare_grads():
            return []
        return [t.grad for t in self._step_side(tensors) if t.grad is not None]

    def grad_norm(self, tensors=None, norm_type: float = 2.0, *, error_if_nonfinite: bool = False,
                  foreach: Optional[bool] = None) -> torch.Tensor:
        """The norm of the true gradient of ``tensors`` (the real step's side; default: all the optimizer's).

        Before a real step: the norm of what the step will use (the window's average, unscaled), computed by
        torch's ``get_total_norm``; ``inf`` if the gradients overflowed under loss scaling (the step will then
        be skipped, so ``error_if_nonfinite`` does not raise for that). On a micro-step: the norm of the
        gradient accumulated so far in the window, in the real step's units (so a user logging ``norm.item()``
        every iteration sees it grow to the real step's norm); nothing is clipped then.
        """
        tensors = self._step_side(tensors)
        if self._in_window():
            return self._partial_norm(tensors, norm_type)
        found_inf = self._prepare_grads()
        grads = [t.grad for t in tensors if t.grad is not None]
        if found_inf:
            return torch.tensor(float("inf"), device=grads[0].device if grads else None)
        return grad_clip.call_original("get_total_norm", grads, norm_type, error_if_nonfinite, foreach)

    @torch.no_grad()
    def _partial_norm(self, tensors: List[torch.Tensor], norm_type: float) -> torch.Tensor:
        """Norm of the gradients summed so far in the window, divided by ``accumulation`` (a counted window: by this
        rank's items so far)."""
        self._restore_partial_sum()
        self._keep_partial_sum()
        grads = [t.grad for t in tensors if t.grad is not None]
        if not grads:
            return torch.tensor(0.0)
        total = grad_clip.call_original("get_total_norm", grads, norm_type, False, None)
        if self.items.is_counted():
            return total / at_least_one(self.items.window_items())
        return total / self.accumulation

    def clip_grads_with_norm_(self, tensors, max_norm: float, total_norm: torch.Tensor,
                              foreach: Optional[bool] = None) -> None:
        """Scale the real step's gradients of ``tensors`` by ``min(1, max_norm / total_norm)`` (torch's
        ``clip_grads_with_norm_``); nothing on a micro-step or when they overflowed."""
        if self._in_window() or self._prepare_grads():
            return
        grad_clip.call_original("clip_grads_with_norm_", self._step_side(tensors), max_norm, total_norm, foreach)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, tensors=None,
                        error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> torch.Tensor:
        """Clip the gradients the coming real step will use (unscaled, averaged over the whole window).

        Call it where plain PyTorch clips, between ``backward()`` and ``step()``, as often as plain PyTorch
        would (every ``step()`` call): on accumulation micro-steps it clips nothing and returns the partial
        norm (see `grad_norm`); before a real step it returns the true norm and clips to it. An
        overflow (inf/NaN under loss scaling) returns ``inf`` and is left to ``step()``, which skips.
        """
        tensors = self._step_side(tensors)
        total = self.grad_norm(tensors, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)
        self.clip_grads_with_norm_(tensors, max_norm, total, foreach)
        return total

    def clip_grad_value_(self, clip_value: float, *, tensors=None, foreach: Optional[bool] = None) -> None:
        """Clamp the real step's true gradients to ``[-clip_value, clip_value]``; nothing on micro-steps."""
        if self._in_window() or self._prepare_grads():
            return  # a micro-step, or an overflow (the step will be skipped)
        with_grads = [t for t in self._step_side(tensors) if t.grad is not None]
        if with_grads:
            grad_clip.call_original("clip_grad_value_", with_grads, clip_value, foreach)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.micro_step != 0:
            return  # inside an accumulation window: the gradients are being summed
        self._clear_grads(set_to_none)

    def _clear_grads(self, set_to_none: bool = True) -> None:
        self._prepared = None
        self._partial = {}
        self._after_backward, self._leaf_passes = {}, {}
        self._inner_zero_grad(set_to_none=set_to_none)

    # -- scheduler: advance once per real step -------------------------------------------------
    def attach_scheduler(self, scheduler) -> None:
        """``scheduler.step()`` does nothing on a micro-step (`aiak.step.scheduler_steps`)."""
        scheduler_steps.follow(scheduler, self)

    # -- checkpoints ----------------------------------------------------------------------------
    def _save_extra(self, optimizer, state_dict):
        if self.micro_step != 0:
            self._unsaved_windows += 1
            if self._unsaved_windows & (self._unsaved_windows - 1) == 0:  # the 1st, 2nd, 4th, 8th... time
                again = f" (the {_ordinal(self._unsaved_windows)} time; said again at the " \
                        f"{_ordinal(2 * self._unsaved_windows)})" if self._unsaved_windows > 1 else ""
                warn(f"aiak: optimizer.state_dict() taken {self.micro_step} micro-step(s) into a "
                     f"{self.accumulation}-step accumulation window: the gradients of those micro-batches are not "
                     "saved, so a run resumed from this checkpoint leaves them out. Save when "
                     "aiak.stepped(optimizer) is True (right after a real step), or make the batches per epoch a "
                     f"multiple of grad_accumulation ({self.accumulation}) when saving at the end of each "
                     f"epoch{again}")
        extras = self.checkpoint_extras()
        groups = state_dict.get("param_groups")
        if groups and called_from(DCP_STATE_DICT, "_get_optim_state_dict"):
            _gather_each_ranks(extras)
            groups[0]["aiak"] = extras  # DCP keeps an optimizer's state and param groups only (a group's keys too)
        else:
            state_dict["aiak"] = extras
        return state_dict

    def checkpoint_extras(self) -> Dict[str, Any]:
        """What a checkpoint holds besides the optimizer's own state: the position in the accumulation window, the
        real steps a scheduler has counted, the loss scaler's state (plain JSON values), the comm algorithm's
        state (its step count; PowerSGD's residuals and factors are tensors) and the comm hook's (int8 residuals)."""
        extra: Dict[str, Any] = {"micro_step": self.micro_step, "step_events": self.step_events}
        if self.loader_steps is not None:
            extra["loader_steps"] = self.loader_steps.state_dict()
        if self._counting:
            extra["items"] = self.items.state_dict()
        if self.scaler is not None:
            extra["loss_scaler"] = self.scaler.state_dict()
        if self.comm_algorithm is not None:
            extra["comm_algorithm"] = self.comm_algorithm.state_dict()
        if self.comm_state is not None:
            extra["comm_state"] = self.comm_state.state_dict()
        return extra

    def _take_extra(self, optimizer, state_dict):
        """aiak's part of a checkpoint taken out before torch loads the rest: at the top (``optimizer.state_dict()``)
        or in the first param group (DCP's ``get_state_dict``), so that it never lands in the optimizer's groups."""
        state_dict = dict(state_dict)
        self._pending_extra = state_dict.pop("aiak", None)
        groups = state_dict.get("param_groups")
        if groups and any("aiak" in g for g in groups):
            groups = [dict(g) for g in groups]
            self._pending_extra = groups[0].pop("aiak", self._pending_extra)
            for g in groups[1:]:
                g.pop("aiak", None)
            state_dict["param_groups"] = groups
        return state_dict

    def _restore_extra(self, optimizer) -> None:
        extra, self._pending_extra = self._pending_extra, None
        if extra is not None:
            self.restore_checkpoint_extras(extra)

    def restore_checkpoint_extras(self, extra: Dict[str, Any]) -> None:
        """Take back what `checkpoint_extras` returned, after the optimizer's own state was loaded."""
        extra = _this_ranks(extra)
        self.micro_step = int(extra.get("micro_step", 0))
        self.step_events = int(extra.get("step_events", 0))
        scheduler_steps.rebase(self)
        if self.scaler is not None and "loss_scaler" in extra:
            self.scaler.load_state_dict(extra["loss_scaler"])
        if "items" in extra:
            self.items.load_state_dict(extra["items"])
        if self.loader_steps is not None and "loader_steps" in extra:
            self.loader_steps.load_state_dict(extra["loader_steps"])
            self._closing = self._closes_now()
        if self.comm_algorithm is not None and "comm_algorithm" in extra:
            self.comm_algorithm.load_state_dict(extra["comm_algorithm"])
        if self.comm_state is not None and "comm_state" in extra:
            self.comm_state.load_state_dict(extra["comm_state"])
        self._set_sync()


EACH_RANKS = ("comm_algorithm", "comm_state")  # extras that differ from rank to rank (residuals, factors)


def _gather_each_ranks(extras: Dict[str, Any]) -> None:
    """Under DCP: the extras that differ from rank to rank (`EACH_RANKS`) replaced by one ``each_rank`` object, the
    bytes of every rank's, gathered. DCP writes a tensor that is not a DTensor once, as if every rank held the same,
    and loads only the keys a fresh optimizer's template holds (residuals made at the first steps are not there); one
    object of the same key on every rank passes both."""
    parts = {k: extras.pop(k) for k in EACH_RANKS if k in extras}
    if not parts:
        return
    mine = _to_bytes(parts)
    every = [mine]
    if world_size() > 1:
        every = [None] * world_size()
        dist.all_gather_object(every, mine)
    extras["each_rank"] = _to_bytes(every)


def _this_ranks(extra: Dict[str, Any]) -> Dict[str, Any]:
    """The extras with this rank's part of ``each_rank`` put back (rank 0's on another number of ranks: the comm
    state's own checks then drop what belongs to other ranks, saying why)."""
    if "each_rank" not in extra:
        return extra
    extra = dict(extra)
    every = _from_bytes(extra.pop("each_rank"))
    rank = dist.get_rank() if process_group_exists() else 0
    extra.update(_from_bytes(every[rank] if len(every) == world_size() else every[0]))
    return extra


def _to_bytes(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def controller_of(optimizer) -> Optional[StepController]:
    """The step controller aiak attached to ``optimizer`` or to the optimizer a framework's wrapper holds
    (Accelerate's ``AcceleratedOptimizer.optimizer``, Lightning's ``LightningOptimizer._optimizer``); None if
    aiak did not patch it."""
    inner = getattr(optimizer, "optimizer", getattr(optimizer, "_optimizer", optimizer))
    return marked(optimizer, "_aiak_steps") or marked(inner, "_aiak_steps")


def stepped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the last `optimizer.step()` updated the weights.

    Under `grad_accumulation` a loop's iterations are micro-steps, and an fp16 step with inf/NaN gradients is
    skipped: a script that counts its own iterations (an EMA updated every N iterations, a log every N steps)
    counts real steps with it:

    ```python
    optimizer.step()
    if aiak.stepped(optimizer):
        ema.update_parameters(model)
    ```

    Args:
        optimizer: an optimizer [aiak.optimize][aiak.api.optimize] returned (or a framework's wrapper of it); any
            other optimizer steps on every call.

    Returns:
        False after an accumulation micro-step and after a step skipped for inf/NaN gradients; True otherwise
            (always True for an optimizer aiak did not patch).
    """
    controller = controller_of(optimizer)
    return controller.stepped if controller is not None and controller.active() else True


def count_items(optimizer: torch.optim.Optimizer, n: Union[int, float, torch.Tensor]) -> None:
    """Say, before a micro-batch's backward, that its loss is a mean over `n` items (tokens, samples).

    A window whose micro-batches are all counted is averaged by items: the real step's gradient is
    `sum_i n_i g_i / sum_i n_i`, with the items summed over the ranks the gradients are averaged over, which for
    mean losses is the gradient of the big batch's mean over all its items (what the Hugging Face Trainer's
    `num_items_in_batch` gives), not the mean of the micro-batches' means. Every micro-batch of a window is counted,
    or none; under DDP every rank counts (the items are summed at each real step). Each call counts the backward that
    follows it: the counts of several backward passes before one `step()` (a script's own accumulation under
    `no_sync`) add up. `aiak.optimize(..., count_items=fn)` counts each batch of the loader it returns for the
    backward of the step that trains it, so the script then does not call this function.

    Args:
        optimizer: the optimizer [aiak.optimize][aiak.api.optimize] returned. One aiak gave no step controller (no
            accumulation, no fp16 loss scale) has nothing to weigh in a single process (a window of one
            micro-batch is its own mean).
        n: what the loss divides by, a number or a one-element tensor left on its device:
            `(labels[:, 1:] != -100).sum()` for a causal language model (its loss averages over the labels shifted
            by one), `(labels != -100).sum()` for a masked one.

    Raises:
        TypeError: `n` is neither a number nor a tensor.
        ValueError: `n` is a tensor of more than one element, or not a finite count >= 0.
        RuntimeError: a second count before the same backward (which count is that backward's?), a count while
            `optimize(..., count_items=fn)` counts the batches (the batch would be counted twice), or, on several
            ranks, an optimizer aiak gave no step controller: pass `count_items=True` (or a function of the batch)
            to `aiak.optimize`.
    """
    controller = controller_of(optimizer)
    if controller is not None and controller.active():
        controller.count_items(n)
        return
    WindowItems.check(n)
    if is_distributed():
        raise RuntimeError("aiak.count_items: this optimizer has no aiak step controller, so DDP averages each rank's "
                           "gradient alike and the counts cannot weigh them: pass count_items=True (you call "
                           "aiak.count_items) or count_items=fn (a function of the batch) to aiak.optimize with this "
                           "optimizer")


def clip_grad_norm_(optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over `optimizer`'s parameters, right under accumulation and loss scaling.

    With accumulation the gradients are partial sums until the last micro-step: this clips what the real step will
    use (the window's average, unscaled). A script's own `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`
    is routed here already; this is the same by optimizer.

    Args:
        optimizer: the optimizer whose parameters' gradients are clipped; on one aiak did not patch, the plain clip.
        max_norm: the largest total norm the gradients keep.
        norm_type: the norm's order (2.0: Euclidean; `inf`: the largest absolute value).

    Returns:
        The total norm of the gradients before clipping; on an accumulation micro-step nothing is clipped and the
            norm accumulated so far is returned.
    """
    controller = marked(optimizer, "_aiak_steps")
    if controller is not None:
        return controller.clip_grad_norm_(max_norm, norm_type)
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    return grad_clip.call_original("clip_grad_norm_", params, max_norm, norm_type)


def clip_grad_value_(optimizer: torch.optim.Optimizer, clip_value: float) -> None:
    """`torch.nn.utils.clip_grad_value_` over `optimizer`'s parameters, right under accumulation and loss scaling.

    As [aiak.clip_grad_norm_][aiak.step.controller.clip_grad_norm_]: under accumulation it clips the real step's
    gradient (the window's average, unscaled), and nothing on a micro-step.

    Args:
        optimizer: the optimizer whose parameters' gradients are clipped; on one aiak did not patch, the plain clip.
        clip_value: each gradient element is clipped to `[-clip_value, clip_value]`.
    """
    controller = marked(optimizer, "_aiak_steps")
    if controller is not None:
        return controller.clip_grad_value_(clip_value)
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if params:
        grad_clip.call_original("clip_grad_value_", params, clip_value)

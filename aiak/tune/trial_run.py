"""One candidate's run in the trials (`aiak.tune.trials`): its copy of the model and optimizer, the trial step and
its loss, the evaluation a script does between epochs, and the gradients the numerics gate compares.

A `TrialRun` applies its candidate to a deep copy of its own; a `SwitchedRun` computes its candidate on the pick's
one copy, switched to it between passes, as the run-time guard (`aiak.tune.guard`) switches the run."""
from __future__ import annotations

import copy
import itertools
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from aiak.amp.half_compute import half_compute_of
from aiak.apply import apply_strategy
from aiak.measure.rounds import Contender
from aiak.ops.surgery import FusedOpsSwitch
from aiak.runtime.switches import attach_layout, channels_last_of, read_switches, write_switches
from aiak.step.training_step import training_step
from aiak.tune import gate
from aiak.tune.candidates import Candidate
from aiak.util import warn
from aiak.util.nested import iter_tensors, logits_of, map_tensors
from aiak.util.text import describe_error

EVAL_SAMPLES = 2           # the samples of each candidate's evaluation forward


@dataclass
class TrialRecord:
    """One candidate's result, as ``last_decision().to_dict()["trials"]`` shows it."""

    label: str
    strategy: Dict[str, Any]                    # key path -> value where it differs from plain PyTorch
    step_ms: Optional[float] = None             # median of the timed rounds (slowest rank)
    step_ms_spread: Optional[List[float]] = None  # [min, max] of the timed rounds
    samples_ms: List[float] = field(default_factory=list)
    peak_mem_mb: Optional[float] = None         # its first step's peak above its start (`aiak.measure.memory`;
                                                # on a CPU a lower bound)
    grad_cosine: Optional[float] = None
    grad_norm_diff: Optional[float] = None
    accepted: bool = False
    why: str = ""

    speedup: Optional[float] = None             # median (low) over rounds of plain's time / this one's, same round
    speedup_spread: Optional[List[float]] = None  # [min, max] of those per-round ratios

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def trial_loss(output: Any, batch: Any) -> torch.Tensor:
    """The loss the trial step backpropagates (see the module docstring); class scores are read by
    `aiak.util.nested.logits_of`, the one reading of a model's output."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss.float()
    try:
        logits = logits_of(output)
    except TypeError:  # no class scores (a backbone's features): any floating output makes the compute real
        logits = next((t for t in iter_tensors(output) if t.is_floating_point()), None)
        if logits is None:
            raise TypeError(f"trial step: the model's output ({type(output).__name__}) holds no floating-point "
                            f"tensor to backpropagate from") from None
    target = batch[1] if isinstance(batch, (tuple, list)) and len(batch) > 1 else None
    if _class_indices(target, logits):
        return nn.functional.cross_entropy(logits.float(), target.to(logits.device))
    return logits.float().square().mean()


IGNORE_INDEX = -100  # cross-entropy's default ignore_index (padding, unlabelled pixels)


def _class_indices(target: Any, logits: torch.Tensor) -> bool:
    """Whether ``target`` can be cross-entropy's class indices for ``logits`` ((N, C, ...) scores): an integer
    tensor of shape (N, ...) with every value in [0, C) or the ignore index. A sample index, a regression
    target or a mask of another shape is not, and cross-entropy would raise (or, on CUDA, assert on the
    device) on it."""
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.is_complex() \
            or target.dtype == torch.bool or logits.dim() < 2 or not logits.is_floating_point():
        return False
    if target.shape != logits.shape[:1] + logits.shape[2:]:
        return False
    valid = ((target >= 0) & (target < logits.shape[1])) | (target == IGNORE_INDEX)
    return bool(valid.all())


def trial_loss_of(model: nn.Module, batch: Any) -> torch.Tensor:
    return trial_loss(_call(model, batch), batch)


def _call(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)) and batch:
        return model(batch[0])
    raise TypeError(f"trial step: cannot feed a batch of type {type(batch).__name__} to the model")


class TrialRun:
    """A candidate applied to its own copy of the model and optimizer, with the process switches it sets."""

    def __init__(self, candidate: Candidate, device: torch.device):
        self.candidate = candidate
        self.record = TrialRecord(candidate.label, {k: plain_value(v) for k, v in candidate.changes.items()})
        self.device = device
        self.channels_last = candidate.strategy.channels_last and candidate.strategy.loader.prefetch > 0
        self.failed = ""
        self.process_switches: Dict[str, Any] = {}  # aiak.runtime.rollback's switches as applying this candidate left them
        self.warmup_s: List[float] = []             # steps' seconds before timing began (slowest rank), the gate's first
        self.timer: Optional[Contender] = None      # its side in the timed rounds (aiak.measure.rounds)
        self.fused: Optional[FusedOpsSwitch] = None   # a switched copy's swapped modules (fused ops)
        self.outputs: Optional[List[torch.Tensor]] = None         # the floating outputs of its last `gradients`

    def build(self, model: nn.Module, optimizer: Any) -> None:
        """Apply the candidate to deep copies of ``model`` and ``optimizer`` (quietly; failures are recorded).
        The process switches it set are kept for its steps and the process's put back, so every candidate is
        applied from the same ones (a knob that is off writes nothing: it would inherit the previous one's)."""

        process = read_switches()
        try:
            with warn.quiet():
                self.bare, optimizer = copy.deepcopy((model, optimizer))
                applied = apply_strategy(self.candidate.strategy, self.bare, optimizer, None, None, self.device,
                                         distributed=False)
            self.model, self.optimizer, self.controller = applied.model, applied.optimizer, applied.controller
        except Exception as e:  # noqa: BLE001 - a candidate that cannot be applied is dropped, not fatal
            self.fail(f"could not be applied: {describe_error(e)}")
        finally:
            self.process_switches = read_switches()
            write_switches(process)

    def fail(self, why: str) -> None:
        self.failed = self.failed or why
        self.record.why = self.failed
        self.record.accepted = False

    def switches(self) -> None:
        """Write every process switch as this candidate's run would have it, on or off."""
        write_switches(self.process_switches)

    def prepare(self, batch: Any) -> Any:
        """The batch as this candidate's loader would deliver it (device, and channels_last when prefetched)."""
        def move(t: torch.Tensor) -> torch.Tensor:
            t = t.to(self.device, copy=True)
            if self.channels_last and t.dim() == 4 and t.is_floating_point():
                t = t.contiguous(memory_format=torch.channels_last)
            return t
        return map_tensors(batch, move)

    def step(self, batch: Any, want_grads: bool) -> Optional[Dict[str, torch.Tensor]]:
        """The user's step (`aiak.step.training_step.training_step`) on ``batch``; with ``want_grads``,
        the gradients it computed (one micro-step's true gradient: the fp32 parameters' own, unscaled as they
        landed), read between the backward and the optimizer step."""
        grads: Dict[str, Dict[str, torch.Tensor]] = {}

        def after_backward(phase: str) -> None:
            if phase == "backward":
                grads["read"] = gate.gradients(self.bare)

        training_step(self.model, self.optimizer, self.prepare(batch), trial_loss_of,
                      after_backward if want_grads else None)
        return grads.get("read")

    def evaluate(self, batch: Any) -> str:
        """What a script does between epochs: ``model.eval()``, a forward under ``torch.inference_mode()``,
        ``model.train()`` again, on the batch's first `EVAL_SAMPLES` samples (what fails in evaluation fails on
        any number of samples, and the whole batch cost a quarter of a step per candidate). Returns the error it
        raised, or ``""``."""
        size = batch_size_of(batch)
        if size is not None and size > EVAL_SAMPLES:
            batch = batch_rows(batch, slice(0, EVAL_SAMPLES), size)
        try:
            self.model.eval()
            with torch.inference_mode():
                _call(self.model, self.prepare(batch))
        except Exception as e:  # noqa: BLE001 - reported as the candidate's reason
            return describe_error(e)
        finally:
            self.model.train()
        return ""

    def timed_step(self, batches: List[Any]) -> Callable[[], None]:
        """The step the rounds time: one step on the next batch, batch 1 first (batch 0 was the gate's), round
        and round; every candidate takes its k-th timed step on the same batch."""
        order = itertools.cycle(batches[1:] + batches[:1])
        return lambda: self.step(next(order), want_grads=False)

    def gradients(self, batch: Any, unless: Optional[Callable[[List[torch.Tensor]], bool]] = None
                  ) -> Optional[Dict[str, torch.Tensor]]:
        """The gradients of one forward and backward on ``batch`` from the current weights, as
        `aiak.tune.gate.gradients` gives them, the copy left as it was: taken by ``autograd.grad``, so no
        ``.grad`` is written and no gradient hook sees a backward (a step controller counts them to tell a
        script's own accumulation); no optimizer step; buffers (BatchNorm's running statistics) put back.
        The forward's floating outputs are kept in ``outputs``; where ``unless`` returns True on them, no backward
        runs and None is returned."""
        named = [(n, p) for n, p in self.bare.named_parameters() if p.requires_grad]
        buffers = [b.detach().clone() for b in self.bare.buffers()]
        try:
            prepared = self.prepare(batch)
            output = _call(self.model, prepared)
            self.outputs = [t.detach() for t in iter_tensors(output) if t.is_floating_point()]
            if unless is not None and unless(self.outputs):
                return None
            grads = torch.autograd.grad(trial_loss(output, prepared), [p for _, p in named], allow_unused=True)
        finally:
            with torch.no_grad():
                for b, saved in zip(self.bare.buffers(), buffers):
                    b.copy_(saved)
        return {n: (g if g is not None else torch.zeros_like(p)).detach().float().contiguous()
                for (n, p), g in zip(named, grads)}


class SwitchedRun(TrialRun):
    """A candidate computed on the pick's one copy, switched to it between passes as the run-time guard switches the
    run (`aiak.tune.candidates.switches_between_steps`: half compute on or off, its level, the layout): where the
    run times the candidates, the trials only gate and evaluate them, and one copy serves all. Its gate step is a
    gradient (`TrialRun.gradients`: nothing of the copy changes), taken only where the gate judges it."""

    def __init__(self, candidate: Candidate, device: torch.device, shared: TrialRun, process_switches: Dict[str, Any]):
        super().__init__(candidate, device)
        self.bare, self.model, self.optimizer = shared.bare, shared.model, shared.optimizer
        self.fused = shared.fused
        self.failed = shared.failed
        self.process_switches = dict(process_switches)

    def configure(self) -> None:
        """The shared copy computes as this candidate from its next forward."""
        s = self.candidate.strategy
        compute, layout = half_compute_of(self.bare), channels_last_of(self.bare)
        half = s.precision.level != "O0"
        if compute is not None:
            compute.enabled = half
            if half and compute.level != s.precision.level:
                compute.switch_level(self.bare, s.precision.level)   # refused where it would not be exact
        if s.channels_last and layout is None:
            layout = attach_layout(self.bare)[0]
        if layout is not None and layout.on != bool(s.channels_last):
            layout.switch(self.bare, bool(s.channels_last), self.optimizer)
        if self.fused is not None:
            self.fused.switch(s.fused_ops)

    def step(self, batch: Any, want_grads: bool, unless: Optional[Callable[[List[torch.Tensor]], bool]] = None
             ) -> Optional[Dict[str, torch.Tensor]]:
        self.configure()
        return self.gradients(batch, unless) if want_grads else None

    def evaluate(self, batch: Any) -> str:
        self.configure()
        return super().evaluate(batch)

    def gradients(self, batch: Any, unless: Optional[Callable[[List[torch.Tensor]], bool]] = None
                  ) -> Optional[Dict[str, torch.Tensor]]:
        self.configure()
        return super().gradients(batch, unless)


def plain_value(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str, type(None))) else json.loads(json.dumps(value, default=str))


def batch_rows(batch: Any, rows: slice, size: int) -> Any:
    """``batch`` with every tensor of ``size`` samples cut to ``rows``."""
    return map_tensors(batch, lambda t: t[rows] if t.dim() and t.shape[0] == size else t)


def batch_size_of(batch: Any) -> Optional[int]:
    """The leading dimension of the batch's first tensor (the samples), or None."""
    return next((t.shape[0] for t in iter_tensors(batch) if t.dim()), None)

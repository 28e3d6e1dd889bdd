"""The items an accumulation window averages over, for ``aiak.count_items``: the big batch's gradient for losses that
are means over a varying number of items (tokens, samples).

A language-model loss is usually a mean over a micro-batch's real tokens. Averaging ``k`` such means weighs a
micro-batch of 5 tokens like one of 500, so the accumulated gradient is not the big batch's. The big batch's mean
over all its items is ``sum_i n_i g_i / sum_i n_i`` (``g_i`` the gradient of micro-batch ``i``'s mean, ``n_i`` its
items): the Hugging Face Trainer's ``num_items_in_batch`` (2024) computes it by dividing loss sums by the window's
count, fetched ahead. aiak leaves the script's loop as it is, so it weighs each micro-batch as its backward runs
(`aiak.amp.scaling.root_scaling` multiplies the root by ``n_i``) and divides at the real step by the window's items,
summed over the ranks the gradients are averaged over.

`WindowItems` is the bookkeeping of one step controller: the count declared for the coming backward
(``pending``), the items of the window's backward passes so far (``total``, this rank's: a count joins it at the
first backward that uses it, so the counts of a script's own accumulation add up), whether the window is
counted at all (every micro-batch of a window is counted, or none), and the fp16 reference (a power of two fixed
at the first count, see `aiak.amp.scaling.root_scaling.weigh`). Counts are numbers or 0-dim tensors (a count computed
on the device stays there: no host sync per micro-step).
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from aiak.util.dist import is_distributed


class WindowItems:
    """The counted items of one controller's accumulation window (see the module docstring)."""

    __slots__ = ("pending", "pending_key", "added", "counted_now", "total", "counted", "reference")

    def __init__(self):
        self.pending: Any = None       # items of the micro-batch whose backward comes next
        self.pending_key: Any = None   # the loader's number of that batch (count_items=fn), else None
        self.added = False             # the pending items are in ``total`` already (a backward used them)
        self.counted_now = False       # a count was given since the last step()
        self.total: Any = 0.0          # items of the window's backward passes so far (this rank)
        self.counted: Optional[bool] = None  # None: the window has no micro-step yet
        self.reference: Optional[float] = None  # the fp16 root's reference (see root_weight)

    @staticmethod
    def check(n: Any) -> Any:
        """``n`` as a count: a non-negative int or float, or a tensor of one element (kept where it is, as float)."""
        if isinstance(n, bool) or not isinstance(n, (numbers.Real, torch.Tensor)):
            raise TypeError(f"aiak.count_items: n must be a number or a one-element tensor (the items this "
                            f"micro-batch's loss averages over), got {type(n).__name__}")
        if isinstance(n, torch.Tensor):
            if n.numel() != 1:
                raise ValueError(f"aiak.count_items: n must be one number, got a tensor of shape {tuple(n.shape)}; "
                                 "sum it first, e.g. (labels != -100).sum()")
            return n.detach().reshape(()).float()
        if not math.isfinite(n) or n < 0:
            raise ValueError(f"aiak.count_items: n must be a finite count >= 0, got {n}")
        return float(n)

    def count(self, n: Any, key: Any = None) -> None:
        """The coming backward's loss averages over ``n`` items. Counts of several backward passes before one
        ``step()`` add up (a script's own accumulation); a second count before the backward of the first cannot be
        attributed and raises. ``key``: the loader's number of the batch (``count_items=fn``), whose count is given
        again, unchanged, until a step trains it."""
        n = self.check(n)
        if key is not None and key == self.pending_key:
            return
        if key is None and self.pending is not None and not self.added:
            raise RuntimeError(
                "aiak.count_items: called twice before one backward: which count is that backward's? Call it once "
                "before each backward (the items of that backward's loss); counts of several backward passes before "
                "one optimizer.step() add up")
        self.pending, self.pending_key, self.added, self.counted_now = n, key, False, True

    def clear_pending(self) -> None:
        self.pending, self.pending_key, self.added = None, None, False

    def root_weight(self, scaled: bool):
        """``(weight, items, reference)`` for `aiak.amp.scaling.root_scaling.weigh`: the pending count, and under an
        fp16 loss scale its ratio to a power of two fixed at the first count (read once from the device). The first
        backward that uses a count adds it to the window's items."""
        n = self.pending
        if n is None:  # (a backward with no count pending: unweighted; the step says what is wrong)
            return 1.0, 1.0, 1.0
        if not self.added:
            self.total, self.added = self.total + n, True
        if not scaled:
            return n, n, 1.0
        if self.reference is None:
            first = float(n) if isinstance(n, torch.Tensor) else n
            self.reference = 2.0 ** math.floor(math.log2(first)) if first >= 1 else 1.0
        return n / self.reference, n, self.reference

    def micro_step_done(self, done: int, accumulation: int) -> None:
        """One ``step()`` call of the window, after ``done`` others: a count no backward used joins the window's
        items too (raises if only some of the window's micro-batches are counted)."""
        counted = self.counted_now
        if self.counted is None:
            self.counted = counted
        elif self.counted != counted:
            raise RuntimeError(
                f"aiak.count_items: micro-step {done + 1} of this {accumulation}-step accumulation window was "
                f"{'' if counted else 'not '}counted, and the {done} before it were{' not' if counted else ''}: a "
                "window is averaged by items only when each of its micro-batches says how many it holds. Call "
                "aiak.count_items(optimizer, n) before every backward (or give optimize() count_items=fn), or never")
        if self.pending is not None and not self.added:
            self.total = self.total + self.pending
        self.clear_pending()
        self.counted_now = False

    def window_items(self) -> Any:
        """This rank's items in the window, the pending micro-batch's included (a clip before ``step()``)."""
        return self.total + self.pending if self.pending is not None and not self.added else self.total

    def is_counted(self) -> bool:
        """The window's micro-batches are counted (the pending one decides before the first ``step()``)."""
        return self.counted if self.counted is not None else self.counted_now

    def factor(self, micro_steps: int, comm_state=None, ddp=None, device=None):
        """What the window's summed gradients are multiplied by at the real step: ``1 / micro_steps`` (timm's rule:
        a window the epoch's end closed early is averaged over the micro-batches it holds), or, counted, ``ranks /
        items``: its items summed over the ``ranks`` its gradients were averaged over (each micro-batch's gradient
        entered the sum times its items), clamped to at least 1 item."""
        if not self.is_counted():
            return 1.0 / micro_steps
        ranks, items = sum_over_ranks(self.window_items(), comm_state, ddp, device)
        factor = ranks / at_least_one(items)
        return factor.reshape(()).float() if isinstance(factor, torch.Tensor) else factor

    def new_window(self) -> None:
        self.total, self.counted = 0.0, None

    def state_dict(self) -> Dict[str, Any]:
        """Plain numbers: the window's items so far (read from the device) and the fp16 reference."""
        total = self.total.item() if isinstance(self.total, torch.Tensor) else self.total
        return {"total": total, "counted": self.counted, "reference": self.reference}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.total = float(state.get("total", 0.0))
        self.counted = state.get("counted")
        self.reference = state.get("reference")
        self.clear_pending()
        self.counted_now = False


def at_least_one(items):
    """``items``, or 1 if fewer (a window of no items divides by 1: its zero gradients stay zero)."""
    return items.clamp_min(1.0) if isinstance(items, torch.Tensor) else max(items, 1.0)


def sum_over_ranks(items, comm_state=None, ddp=None, device=None):
    """``(ranks, items summed over them)``: the ranks a gradient is averaged over. With aiak's comm hook, its scope
    (every rank, the node's, or this one alone), summed on the hook's worker after its buckets
    (``comm_state.sum_items``); with a DDP without aiak's hook, its process group; else this rank alone. One
    8-byte sum per real step; ``device``: where the gradients are (an NCCL group sums on it)."""
    if comm_state is not None:
        ranks = comm_state.scope_size()
        if ranks == 1:
            return 1, items
        total = _as_sent(items, comm_state.process_group, device)
        comm_state.sum_items(total)
        return ranks, total
    if ddp is not None and is_distributed(ddp.process_group):
        total = _as_sent(items, ddp.process_group, device)
        dist.all_reduce(total, group=ddp.process_group)
        return dist.get_world_size(ddp.process_group), total
    return 1, items


def _as_sent(items, group, device) -> torch.Tensor:
    """``items`` as a float64 tensor of one element, on the device ``group``'s backend sums on."""
    on = device if dist.get_backend(group) == "nccl" and device is not None else torch.device("cpu")
    if isinstance(items, torch.Tensor):
        return items.detach().to(on, torch.float64).reshape(1)
    return torch.tensor([float(items)], dtype=torch.float64, device=on)

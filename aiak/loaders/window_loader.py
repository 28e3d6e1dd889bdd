"""The loader's side of gradient accumulation: the batches it hands out, each epoch's length, and each batch's items.

With ``grad_accumulation: 4`` and 10 batches per epoch, a window still open after the epoch's 8th batch would run
on into the next epoch, so an epoch-level scheduler, an evaluation or a checkpoint at the epoch's end would see
half a window. timm's ``train.py`` (``last_batch``, ``last_accum_steps``), the Lightning Trainer and the Hugging
Face Trainer close the window at the epoch's last batch and average over the micro-batches it holds.
`WindowLoader` tells the step controller what it hands out, and the controller closes the window at the
script's step that trains the epoch's last batch (`aiak.step.loader_steps`: an evaluation over this loader, a
prefetcher reading ahead or a loop that breaks early do not shift the windows).

The epoch's length is the loader's ``len()``, read at each ``iter()``: exact for a ``DataLoader`` over a map-style
dataset (its batch sampler's length, ``drop_last`` included), aiak's balanced and prefetching loaders and any sized
iterable. A ``DataLoader`` over an ``IterableDataset`` (whose ``len()`` is an estimate) and an iterable with no
``len()`` are not closed early: a window runs on as before, said once. An epoch that ends at another length than
``len()`` said is said once too.

With ``count`` (``aiak.optimize(..., count_items=fn)``), each batch's ``count(batch)`` goes with it, and weighs the
backward of the step that trains it.

Everything else (``len``, ``dataset``, ``sampler``, ``batch_size``, ``set_epoch``, attributes a script sets, such
as timm's ``loader.mixup_enabled``) is the wrapped loader's.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

from torch.utils.data import IterableDataset

from aiak.util.dist import is_distributed, max_across_ranks
from aiak.util.warn import warn_once

_OWN = frozenset({"loader", "follower", "count"})


def batches_per_epoch(loader: Any) -> Optional[int]:
    """The batches one iteration of ``loader`` yields, when its ``len()`` says it exactly (None otherwise)."""
    try:
        if isinstance(getattr(loader, "dataset", None), IterableDataset):
            return None
        return len(loader)
    except (TypeError, AttributeError, NotImplementedError):
        return None


def check_epochs_alike(loader: Any, accumulation: int) -> Optional[int]:
    """``loader``'s batches per epoch (`batches_per_epoch`), the same on every rank of the process group
    (one small collective): ranks closing their windows at different batches would send DDP's allreduces out of
    step. Raises naming the lengths if they differ; says once when no length is known (windows then run on)."""
    batches = batches_per_epoch(loader)
    if is_distributed():
        most, least = max_across_ranks([-1 if batches is None else batches, -(-1 if batches is None else batches)])
        if most != -least:
            raise ValueError(
                f"aiak: grad_accumulation {accumulation} closes its window at each epoch's last batch, and the "
                f"loader's epochs differ across ranks (from {int(-least)} to {int(most)} batches; -1: no len()): the "
                "ranks would close at different batches. Give every rank the same number of batches "
                "(DistributedSampler does; or drop_last=True), or do not pass the loader to aiak.optimize")
    if batches is None:
        warn_once("epoch-unknown", f"aiak: grad_accumulation {accumulation}: the loader has no exact len() (an "
                  "iterable without one, or an IterableDataset), so a window open at an epoch's end runs on into the "
                  "next epoch. Give the loader a len(), or make the batches per epoch a multiple of "
                  f"{accumulation}")
    return batches


class WindowLoader:
    """``loader`` telling ``follower`` (the step controller's `aiak.step.loader_steps.LoaderSteps`) each iteration's
    start and end and each batch it hands out, with ``count(batch)`` when ``count`` is given."""

    def __init__(self, loader: Any, follower: Any, count: Optional[Callable[[Any], Any]] = None):
        object.__setattr__(self, "loader", loader)
        object.__setattr__(self, "follower", follower)
        object.__setattr__(self, "count", count)

    def __iter__(self) -> Iterator[Any]:
        expected = self.follower.batches
        if expected is not None:  # read at each iteration, as the epoch's length may change (balanced batches)
            expected = batches_per_epoch(self.loader) or expected
            self.follower.follow_epochs(expected)
        iteration = self.follower.iteration_started()
        seen = 0
        try:
            for batch in self.loader:
                seen += 1
                if self.count is not None:
                    self.follower.handed_out(iteration, self.count(batch))
                else:
                    self.follower.handed_out(iteration)
                yield batch
        finally:
            self.follower.iteration_ended(iteration)
        if expected is not None and seen != expected:
            warn_once("epoch-length", f"aiak: an epoch of the loader had {seen} batches where its len() says "
                      f"{expected}: the accumulation window was {'closed early' if seen > expected else 'not closed'} "
                      "at that epoch's end. Give the loader a len() that is its number of batches")

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "loader" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["loader"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        """A write reaches the wrapped loader (timm turns mixup off with ``loader.mixup_enabled = False``)."""
        if name in _OWN or not hasattr(self.loader, name):
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)

    def __repr__(self) -> str:
        return f"WindowLoader({self.loader!r})"

"""The loader's side of gradient accumulation: where each epoch ends, and how many items each batch holds.

With ``grad_accumulation: 4`` and 10 batches per epoch, a window still open after the epoch's 8th batch would run
on into the next epoch, so an epoch-level scheduler, an evaluation or a checkpoint at the epoch's end would see
half a window. timm's ``train.py`` (``last_batch``, ``last_accum_steps``), the Lightning Trainer and the Hugging
Face Trainer close the window at the epoch's last batch and average over the micro-batches it holds.
:class:`WindowLoader` does it for a script's own loop: it counts the batches it yields, and before yielding the
epoch's last one calls ``close_window`` (the step controller then makes the coming ``step()`` a real one and has
DDP synchronise that batch's backward, which starts in the forward about to run).

The epoch's length is the loader's ``len()``, read at each ``iter()``: exact for a ``DataLoader`` over a map-style
dataset (its batch sampler's length, ``drop_last`` included), aiak's balanced and prefetching loaders and any
sized iterable. A ``DataLoader`` over an ``IterableDataset`` (whose ``len()`` is an estimate) and an iterable with
no ``len()`` are not closed early: a window runs on as before, said once. An epoch that ends at another length
than ``len()`` said is said once too.

With ``count`` (``aiak.optimize(..., count_items=fn)``), each batch's ``count(batch)`` is handed to ``counted``
(the controller's ``count_items``) as it is yielded, before the script's forward and backward on it.

Everything else (``len``, ``dataset``, ``sampler``, ``batch_size``, ``set_epoch``, attributes a script sets, such
as timm's ``loader.mixup_enabled``) is the wrapped loader's.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

from torch.utils.data import IterableDataset

from aiak.util.dist import is_distributed, max_across_ranks
from aiak.util.warn import warn_once

_OWN = frozenset({"loader", "close_window", "count", "counted"})


def batches_per_epoch(loader: Any) -> Optional[int]:
    """The batches one iteration of ``loader`` yields, when its ``len()`` says it exactly (None otherwise)."""
    try:
        if isinstance(getattr(loader, "dataset", None), IterableDataset):
            return None
        return len(loader)
    except (TypeError, AttributeError, NotImplementedError):
        return None


def check_epochs_alike(loader: Any, accumulation: int) -> Optional[int]:
    """``loader``'s batches per epoch (:func:`batches_per_epoch`), the same on every rank of the process group
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
    """``loader`` telling the step controller where each epoch ends (``close_window()`` before the last batch) and,
    with ``count``, how many items each batch holds (``counted(count(batch))`` before it is yielded)."""

    def __init__(self, loader: Any, close_window: Optional[Callable[[], None]],
                 count: Optional[Callable[[Any], Any]] = None, counted: Optional[Callable[[Any], None]] = None):
        if count is not None and counted is None:
            raise ValueError("WindowLoader: count needs counted (where each batch's count goes)")
        object.__setattr__(self, "loader", loader)
        object.__setattr__(self, "close_window", close_window)
        object.__setattr__(self, "count", count)
        object.__setattr__(self, "counted", counted)

    def __iter__(self) -> Iterator[Any]:
        expected = batches_per_epoch(self.loader) if self.close_window is not None else None
        seen = 0
        for batch in self.loader:
            seen += 1
            if self.count is not None:
                self.counted(self.count(batch))
            if seen == expected:
                self.close_window()
            yield batch
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

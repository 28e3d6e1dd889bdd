"""The user's first batches, borrowed for the trials and given back: the loop sees every batch exactly once.

The trials (:mod:`aiak.tune.trials`) need real batches before the user's loop starts. They open the loader
(``iter(loader)``, exactly what the loop's first ``for`` would do), take a few batches, and hand the loader
on wrapped in a :class:`ReplayLoader`: its first iteration yields the borrowed batches, then continues the
same open iterator. So the first epoch is the epoch the user's own ``for`` would have seen, same order,
same batches, none twice; later iterations are the loader's own.

If the sampler's epoch changed before that first iteration (``loader.sampler.set_epoch(n)`` when resuming),
the borrowed batches belong to the wrong epoch: they are dropped and the loader is opened afresh.
"""
from __future__ import annotations

from typing import Any, Iterator, List, Optional


def _epoch_of(loader: Any) -> Optional[int]:
    sampler = getattr(loader, "sampler", None)
    epoch = getattr(sampler, "epoch", None)
    return epoch if isinstance(epoch, int) else None


class ReplayLoader:
    """``loader`` with ``batches`` (already drawn from the open iterator ``live``) put back in front.

    Everything else (``len``, ``dataset``, ``sampler``, ``set_epoch``, ...) is the wrapped loader's.
    """

    def __init__(self, loader: Any, batches: List[Any], live: Iterator, epoch: Optional[int]):
        self.loader = loader
        self._batches: Optional[List[Any]] = list(batches)
        self._live: Optional[Iterator] = live
        self._epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        batches, live = self._batches, self._live
        self._batches = self._live = None
        if batches is None or _epoch_of(self.loader) != self._epoch:
            return iter(self.loader)
        return _chain(batches, live)

    @property
    def pending(self) -> int:
        """Borrowed batches not yet given back (0 once the first iteration started)."""
        return len(self._batches) if self._batches is not None else 0

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "_batches", "_live", "_epoch"):
            raise AttributeError(name)
        return getattr(self.loader, name)


def _chain(batches: List[Any], live: Iterator) -> Iterator[Any]:
    while batches:
        yield batches.pop(0)  # released as they are consumed
    yield from live


def borrow(loader: Any, count: int) -> "tuple[List[Any], ReplayLoader]":
    """Open ``loader``, take up to ``count`` batches; returns them and the :class:`ReplayLoader` to hand on."""
    epoch = _epoch_of(loader)
    live = iter(loader)
    batches: List[Any] = []
    for _ in range(count):
        try:
            batches.append(next(live))
        except StopIteration:
            break
    return batches, ReplayLoader(loader, batches, live, epoch)

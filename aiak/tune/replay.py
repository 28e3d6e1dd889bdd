"""The user's first batches, borrowed for the trials and given back: the loop sees every batch exactly once.

The trials (`aiak.tune.trials`) need real batches before the user's loop starts. They open the loader
(``iter(loader)``, exactly what the loop's first ``for`` would do), take a few batches, and hand the loader
on wrapped in a `ReplayLoader`: its first iteration yields the borrowed batches, then continues the
same open iterator. So the first epoch is the epoch the user's own ``for`` would have seen, same order,
same batches, none twice; later iterations are the loader's own.

That holds only while the batches are still what opening the loader would give at the first iteration.
The loader's draws depend on the random streams (`RandomStreams`: torch, Python's ``random``, NumPy,
the loader's generators) and on the sampler's epoch, so both are recorded when the batches are borrowed and
compared with the live ones at the first iteration:

* still as the borrowing found them (the trials put them back) or as it left them: the borrowed batches are
  given back, and the streams set to where drawing them left them, as if the loop had drawn them;
* changed since (the script reseeded, ``torch.manual_seed(0)`` before its loop; drew numbers of its own; or
  resumed, ``loader.sampler.set_epoch(n)``): the borrowed batches belong to another run. They are dropped
  and the loader is opened afresh from the live streams, as the script's loop would have opened it;
* untouched, but the loader draws from this process's streams for every batch (random augmentation in a
  ``num_workers=0`` dataset): replaying would move those draws ahead of the model's (dropout), so the
  streams are set back to where the borrowing found them and the loader is opened afresh. Seeing this
  takes two borrowed batches (the first one's draws include opening the sampler's order).

A loader that cannot be opened twice (a one-shot iterator) is always replayed: its batches exist only once.
"""
from __future__ import annotations

from typing import Any, Iterator, List, Optional, Tuple

import torch

from aiak.util.rng import GlobalRng


def _generators(loader: Any) -> List[torch.Generator]:
    """The loader's own generators (its sampler's, its batch sampler's), each once."""
    found = {}
    for obj in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
                getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        g = getattr(obj, "generator", None)
        if isinstance(g, torch.Generator):
            found[id(g)] = g
    return list(found.values())


def _epochs(loader: Any) -> Tuple[Optional[int], ...]:
    """The epoch of the loader's sampler and batch sampler (``set_epoch``), None where there is none."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    samplers = (getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None))
    return tuple(e if isinstance(e, int) else None for e in (getattr(s, "epoch", None) for s in samplers))


class RandomStreams:
    """Every random stream a training step or ``loader`` may draw from, as it is now: torch's CPU generator
    (and CUDA's, with ``cuda``), Python's ``random``, NumPy's global generator, the loader's own generators;
    and the sampler's epoch, which decides the order too (compared, never set back)."""

    def __init__(self, loader: Any, cuda: bool = False):
        self.cuda = cuda
        self.globals = GlobalRng(cuda)
        self.generators = _generators(loader)
        self.generator_states = [g.get_state() for g in self.generators]
        self.epochs = _epochs(loader)
        self.loader = loader

    def restore(self) -> None:
        """Set every random stream back to this state (the epoch is the script's: left as it is)."""
        self.globals.restore()
        for g, state in zip(self.generators, self.generator_states):
            g.set_state(state)

    def same_streams(self, other: "RandomStreams") -> bool:
        """Whether every random stream is in the same state in both (the epochs are not compared)."""
        return (self.globals.same_as(other.globals) and len(self.generator_states) == len(other.generator_states)
                and all(torch.equal(a, b) for a, b in zip(self.generator_states, other.generator_states)))

    def now(self) -> "RandomStreams":
        """The same streams as they are now."""
        return RandomStreams(self.loader, self.cuda)


class ReplayLoader:
    """``loader`` with ``batches`` (already drawn from the open iterator ``live``) put back in front, given
    back at the first iteration if the random streams and the epoch still allow it (see the module docstring).

    ``opened`` and ``drawn`` are the `RandomStreams` before the loader was opened and after the batches
    were drawn; ``per_batch_draws``: fetching a batch draws from this process's streams.
    Everything else (``len``, ``dataset``, ``sampler``, ``set_epoch``, ...) is the wrapped loader's.
    """

    def __init__(self, loader: Any, batches: List[Any], live: Iterator, opened: RandomStreams,
                 drawn: RandomStreams, per_batch_draws: bool):
        self.loader = loader
        self._batches: Optional[List[Any]] = list(batches)
        self._live: Optional[Iterator] = live
        self.opened, self.drawn = opened, drawn
        self.per_batch_draws = per_batch_draws

    def __iter__(self) -> Iterator[Any]:
        batches, live = self._batches, self._live
        self._batches = self._live = None
        if batches is None:
            return iter(self.loader)
        if live is self.loader:  # a one-shot iterator (``iter`` gives itself): its batches exist only once
            return _chain(batches, live)
        now = self.opened.now()
        untouched = now.same_streams(self.opened) or now.same_streams(self.drawn)
        if untouched and now.epochs == self.opened.epochs and not self.per_batch_draws:
            self.drawn.restore()
            return _chain(batches, live)
        del live  # the borrowed epoch is not the one the script's loop opens now: drop it (workers shut down)
        if untouched:
            self.opened.restore()
        return iter(self.loader)

    @property
    def pending(self) -> int:
        """Borrowed batches not yet given back (0 once the first iteration started)."""
        return len(self._batches) if self._batches is not None else 0

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "_batches", "_live", "opened", "drawn", "per_batch_draws"):
            raise AttributeError(name)
        return getattr(self.loader, name)


def _chain(batches: List[Any], live: Iterator) -> Iterator[Any]:
    while batches:
        yield batches.pop(0)  # released as they are consumed
    yield from live


def borrow(loader: Any, count: int, *, cuda: bool = False) -> "tuple[List[Any], ReplayLoader]":
    """Open ``loader``, take up to ``count`` batches; returns them and the `ReplayLoader` to hand on.

    The random streams are left where drawing the batches left them; ``cuda``: CUDA's generators are among
    the streams recorded."""
    opened = RandomStreams(loader, cuda)
    live = iter(loader)
    batches: List[Any] = []
    first: Optional[RandomStreams] = None
    for _ in range(count):
        try:
            batches.append(next(live))
        except StopIteration:
            break
        if first is None:
            first = opened.now()
    drawn = opened.now()
    per_batch_draws = first is not None and not first.same_streams(drawn)
    return batches, ReplayLoader(loader, batches, live, opened, drawn, per_batch_draws)

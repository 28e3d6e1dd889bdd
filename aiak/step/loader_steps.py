"""Which batch a step trains, and where an epoch ends: the batches the returned loader hands out, followed to the
steps the script takes.

A loop of "one batch, one backward, one ``step()``" trains the batches in the order the loader hands them out, and
its epoch's last batch is the last handed out. Other loops read the loader differently:

* an evaluation over the training loader between epochs (a ``no_grad`` loss) hands out a whole epoch and trains
  none of it;
* a prefetcher that reads one batch ahead (apex's ImageNet ``data_prefetcher``) hands out batch k+1 before the
  step of batch k, and the epoch's last batch before the step of the one before it;
* a script that builds a new ``DataLoader`` each epoch, after giving the first to ``aiak.optimize``, trains batches
  the returned loader never handed out;
* a loop that breaks out early trains fewer batches than the epoch holds.

Closing windows and counting items at hand-out shifted every window of such a script (a window of 1 then 3 where
timm's rule gives 3 then 1). So `LoaderSteps` follows the steps:

* **An epoch is the loader's length in steps.** The returned loader's ``len()`` is N batches (alike on every
  rank); the script's N-th ``step()`` of an epoch closes the accumulation window, whatever else read the loader.
* **Where an epoch starts.** Each iteration of the loader (each ``for batch in loader``) is numbered. An epoch
  belongs to the iteration that handed out the batch of its first step. A step that trains a batch of another
  iteration while the epoch's own is over (exhausted, or left by a ``break``) and fewer than N steps were taken
  means the epoch ended early: said once, and this step starts the next epoch. An iteration that hands out
  batches and trains none (an evaluation) does not move the count.
* **Which batch a step trains.** Each iteration keeps what it handed out and no step trained yet, in order; a step
  trains the oldest batch of the iteration that handed out last among those still going (an evaluation over the
  training loader between a backward and its step is over by the step), or, when all are over, of the one that
  handed out last (a prefetcher read past the epoch's end before its last steps). With ``count_items=fn`` each
  batch's count is kept with it, so a backward is weighed by the items of the batch it trains, not of the batch
  handed out last. A step when that iteration has nothing left trained a batch the loader did not hand out (a
  loader built after ``optimize()``): steps still count N per epoch, said once; with ``count_items=fn`` that batch
  has no count, which is an error naming the way out (count it yourself with ``count_items=True``).
* **An early end moves a window's end.** When an epoch ends early, the step that closes a window may be one whose
  backward DDP did not synchronise (it was to be a micro-step); the controller then averages the gradients over the
  ranks itself before stepping.

Everything here is plain bookkeeping in one process: every rank runs the same loop, so every rank closes its windows
at the same steps.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, Dict, Optional, Set, Tuple

from aiak.util.warn import warn_once

_NO_COUNT = object()  # what a batch handed out without a count function carries


class LoaderSteps:
    """The returned loader's batches followed to the script's steps (see the module docstring): the loader calls
    `follow_epochs`, `iteration_started`, `handed_out` and `iteration_ended`; the step controller `begin_step`,
    `step_done`, `closes_window` and `coming`."""

    def __init__(self, counts: bool, count_changed: Optional[Callable[[], None]] = None):
        self.counts = counts                    # each batch carries a count (count_items=fn)
        self._count_changed = count_changed     # told at each batch handed out (the coming count may change)
        self.batches: Optional[int] = None      # N: the batches (steps) of an epoch; None: windows run on
        self.epoch_steps = 0                    # steps of the current epoch taken
        self._epoch_iteration: Optional[int] = None  # the iteration the current epoch's steps train batches of
        self._handed: Dict[int, int] = {}       # iteration -> when it last handed out a batch (a running number)
        self._queues: Dict[int, Deque[Any]] = {}  # iteration -> its batches handed out and not yet trained
        self._ended: Set[int] = set()           # iterations that are over
        self._iterations = 0
        self._handed_out = 0                    # batches handed out so far (orders the iterations)

    # -- the loader's side ------------------------------------------------------------------------------------
    def follow_epochs(self, batches: Optional[int]) -> None:
        """An epoch of the loader holds ``batches`` batches (None: unknown, windows run on)."""
        self.batches = batches

    def iteration_started(self) -> int:
        self._iterations += 1
        self._queues[self._iterations] = deque()
        return self._iterations

    def handed_out(self, iteration: int, count: Any = _NO_COUNT) -> None:
        """Iteration ``iteration`` hands out a batch (with its count under ``count_items=fn``)."""
        queue = self._queues.get(iteration)
        if queue is None:  # (its queue was dropped: the iteration went on after a step of another one)
            queue = self._queues[iteration] = deque()
        self._handed_out += 1
        queue.append((self._handed_out, count))
        self._handed[iteration] = self._handed_out
        if self._count_changed is not None:
            self._count_changed()

    def iteration_ended(self, iteration: int) -> None:
        if iteration in self._handed:
            self._ended.add(iteration)
        else:  # (it handed out nothing)
            self._queues.pop(iteration, None)

    # -- the step controller's side ----------------------------------------------------------------------------
    def _training(self) -> Optional[int]:
        """The iteration whose batches the steps train now (see the module docstring)."""
        going = [i for i in self._handed if i not in self._ended]
        return max(going or self._handed, key=self._handed.__getitem__, default=None)

    def coming(self) -> Tuple[Optional[int], Any]:
        """``(number, count)`` of the batch the coming backward trains (the oldest its iteration handed out and no
        step trained), or ``(None, None)``."""
        training = self._training()
        queue = self._queues.get(training) if training is not None else None
        if not queue or queue[0][1] is _NO_COUNT:
            return None, None
        return queue[0]

    def closes_window(self) -> bool:
        """The coming step is its epoch's last."""
        return self.batches is not None and self.epoch_steps == self.batches - 1

    def begin_step(self) -> None:
        """A ``step()`` comes: an epoch that ended early (its iteration over, fewer than N steps taken, and this
        step training a batch of another iteration) gives way to a new one; a batch the loader did not hand out is
        said once, or refused under ``count_items=fn``."""
        latest = self._training()
        queue = self._queues.get(latest) if latest is not None else None
        if not queue:
            if self.counts:
                raise RuntimeError(
                    "aiak: count_items=fn counts the batches of the loader aiak.optimize returned, and this step "
                    "trained a batch that loader did not hand out (a DataLoader built after optimize(), or a batch "
                    "of the script's own): its items are unknown. Iterate the returned loader every epoch, or pass "
                    "count_items=True to aiak.optimize and call aiak.count_items(optimizer, n) before each backward")
            if self.batches is not None:
                warn_once("foreign-batches",
                          f"aiak: a step trained a batch the loader given to aiak.optimize did not hand out (a loader "
                          f"built after optimize()?): accumulation windows go on closing every {self.batches} steps, "
                          "that loader's epoch. Iterate the loader aiak.optimize returned each epoch, so windows close "
                          "where your epochs end")
            return
        if (self.batches is not None and self.epoch_steps > 0 and latest != self._epoch_iteration
                and self._epoch_iteration in self._ended):
            warn_once("epoch-ended-early",
                      f"aiak: an epoch of the loader ended after {self.epoch_steps} steps where its len() holds "
                      f"{self.batches} batches (the loop left it early?): the accumulation window open there runs on "
                      "into the next epoch, whose steps are counted from here")
            self.epoch_steps = 0
        if self.epoch_steps == 0 or self._epoch_iteration is None:
            self._epoch_iteration = latest

    def step_done(self) -> None:
        """The step trained the oldest batch of the last iteration; an epoch of N steps is complete."""
        latest = self._training()
        queue = self._queues.get(latest) if latest is not None else None
        if queue:
            queue.popleft()
        for other in [i for i in self._handed if i != latest and i in self._ended]:
            self._queues.pop(other, None)  # an evaluation's batches, or an epoch's over: no step will train them
            del self._handed[other]
            self._ended.discard(other)
        self.epoch_steps += 1
        if self.batches is not None and self.epoch_steps >= self.batches:
            self.epoch_steps = 0

    def state_dict(self) -> Dict[str, int]:
        return {"epoch_steps": self.epoch_steps}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """A run resumed inside an epoch: its steps so far (the iteration it started is not known any more)."""
        self.epoch_steps = int(state.get("epoch_steps", 0))
        self._epoch_iteration = None

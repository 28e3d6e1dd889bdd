"""What a DDP gradient bucket holds, and the first step of a resumed run run on the buckets the saved run had.

DDP packs a bucket's gradients back to back. It builds its buckets once in parameter order (one bucket of every
parameter of a dtype, unless ``find_unused_parameters``) and rebuilds them after the first iteration in the order
the gradients became ready. State a hook keeps per bucket from step to step (aiak's int8 error-feedback residuals,
PowerSGD's residuals and factors) holds values of particular parameters at particular offsets: it belongs to the
bucket's *layout* (`bucket_layout`), not to its index.

A resumed run's DDP starts from its initial buckets again, so the buckets of its first step are not those the saved
state was computed on. `BucketRecord` remembers the layout of every bucket a hook ran, travels in the
checkpoint, and on the first step after a checkpoint was loaded cuts each bucket into the recorded buckets it holds:
each is gathered into a buffer of its own in its recorded order and run as the saved run ran it (same offsets, so
the same values on the wire and the same residuals added to them), and the results are written back into the
bucket. From the next step on DDP's rebuilt buckets are the recorded ones again, and the resumed run continues bit
for bit.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

Layout = Tuple[Tuple[int, Tuple[int, ...]], ...]


class ParameterNumbers:
    """Small integers naming parameters, in the order they are first asked for.

    A parameter keeps its number for its lifetime; the numbers depend neither on ``id`` (reused once a tensor is
    freed) nor on storage addresses (which move with ``.to()``). Number a model's parameters in module order first
    (`number`) and a layout means the same in a resumed run. Parameters are held weakly: a state never keeps a
    model alive.
    """

    __slots__ = ("_numbers", "_next")

    def __init__(self):
        self._numbers = WeakIdKeyDictionary()
        self._next = 0

    def __call__(self, p: torch.Tensor) -> int:
        number = self._numbers.get(p)
        if number is None:
            number = self._numbers[p] = self._next
            self._next += 1
        return number

    def number(self, module: torch.nn.Module) -> "ParameterNumbers":
        """Number ``module``'s parameters in module order (those numbered already keep their numbers)."""
        for p in module.parameters():
            self(p)
        return self


def bucket_layout(bucket: dist.GradBucket, numbers: ParameterNumbers) -> Layout:
    """``((parameter number, shape), ...)`` in bucket order: which parameters a DDP gradient bucket holds, in which
    order, and so at which offsets. Two buckets of one size can differ here: DDP rebuilds its buckets after the
    first iteration, in the order gradients became ready."""
    return tuple((numbers(p), tuple(p.shape)) for p in bucket.parameters())


class RecordedBucket:
    """A bucket of a recorded layout, as a hook reads a DDP bucket: a flat buffer of the given gradients, back to
    back, and its gradients as views of it."""

    def __init__(self, index: int, gradients: List[torch.Tensor], is_last: bool):
        self._index, self._is_last = index, is_last
        self._buffer = torch.cat([g.reshape(-1) for g in gradients])
        self._views, offset = [], 0
        for g in gradients:
            self._views.append(self._buffer[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> List[torch.Tensor]:
        return self._views

    def is_last(self) -> bool:
        return self._is_last


RunOne = Callable[[Any, Layout], torch.futures.Future]  # (a bucket or a RecordedBucket, its layout) -> its future


class BucketRecord:
    """The layout of each bucket a hook has run, by bucket index, and the replay of a resumed run's first step.

    A hook hands every bucket to `run` with its layout and a ``run_one(bucket, layout)`` that averages one
    bucket (and keeps its state under ``bucket.index()``). ``forget(index)`` is called when bucket ``index`` now holds
    another layout than the state kept under that index was computed on.
    """

    __slots__ = ("layouts", "resuming")

    def __init__(self):
        self.layouts: Dict[int, Layout] = {}
        self.resuming = False  # a checkpoint was loaded and its first step has not run yet

    def run(self, bucket, layout: Layout, run_one: RunOne,
            forget: Optional[Callable[[int], None]] = None) -> torch.futures.Future:
        parts = self._recorded_parts(bucket.index(), layout) if self.resuming else None
        if bucket.is_last():
            self.resuming = False
        if parts is not None:
            return self._as_recorded(bucket, layout, parts, run_one)
        if forget is not None and self.layouts.get(bucket.index(), layout) != layout:
            forget(bucket.index())
        self.layouts[bucket.index()] = layout
        return run_one(bucket, layout)

    def _recorded_parts(self, index: int, layout: Layout) -> Optional[List[int]]:
        """The recorded buckets that together hold exactly the parameters of ``layout`` (a bucket of the first step
        after a checkpoint was loaded, when it is not a recorded bucket itself), in index order; else ``None``."""
        if not self.layouts or self.layouts.get(index) == layout:
            return None
        mine = sorted(n for n, _ in layout)
        members = set(mine)
        parts = [i for i in sorted(self.layouts) if all(n in members for n, _ in self.layouts[i])]
        if sorted(n for i in parts for n, _ in self.layouts[i]) != mine:
            return None
        return parts

    def _as_recorded(self, bucket, layout: Layout, parts: List[int], run_one: RunOne) -> torch.futures.Future:
        """Run ``bucket`` as the recorded buckets ``parts``: each gathered into a buffer of its own in its recorded
        order, run in index order; the results written back into ``bucket``'s gradients."""
        grads = {number: g for (number, _), g in zip(layout, bucket.gradients())}
        pieces = [RecordedBucket(i, [grads[n] for n, _ in self.layouts[i]], is_last=bucket.is_last() and i == parts[-1])
                  for i in parts]
        futures = [run_one(piece, self.layouts[piece.index()]) for piece in pieces]

        def scatter(done: torch.futures.Future) -> torch.Tensor:
            for piece, fut in zip(pieces, done.value()):
                fut.value()  # raises what that piece raised
                for i, (n, _) in enumerate(self.layouts[piece.index()]):
                    grads[n].copy_(piece.gradients()[i])
            return bucket.buffer()

        return torch.futures.collect_all(futures).then(scatter)

    # -- checkpoints -------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[int, Layout]:
        return dict(self.layouts)

    def load_state_dict(self, layouts: Dict[int, Layout]) -> None:
        self.layouts = {int(i): tuple((int(n), tuple(shape)) for n, shape in layout) for i, layout in layouts.items()}
        self.resuming = bool(self.layouts)

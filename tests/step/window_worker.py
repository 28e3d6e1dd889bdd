"""One rank of the multi-rank tests of windows that close with the epoch and windows averaged by items
(``tests/step/test_window_ends_and_items.py``), launched as torchrun would by ``tests/comm/conftest.launch``.

``AIAK_TEST_STRATEGY``: the strategy as JSON; ``AIAK_TEST_COUNT``: ``fn`` (count_items=fn), ``none``.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.comm.dist_worker import main  # noqa: E402
from tests.step import window_data  # noqa: E402


def _strategy():
    return json.loads(os.environ.get("AIAK_TEST_STRATEGY", "{}"))


def scenario_items(rank):
    """Each rank trains on its own variable-length micro-batches, counted by the loader (or not)."""
    import aiak

    world = dist.get_world_size()
    model = window_data.token_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    batches = window_data.rank_batches(rank, world)
    count = window_data.count_tokens if os.environ.get("AIAK_TEST_COUNT") == "fn" else None
    model, opt, loader = aiak.optimize(model, opt, batches, strategy=_strategy(), count_items=count)
    for batch in loader:
        window_data.token_loss(model, batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), float(os.environ.get("AIAK_TEST_CLIP", "1e9")))
        opt.step()
        opt.zero_grad()
    bare = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return {k: v.clone() for k, v in bare.state_dict().items()}


def scenario_items_framework_ddp(rank):
    """A DDP built without aiak's hook (as Lightning builds its own) under a step controller: the items are summed
    over its process group."""
    import aiak
    from aiak.step.controller import StepController

    world = dist.get_world_size()
    model = window_data.token_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    controller = StepController(opt, 4, model=model)
    controller.attach_ddp(ddp)
    for batch in window_data.rank_batches(rank, world):
        aiak.count_items(opt, window_data.count_tokens(batch))
        window_data.token_loss(ddp, batch).backward()
        opt.step()
        opt.zero_grad()
    assert controller.comm_state is None
    return {k: v.clone() for k, v in model.state_dict().items()}


def scenario_epochs(rank):
    """Two epochs of a DistributedSampler's shards, 10 batches per rank and epoch, accumulation 4."""
    import aiak

    world = dist.get_world_size()
    model = window_data.image_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    sampler = torch.utils.data.DistributedSampler(window_data.samples(), num_replicas=world, rank=rank, seed=3)
    loader = torch.utils.data.DataLoader(window_data.samples(), batch_size=2, sampler=sampler)
    model, opt, loader = aiak.optimize(model, opt, loader, strategy=_strategy())
    stepped_at_epoch_end = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        stepped_at_epoch_end.append(aiak.stepped(opt))
    return {"state": {k: v.clone() for k, v in model.module.state_dict().items()},
            "stepped": stepped_at_epoch_end}


def scenario_equal_counts(rank):
    """Micro-batches counted alike and not counted, under the strategy's comm algorithm. ``AIAK_TEST_NODE_COUNTS``:
    each node counts its own number (alike inside a node), so only a sum over the ranks the algorithm averages
    gradients over (a node for local SGD, the rank itself for decentralized SGD) leaves the result unchanged."""
    import aiak

    per_node = os.environ.get("AIAK_TEST_NODE_COUNTS") == "1"
    items = 2 * (rank // 2 + 1) if per_node else 2  # per node: 2 on node 0, 4 on node 1
    out = {}
    for counted in (False, True):
        model = window_data.image_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        g = torch.Generator().manual_seed(rank)
        batches = [(torch.randn(2, 6, generator=g), torch.randint(0, 3, (2,), generator=g)) for _ in range(12)]
        model, opt, loader = aiak.optimize(model, opt, batches, strategy=_strategy(),
                                           count_items=(lambda b: items) if counted else None)
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        out[counted] = {k: v.clone() for k, v in model.module.state_dict().items()}
    return out


def scenario_unequal(rank):
    """The last rank's loader has one batch fewer: optimize() refuses on every rank, naming the lengths."""
    import aiak

    world = dist.get_world_size()
    batches = window_data.rank_batches(rank, world)[: 8 - (rank == world - 1)]
    model = window_data.token_model()
    try:
        aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), batches,
                      strategy={"grad_accumulation": 4, "tune": False})
    except ValueError as e:
        return {"error": str(e), "wrapped": isinstance(model, nn.parallel.DistributedDataParallel)}
    return {"error": None}


class _ReadAhead:
    """apex's ImageNet ``data_prefetcher`` shape: reads the loader one batch ahead (``next()`` returns the batch read
    before and reads the following one), None at the end."""

    def __init__(self, loader):
        self.batches = iter(loader)
        self._read()

    def _read(self):
        self.ahead = next(self.batches, None)

    def next(self):
        batch = self.ahead
        if batch is not None:
            self._read()
        return batch


def scenario_loops(rank):
    """`one_loop` for each ``loop:count`` of ``AIAK_TEST_LOOPS`` (comma-separated), in this order."""
    return {case: one_loop(rank, *case.split(":")) for case in os.environ["AIAK_TEST_LOOPS"].split(",")}


def one_loop(rank, loop, count_with):
    """Two epochs of 10 token batches per rank, accumulation 4 (windows 4, 4, 2), counted or not, trained by loops
    that read the returned loader other than "one batch, one step" (``loop``), counted by ``count_with`` (``fn``) or
    not (``none``):

    * ``eval``: before the second epoch, a ``no_grad`` pass over the training loader (it hands out a whole epoch);
    * ``ahead``: each epoch through `_ReadAhead` (batch k+1 handed out before the step of batch k);
    * ``fresh``: the second epoch from a new list the script made, not the returned loader;
    * ``own``: the script accumulates itself (``grad_accumulation: 1``, ``no_sync`` on 3 of 4 backward passes) and
      calls ``aiak.count_items`` before each backward.

    Returns the weights, the warnings said and the error raised, if any."""
    import warnings

    import aiak

    world = dist.get_world_size()
    counted = count_with == "fn"
    model = window_data.token_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    batches = window_data.rank_batches(rank, world, n=10)
    strategy = {**_strategy(), "grad_accumulation": 1 if loop == "own" else 4}
    count = (True if loop == "own" else window_data.count_tokens) if counted else None
    model, opt, loader = aiak.optimize(model, opt, batches, strategy=strategy, count_items=count)

    def train(batch, i):
        if loop == "own":
            if counted:
                aiak.count_items(opt, window_data.count_tokens(batch))
            last = i % 4 == 3 or i == 9
            window = 4 if i < 8 else 2  # uncounted: the script divides by its window's micro-batches
            with (contextlib.nullcontext() if last else model.no_sync()):
                (window_data.token_loss(model, batch) / (1 if counted else window)).backward()
            if last:
                opt.step()
                opt.zero_grad()
            return
        window_data.token_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()

    error = None
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            for epoch in range(2):
                if loop == "eval" and epoch == 1:
                    with torch.no_grad():
                        for batch in loader:
                            window_data.token_loss(model, batch)
                if loop == "ahead":
                    reader, i = _ReadAhead(loader), 0
                    batch = reader.next()
                    while batch is not None:
                        train(batch, i)
                        batch, i = reader.next(), i + 1
                else:
                    for i, batch in enumerate(list(batches) if loop == "fresh" and epoch == 1 else loader):
                        train(batch, i)
        except RuntimeError as e:
            error = str(e)
    return {"state": {k: v.clone() for k, v in model.module.state_dict().items()}, "error": error,
            "said": [str(w.message) for w in said if "aiak" in str(w.message)]}


if __name__ == "__main__":
    main(globals())

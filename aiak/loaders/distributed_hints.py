"""A distributed run whose loader gives every rank the whole dataset: said once, on rank 0.

Under DDP each rank must see its own shard (``DistributedSampler``, or aiak's ``BalancedBatchSampler``); a plain
``DataLoader(dataset, shuffle=True)`` makes every rank train on all the data, so an epoch does world-size times
the work and the gradients average near-duplicate batches, with no error anywhere (seen on 2 gloo
ranks). aiak warns rather than shards the loader itself: sharding changes ``len(loader)``, hence the number of
steps, the epoch boundary and any schedule the user computed from it, and it needs ``set_epoch`` each epoch
to reshuffle, which only the user's loop can call.
"""
from __future__ import annotations

from typing import Any

from torch.utils.data import DistributedSampler, IterableDataset

from aiak.loaders.balanced_sampler import BalancedBatchSampler
from aiak.util.dist import is_distributed, world_size
from aiak.util.warn import warn_once


def _shards(sampler: Any) -> bool:
    return isinstance(sampler, (DistributedSampler, BalancedBatchSampler)) or (
        getattr(sampler, "num_replicas", 1) > 1)  # a sampler of the user's that says it is one rank's share


def loader_is_unsharded(loader: Any) -> bool:
    """``loader`` is a map-style ``DataLoader``-like object whose sampler and batch sampler are not per-rank.

    Loaders whose sharding cannot be seen (an ``IterableDataset``, which shards inside ``__iter__``; any iterable
    without a ``sampler``) count as sharded: no warning can be given about them without false alarms.
    """
    if isinstance(getattr(loader, "dataset", None), IterableDataset):
        return False
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    if sampler is None and batch_sampler is None:
        return False
    candidates = [sampler, batch_sampler, getattr(batch_sampler, "sampler", None)]
    return not any(_shards(s) for s in candidates if s is not None)


def warn_if_unsharded(loader: Any) -> bool:
    """Warn once (rank 0) when a process group of more than one rank exists and ``loader`` is not sharded."""
    if loader is None or not is_distributed():
        return False
    if not loader_is_unsharded(loader):
        return False
    world = world_size()
    return warn_once("unsharded-loader",
                     f"aiak: the loader has no DistributedSampler, so each of the {world} ranks iterates the whole "
                     f"dataset (every epoch does {world}x the work on duplicated batches). Build it with "
                     "DataLoader(dataset, sampler=torch.utils.data.DistributedSampler(dataset), ...) and call "
                     "sampler.set_epoch(epoch) each epoch, or use aiak's balanced sampler (loader: {balanced: true}).")

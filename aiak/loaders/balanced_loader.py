"""Rebuild a user's ``DataLoader`` around a `BalancedBatchSampler` that follows the user's sampler.

``loader.balanced: true`` replaces the loader's batches, not its epochs: every epoch must still be shuffled
as the user's own sampler would have shuffled it (a ``DistributedSampler``'s seed and ``set_epoch``, a
``RandomSampler``'s generator or torch's global RNG), and ``set_epoch`` must reach the plan through every
handle the user may hold: the sampler object they built, the returned loader, its ``sampler`` and its
``batch_sampler``.
"""
from __future__ import annotations

import logging
from typing import Any, List, Optional

import torch
from torch.utils.data import (BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler,
                              SequentialSampler)

from aiak.loaders.balanced_sampler import BalancedBatchSampler
from aiak.util.warn import warn

logger = logging.getLogger("aiak")


class BalancedDataLoader(DataLoader):
    """A ``DataLoader`` whose batches come from a `BalancedBatchSampler` following the user's sampler.

    ``batch_sampler`` is the balanced sampler. ``sampler`` stays the user's own sampler object (what the
    balanced plan follows), and the loader has ``set_epoch`` too, so ``sampler.set_epoch(e)``,
    ``loader.set_epoch(e)``, ``loader.sampler.set_epoch(e)`` and ``loader.batch_sampler.set_epoch(e)`` all set
    one and the same epoch.
    """

    @property
    def sampler(self):
        follow = self.batch_sampler.follow
        return follow if follow is not None else self.__dict__["_unused_sampler"]

    @sampler.setter
    def sampler(self, value) -> None:
        # DataLoader.__init__ assigns its default SequentialSampler here; with a batch_sampler it is never used.
        self.__dict__["_unused_sampler"] = value

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the balanced plan, and of the user's ``DistributedSampler`` it follows."""
        self.batch_sampler.set_epoch(epoch)


def sample_lengths(dataset: Any) -> Optional[List[int]]:
    """Lengths of a map-style dataset's samples, or None when they cannot be measured.

    Rule: ``dataset.lengths`` (a sequence, or a method returning one) if present; otherwise every sample is
    read once and measured: a tensor by its first dimension, a dict by ``input_ids`` (else its first value),
    a tuple/list by its first element (``(tokens, label)``), anything else by ``len()``.
    """
    declared = getattr(dataset, "lengths", None)
    if declared is not None:
        declared = declared() if callable(declared) else declared
        return [int(n) for n in declared]
    try:
        count = len(dataset)
    except TypeError:
        return None
    try:
        lengths = [sample_length(dataset[i]) for i in range(count)]
    except Exception:  # unmeasurable samples: the caller skips balancing with a warning
        return None
    logger.info("aiak loader.balanced: read %d samples once to measure their lengths; give the dataset a "
                "`lengths` attribute to skip this", count)
    return lengths


def sample_length(sample: Any) -> int:
    """The length of one sample, by the rule of `sample_lengths` (raises when it has none)."""
    if isinstance(sample, torch.Tensor):
        return int(sample.shape[0]) if sample.dim() else 1
    if isinstance(sample, dict):
        sample = sample["input_ids"] if "input_ids" in sample else next(iter(sample.values()))
        return sample_length(sample)
    if isinstance(sample, (tuple, list)) and sample and hasattr(sample[0], "__len__"):
        return sample_length(sample[0])
    return len(sample)


def balance_loader(loader: Any, *, rank: Optional[int] = None, world_size: Optional[int] = None,
                   max_tokens: Optional[int] = None) -> Any:
    """Rebuild a ``DataLoader`` as a `BalancedDataLoader`; keep every other setting.

    Applies to a ``torch.utils.data.DataLoader`` over a map-style dataset with a fixed ``batch_size`` and the
    default sampler (random without replacement, sequential, or ``DistributedSampler``), whose samples have
    lengths (`sample_lengths`) that are not all equal. Otherwise it logs a warning naming the reason and
    returns ``loader`` unchanged (an already balanced loader is returned as it is). Rank and world size come
    from a ``DistributedSampler``, else the initialized process group, else a single process. Each epoch is
    shuffled as the original sampler would have shuffled it (see ``BalancedBatchSampler``'s ``follow``).
    ``max_tokens`` switches to token-budget batches (padded tokens per rank per step; the loader's
    ``batch_size`` is then not used).
    """
    def skip(reason: str) -> Any:
        warn(f"aiak loader.balanced: skipped, {reason}")
        return loader

    if isinstance(loader, BalancedDataLoader):
        return loader
    if not isinstance(loader, DataLoader):
        return skip(f"the loader is a {type(loader).__name__}, not a torch DataLoader")
    if isinstance(loader.dataset, IterableDataset):
        return skip("the dataset is an IterableDataset (no random access to bucket by length)")
    if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        return skip("the DataLoader uses a custom batch_sampler (or batch_size=None); aiak will not replace it")
    sampler = loader.sampler
    if not isinstance(sampler, (RandomSampler, SequentialSampler, DistributedSampler)):
        return skip(f"the DataLoader uses a custom sampler ({type(sampler).__name__}); aiak will not replace it")
    if isinstance(sampler, RandomSampler) and (sampler.replacement or sampler.num_samples != len(loader.dataset)):
        return skip(f"the DataLoader's RandomSampler draws with replacement or num_samples={sampler.num_samples} "
                    f"of {len(loader.dataset)}; a balanced epoch uses every sample once")
    lengths = sample_lengths(loader.dataset)
    if lengths is None:
        return skip("sample lengths are unknown: give the dataset a `lengths` attribute (one int per sample)")
    if len(lengths) != len(loader.dataset):
        return skip(f"dataset.lengths has {len(lengths)} entries for {len(loader.dataset)} samples")
    if len(set(lengths)) <= 1:
        return skip("all samples have the same length, balancing would change nothing")
    if max_tokens is not None and max(lengths) > max_tokens:
        return skip(f"max_tokens={max_tokens} is smaller than the longest sample ({max(lengths)} tokens)")
    batch_sampler = BalancedBatchSampler(lengths, None if max_tokens else loader.batch_size, max_tokens=max_tokens,
                                         num_replicas=world_size, rank=rank, drop_last=loader.drop_last,
                                         follow=sampler)
    if isinstance(sampler, RandomSampler) and batch_sampler.num_replicas > 1:
        logger.info("aiak loader.balanced: a RandomSampler on %d ranks: all ranks deal from one order per epoch "
                    "(seed 0, reshuffled every epoch); use DistributedSampler(dataset, seed=s) to choose the seed",
                    batch_sampler.num_replicas)
    kwargs = dict(num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                  timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                  multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
                  persistent_workers=loader.persistent_workers,
                  pin_memory_device=getattr(loader, "pin_memory_device", ""))
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if hasattr(loader, "in_order"):
        kwargs["in_order"] = loader.in_order
    rebuilt = BalancedDataLoader(loader.dataset, batch_sampler=batch_sampler, **kwargs)
    logger.info("aiak loader.balanced: %d length-balanced batches per rank (rank %d of %d), was %d",
                len(rebuilt), batch_sampler.rank, batch_sampler.num_replicas, len(loader))
    return rebuilt

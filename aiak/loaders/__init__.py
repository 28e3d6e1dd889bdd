"""Loaders: background prefetching with host-to-device overlap, a DALI image pipeline, length-balanced batches.

``wrap_loader`` is what ``aiak.optimize`` calls to apply a strategy's ``loader:`` section; every piece is also
usable on its own. Importing this package needs only torch (DALI is imported inside ``dali_loader``).
"""
from __future__ import annotations

import logging
from typing import Any, List, Optional

import torch

from aiak.loaders.balance import BalancedBatchSampler, PadCollate, tokens_per_rank
from aiak.loaders.dali import DaliLoader, dali_loader
from aiak.loaders.prefetch import PrefetchLoader

__all__ = ["PrefetchLoader", "dali_loader", "DaliLoader", "BalancedBatchSampler", "PadCollate", "tokens_per_rank",
           "balance_loader", "sample_lengths", "wrap_loader"]

logger = logging.getLogger("aiak")


def wrap_loader(loader: Any, cfg: Any, device: Any, *, channels_last: bool = False) -> Any:
    """Apply a ``LoaderConfig`` (``prefetch``, ``pin_memory``, ``balanced``) to the user's loader and return it.

    * ``balanced``: a torch ``DataLoader`` over variable-length samples is rebuilt around a
      :class:`BalancedBatchSampler` (see :func:`balance_loader` for when it applies); otherwise a warning says
      why and the loader is kept.
    * ``prefetch > 0``: the result is wrapped in a :class:`PrefetchLoader` of that depth moving batches to
      ``device`` (pinned, side-stream copies on CUDA; ``channels_last`` 4-D float batches if asked).
      An existing ``PrefetchLoader`` is unwrapped first, never stacked.
    * ``pin_memory`` only matters with a CUDA device; elsewhere a warning says it is skipped.

    Keys a later schema may add are read when present: ``max_tokens`` (token budget per rank for ``balanced``),
    ``mean`` / ``std`` (on-device normalization of uint8 NCHW images by the prefetcher).
    ``loader=None`` returns None.
    """
    if loader is None:
        return None
    device = torch.device(device) if device is not None else torch.device("cpu")
    if isinstance(loader, PrefetchLoader):
        loader = loader.loader
    if cfg.balanced:
        loader = balance_loader(loader, max_tokens=getattr(cfg, "max_tokens", None))
    if cfg.pin_memory and device.type != "cuda":
        logger.warning("aiak loader.pin_memory: skipped, the device is %s (pinning only speeds up copies to CUDA)",
                       device)
    mean, std = getattr(cfg, "mean", None), getattr(cfg, "std", None)
    if cfg.prefetch > 0:
        loader = PrefetchLoader(loader, device, depth=cfg.prefetch, pin_memory=cfg.pin_memory,
                                channels_last=channels_last, mean=mean, std=std)
    elif mean is not None:
        logger.warning("aiak loader.mean/std: skipped, normalization happens in the prefetcher (loader.prefetch >= 1)")
    return loader


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

    def measure(sample: Any) -> int:
        if isinstance(sample, torch.Tensor):
            return int(sample.shape[0]) if sample.dim() else 1
        if isinstance(sample, dict):
            sample = sample["input_ids"] if "input_ids" in sample else next(iter(sample.values()))
            return measure(sample)
        if isinstance(sample, (tuple, list)) and sample and hasattr(sample[0], "__len__"):
            return measure(sample[0])
        return len(sample)

    try:
        lengths = [measure(dataset[i]) for i in range(count)]
    except Exception:  # unmeasurable samples: the caller skips balancing with a warning
        return None
    logger.info("aiak loader.balanced: read %d samples once to measure their lengths; give the dataset a "
                "`lengths` attribute to skip this", count)
    return lengths


def balance_loader(loader: Any, *, rank: Optional[int] = None, world_size: Optional[int] = None,
                   max_tokens: Optional[int] = None) -> Any:
    """Rebuild a ``DataLoader`` with a :class:`BalancedBatchSampler`; keep every other setting.

    Applies to a ``torch.utils.data.DataLoader`` over a map-style dataset with a fixed ``batch_size`` and the
    default sampler (random, sequential or ``DistributedSampler``), whose samples have lengths
    (:func:`sample_lengths`) that are not all equal. Otherwise it logs a warning naming the reason and returns
    ``loader`` unchanged. Rank and world size come from a ``DistributedSampler``, else the initialized process
    group, else a single process; shuffling and seed follow the original sampler. ``max_tokens`` switches to
    token-budget batches (padded tokens per rank per step; the loader's ``batch_size`` is then not used).
    """
    from torch.utils.data import (BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler)
    from torch.utils.data.distributed import DistributedSampler

    def skip(reason: str) -> Any:
        logger.warning("aiak loader.balanced: skipped, %s", reason)
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
    lengths = sample_lengths(loader.dataset)
    if lengths is None:
        return skip("sample lengths are unknown: give the dataset a `lengths` attribute (one int per sample)")
    if len(lengths) != len(loader.dataset):
        return skip(f"dataset.lengths has {len(lengths)} entries for {len(loader.dataset)} samples")
    if len(set(lengths)) <= 1:
        return skip("all samples have the same length, balancing would change nothing")
    if isinstance(sampler, DistributedSampler):
        rank = sampler.rank if rank is None else rank
        world_size = sampler.num_replicas if world_size is None else world_size
        shuffle, seed = sampler.shuffle, sampler.seed
    else:
        shuffle, seed = isinstance(sampler, RandomSampler), 0
    if max_tokens is not None and max(lengths) > max_tokens:
        return skip(f"max_tokens={max_tokens} is smaller than the longest sample ({max(lengths)} tokens)")
    batch_sampler = BalancedBatchSampler(lengths, None if max_tokens else loader.batch_size, max_tokens=max_tokens,
                                         num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                         drop_last=loader.drop_last)
    kwargs = dict(num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                  timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                  multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
                  persistent_workers=loader.persistent_workers,
                  pin_memory_device=getattr(loader, "pin_memory_device", ""))
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if hasattr(loader, "in_order"):
        kwargs["in_order"] = loader.in_order
    rebuilt = DataLoader(loader.dataset, batch_sampler=batch_sampler, **kwargs)
    logger.info("aiak loader.balanced: %d length-balanced batches per rank (rank %d of %d), was %d",
                len(rebuilt), batch_sampler.rank, batch_sampler.num_replicas, len(loader))
    return rebuilt

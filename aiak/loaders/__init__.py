"""Loaders: background prefetching with host-to-device overlap, a DALI image pipeline, length-balanced batches.

``wrap_loader`` is what ``aiak.optimize`` calls to apply a strategy's ``loader:`` section; every piece is also
usable on its own. Importing this package needs only torch (DALI is imported inside ``dali_loader``).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from aiak.loaders.balanced_sampler import BalancedBatchSampler, PadCollate, tokens_per_rank
from aiak.loaders.balanced_loader import BalancedDataLoader, balance_loader, sample_lengths
from aiak.loaders.dali import DaliLoader, dali_loader
from aiak.loaders.prefetch import PrefetchLoader
from aiak.loaders.window_loader import WindowLoader, check_epochs_alike
from aiak.util.warn import warn

__all__ = ["PrefetchLoader", "dali_loader", "DaliLoader", "BalancedBatchSampler", "PadCollate", "tokens_per_rank",
           "BalancedDataLoader", "balance_loader", "sample_lengths", "WindowLoader", "wrap_loader",
           "pinning_skipped"]

logger = logging.getLogger("aiak")


def wrap_loader(loader: Any, cfg: Any, device: Any, *, channels_last: bool = False, accumulation: int = 1,
                follower: Any = None, count: Optional[Callable[[Any], Any]] = None) -> Any:
    """Apply a ``LoaderConfig`` (``prefetch``, ``pin_memory``, ``balanced``) to the user's loader and return it.

    * ``balanced``: a torch ``DataLoader`` over variable-length samples is rebuilt around a
      `BalancedBatchSampler` that reshuffles every epoch as the loader's own sampler would, with
      ``set_epoch`` reaching it through every handle (see `balance_loader` for when it applies);
      otherwise a warning says why and the loader is kept.
    * ``prefetch > 0``: the result is wrapped in a `PrefetchLoader` of that depth moving batches to
      ``device`` (pinned, side-stream copies on CUDA; ``channels_last`` 4-D float batches if asked).
    * A ``PrefetchLoader`` the script built itself is kept as it was configured (its device, depth and
      normalization: ``mean``/``std`` turn uint8 images into the inputs the model was written for), whatever
      ``prefetch`` says; never stacked. ``balanced`` rebuilds the loader inside it.
    * ``pin_memory`` only matters with a CUDA device; elsewhere a warning says it is skipped
      (`pinning_skipped` says why, for the decision record too).
    * ``follower`` (the step controller's `aiak.step.loader_steps.LoaderSteps`), under accumulation or with
      ``count``: the result is wrapped last in a `WindowLoader` that tells it each batch it hands out (with
      ``count(batch)``) and, under accumulation, the epoch's length (checked alike on every rank first), so that
      windows close at the step that trains each epoch's last batch.

    Keys a later schema may add are read when present: ``max_tokens`` (token budget per rank for ``balanced``),
    ``mean`` / ``std`` (on-device normalization of uint8 NCHW images by the prefetcher).
    ``loader=None`` returns None.
    """
    if loader is None:
        return None
    device = torch.device(device) if device is not None else torch.device("cpu")
    why = pinning_skipped(loader, cfg, device)
    if why is not None:
        warn(f"aiak loader.pin_memory: skipped ({why})")
    if isinstance(loader, PrefetchLoader):
        loader = _keep_scripts_prefetcher(loader, cfg)
    else:
        loader = _wrap(loader, cfg, device, channels_last)
    if follower is None or (accumulation == 1 and count is None):
        return loader
    if accumulation > 1:
        follower.follow_epochs(check_epochs_alike(loader, accumulation))
    return WindowLoader(loader, follower, count)


def pinning_skipped(loader: Any, cfg: Any, device: Any) -> Optional[str]:
    """Why ``loader.pin_memory: true`` pins nothing for ``loader`` on ``device``, or None where it pins (or was not
    asked for): pinned host memory only speeds up copies to a CUDA device, and a script's own `PrefetchLoader` is
    kept as it was configured."""
    if not cfg.pin_memory or loader is None:
        return None
    if isinstance(loader, PrefetchLoader):
        if loader.pin_memory and loader.device.type == "cuda":
            return None
        return "the script's PrefetchLoader is kept as it was configured, and it does not pin"
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return f"no CUDA device: the device is {device}, and pinning only speeds up copies to CUDA"
    return None


def _wrap(loader: Any, cfg: Any, device: torch.device, channels_last: bool) -> Any:
    """``balanced``, ``pin_memory`` and ``prefetch`` applied to a loader that is not a ``PrefetchLoader``."""
    if cfg.balanced:
        loader = balance_loader(loader, max_tokens=getattr(cfg, "max_tokens", None))
    mean, std = getattr(cfg, "mean", None), getattr(cfg, "std", None)
    if cfg.prefetch > 0:
        loader = PrefetchLoader(loader, device, depth=cfg.prefetch, pin_memory=cfg.pin_memory,
                                channels_last=channels_last, mean=mean, std=std)
    elif mean is not None:
        warn("aiak loader.mean/std: skipped, normalization happens in the prefetcher (loader.prefetch >= 1)")
    return loader


def _keep_scripts_prefetcher(prefetcher: PrefetchLoader, cfg: Any) -> PrefetchLoader:
    """The script's own ``PrefetchLoader``, as it configured it (with ``balanced``: a copy around the rebuilt
    loader, so the script's object is not changed)."""
    if cfg.prefetch > 0 or getattr(cfg, "mean", None) is not None:
        logger.info("aiak loader: the script's PrefetchLoader is kept as it is (depth %d, its normalization); "
                    "loader.prefetch / mean / std of the strategy are not stacked on it", prefetcher.depth)
    if not cfg.balanced:
        return prefetcher
    return prefetcher.around(balance_loader(prefetcher.loader, max_tokens=getattr(cfg, "max_tokens", None)))

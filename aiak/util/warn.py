"""How aiak.amp tells the user something: ``warnings.warn`` at the user's own line (once, not also on the
``aiak`` logger: a CLI that shows both would print every message twice).

The warning is attributed to the first frame outside aiak and torch (the user's ``aiak.optimize(...)`` or
training-loop line: aiak's hooks and patched functions run below torch's ``Module.__call__`` and
``clip_grad.py``), however deep it was raised, so Python's warning filters and the printed location refer
to the user's code. ``warn_once`` says a thing once per process. Inside `quiet` nothing is said and no
``warn_once`` key is spent (the strategy trials apply candidates there; only the winner speaks).

Under ``torch.distributed`` (or torchrun's ``RANK`` before the process group exists) only rank 0 speaks:
every rank makes the same decisions, so N copies of each warning and of the summary (the ``aiak`` logger,
filtered by `RankZeroFilter`) only bury the one that matters.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from typing import Set

import torch
import torch.distributed as dist

from aiak.util.dist import process_group_exists

_AIAK_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_LIBRARY_DIRS = (_AIAK_DIR + os.sep, _TORCH_DIR + os.sep)
_warned: Set[str] = set()
_quiet_depth = 0


def is_rank_zero() -> bool:
    """This process is rank 0 of the initialized process group, or of torchrun's ``RANK``, or not distributed."""
    if process_group_exists():
        return dist.get_rank() == 0
    rank = os.environ.get("RANK", "0")
    return not rank.isdigit() or int(rank) == 0


class RankZeroFilter(logging.Filter):
    """Drops the ``aiak`` logger's records on ranks other than 0."""

    def filter(self, record: logging.LogRecord) -> bool:
        return is_rank_zero()


if not any(isinstance(f, RankZeroFilter) for f in logging.getLogger("aiak").filters):
    logging.getLogger("aiak").addFilter(RankZeroFilter())


def _user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` called in `warn` that points past aiak's and torch's
    frames."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def warn(message: str, category: type = UserWarning, everywhere: bool = False) -> None:
    """Warn at the user's line (on rank 0 only, unless ``everywhere``: what only this rank can see, such as a
    collective it waits in)."""
    if _quiet_depth or not (everywhere or is_rank_zero()):
        return
    warnings.warn(message, category, stacklevel=_user_stacklevel())


def warn_once(key: str, message: str, category: type = UserWarning) -> bool:
    """`warn` the first time ``key`` is seen in this process; True if it warned now."""
    if key in _warned or _quiet_depth or not is_rank_zero():
        return False
    _warned.add(key)
    warn(message, category)
    return True


@contextlib.contextmanager
def quiet():
    """Silence aiak's warnings (without spending ``warn_once`` keys), other libraries' warnings and the ``aiak``
    logger below ERROR, for the duration."""
    global _quiet_depth
    logger = logging.getLogger("aiak")
    level = logger.level
    _quiet_depth += 1
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        _quiet_depth -= 1
        logger.setLevel(level)

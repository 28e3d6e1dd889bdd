"""Deadlock guard (debug mode): ranks compare their collective sequences before running them.

OCCL (Li et al., "OCCL: a Deadlock-free Library for GPU Collective Communication", 2023) shows that
collectives issued in different orders on different ranks deadlock. This guard diagnoses instead of
hanging: while enabled, every ``torch.distributed`` collective called through the ``torch.distributed``
namespace (user code and aiak's hooks) is fingerprinted as ``(op, shapes, dtype)`` and numbered per group.
Before it runs, each rank posts ``#n -> fingerprint`` to the process group's key-value store and waits
(up to ``timeout_s``) for the other members of that group:

* a member posted a different fingerprint: every member raises `CollectiveMismatchError` naming
  collective ``#n`` and what each rank called;
* a member did not post within the timeout: the waiting ranks raise naming the missing ranks, and leave
  an abort note in the store so the late rank raises too when it gets there;
* all agree, but a synchronous collective does not complete within the timeout: it raises.

Cost: a few store round trips per collective, so it is a debugging tool, off by default. The wrapped collectives
are the ``deadlock-guard`` patch of `aiak.runtime.patches`: disabling the guard undoes it (and so does
``aiak.undo_patches()``).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import threading
import time
from datetime import timedelta
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from aiak.runtime import patches

GUARDED = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
           "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
           "gather", "scatter", "barrier", "all_gather_object", "broadcast_object_list")
_generations = itertools.count()  # guards are created in the same order on every rank: keys never collide


class CollectiveMismatchError(RuntimeError):
    """Ranks disagreed on (or did not all reach) a collective; raised instead of hanging."""


def _describe_arg(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return f"{len(value)}x{_describe_arg(value[0])}"
    return ""


def fingerprint(op: str, args: tuple) -> str:
    """``op(tensor descriptions)``: what must match across the members of a group."""
    parts = [d for d in (_describe_arg(a) for a in args) if d]
    return f"{op}({', '.join(parts)})"


class DeadlockGuard:
    """Wraps the collectives of ``torch.distributed`` while enabled (see the module docstring)."""

    def __init__(self, timeout_s: float = 300.0, poll_s: float = 0.005):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._seq: Dict[Tuple[int, ...], int] = {}
        self._lock = threading.Lock()
        self._enabled = False
        self._store = None
        self._prefix = f"aiak_guard/{next(_generations)}"
        self._abort_key = f"{self._prefix}/abort"

    # -- patching ----------------------------------------------------------------------------
    def enable(self) -> "DeadlockGuard":
        if self._enabled:
            return self
        self._store = dist.distributed_c10d._get_default_store()
        for name in GUARDED:
            original = getattr(dist, name, None)
            if original is not None:
                patches.replace("deadlock-guard", dist, name, self._wrap(name, original))
        patches.on_undo("deadlock-guard", self._disabled)
        self._enabled = True
        return self

    def disable(self) -> None:
        if self._enabled:
            patches.undo("deadlock-guard")

    def _disabled(self) -> None:
        """torch.distributed's collectives were put back (by `disable` or ``aiak.undo_patches()``)."""
        global _ACTIVE
        self._enabled = False
        if _ACTIVE is self:
            _ACTIVE = None

    def _wrap(self, op: str, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def guarded(*args, **kwargs):
            try:
                group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            except TypeError:
                group = kwargs.get("group")
            what = fingerprint(op, args)
            n = self.check(what, group)
            if kwargs.get("async_op") or op in ("all_gather_object", "broadcast_object_list"):
                return original(*args, **kwargs)
            work = original(*args, **{**kwargs, "async_op": True})
            if work is None:  # this rank is not a member of ``group``
                return None
            try:
                work.wait(timeout=timedelta(seconds=self.timeout_s))
            except RuntimeError as e:
                raise CollectiveMismatchError(
                    f"aiak deadlock guard: collective #{n} {what} on ranks {self._ranks(group)} was reached by all "
                    f"ranks but did not complete within {self.timeout_s:g} s ({e})") from e
            return None

        return guarded

    # -- the check ---------------------------------------------------------------------------
    @staticmethod
    def _ranks(group) -> Tuple[int, ...]:
        if group is None or group is dist.group.WORLD:
            return tuple(range(dist.get_world_size()))
        return tuple(dist.get_process_group_ranks(group))

    def check(self, what: str, group=None) -> int:
        """Post this rank's collective and wait for the group to agree; returns its sequence number."""
        ranks = self._ranks(group)
        me = dist.get_rank()
        if me not in ranks:
            return -1
        with self._lock:
            n = self._seq.get(ranks, 0)
            self._seq[ranks] = n + 1
        base = f"{self._prefix}/{'-'.join(map(str, ranks))}/{n}"
        store = self._store
        store.set(f"{base}/{me}", what)
        if n >= 2:  # every member has read #n-2 once this rank could post #n-1 and #n
            with contextlib.suppress(Exception):
                store.delete_key(f"{self._prefix}/{'-'.join(map(str, ranks))}/{n - 2}/{me}")
        deadline = time.monotonic() + self.timeout_s
        pending = [r for r in ranks if r != me]
        while True:
            if store.check([self._abort_key]):
                reason = store.get(self._abort_key).decode()
                raise CollectiveMismatchError(f"aiak deadlock guard: another rank failed: {reason} "
                                              f"(this rank {me} was at collective #{n} {what})")
            pending = [r for r in pending if not store.check([f"{base}/{r}"])]
            if not pending:
                break
            if time.monotonic() > deadline:
                self._abort(f"collective #{n} on ranks {list(ranks)}: rank(s) {pending} did not reach it within "
                            f"{self.timeout_s:g} s (rank {me} called {what})")
            time.sleep(self.poll_s)
        seen = {r: (what if r == me else store.get(f"{base}/{r}").decode()) for r in ranks}
        if len(set(seen.values())) > 1:
            calls = ", ".join(f"rank {r}: {w}" for r, w in seen.items())
            disagree = [r for r, w in seen.items() if w != seen[ranks[0]]]
            self._abort(f"collective #{n} on ranks {list(ranks)} differs across ranks ({calls}); "
                        f"first divergence at ranks {disagree} vs rank {ranks[0]}")
        return n

    def _abort(self, message: str) -> None:
        with contextlib.suppress(Exception):
            self._store.compare_set(self._abort_key, "", message)  # first report wins
        raise CollectiveMismatchError(f"aiak deadlock guard: {message}")


_ACTIVE: Optional[DeadlockGuard] = None


def enable_deadlock_guard(timeout_s: float = 300.0) -> DeadlockGuard:
    """Turn the guard on for this process (idempotent; collective use requires all ranks to enable it)."""
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = DeadlockGuard(timeout_s).enable()
    return _ACTIVE


def disable_deadlock_guard() -> None:
    """Turn the guard off: torch.distributed's own collectives again."""
    if _ACTIVE is not None:
        _ACTIVE.disable()


@contextlib.contextmanager
def deadlock_guard(timeout_s: float = 300.0):
    """``with deadlock_guard(timeout_s=30): ...`` guards the collectives inside the block."""
    guard = enable_deadlock_guard(timeout_s)
    try:
        yield guard
    finally:
        disable_deadlock_guard()

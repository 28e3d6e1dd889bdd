"""Stalls that name their rank: a collective of aiak's comm path that waits too long says who it waits for.

A rank that never reaches a collective (a slow data loader, a crashed worker, a branch only some ranks took)
leaves every other rank blocked in it, silently, until the process group's timeout (30 minutes by default)
ends the job without saying which rank was late. Horovod's stall inspector warns after 60 s with the ranks
that have not submitted a tensor; OCCL (Pan et al. 2023) argues that an ordering mistake should never cost a
silent hang. Here:

- Every rank numbers the collectives its comm worker issues (all ranks issue the same sequence: the same
  buckets, algorithm and chunks, in the same order) and remembers where it is: collective number, step,
  bucket, stage and the ranks of its group.
- A small publisher thread writes that position to the process group's store at most every
  :attr:`StallWatch.publish_s` seconds, and only when it changed: no collective, nothing on the step's path.
- A wait that has lasted ``comm.stall_warn_s`` seconds (``work.wait(timeout)``; the collective itself is not
  touched) reads every rank's last position from the store and warns, on the first waiting rank to claim that
  collective in the store (``store.add``), which ranks have not reached it and where each was last seen;
  then it keeps waiting. The process group's own timeout and the debug deadlock guard
  (:mod:`aiak.comm.deadlock`) are unchanged.

On CPU (gloo) the comm worker blocks in ``wait()``, so every collective is watched. On CUDA buckets the watch
stays out of the way: NCCL's ``wait()`` only orders the comm stream, and a ``wait(timeout)`` would block the
worker until the collective completes, serializing what the comm stream overlaps; NCCL's own watchdog
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``, the process group's timeout) is the guard on a GPU.
"""
from __future__ import annotations

import json
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

from aiak.util.threads_at_exit import stop_at_exit
from aiak.util.warn import warn

STALL_WARN_S = 60.0   # comm.stall_warn_s's default: Horovod's stall inspector's
PUBLISH_S = 1.0       # the publisher writes a changed position at most this often ...
IDLE_EXIT_S = 30.0    # ... and exits after this long without a new collective (the next one starts it again)
_PREFIX = "aiak/comm/stall"
_states = 0           # CommStates created in this process: the same count on every rank (they are collective)


def next_watch_name() -> str:
    """A name for the next state's keys in the store; every rank creates its states in the same order."""
    global _states
    _states += 1
    return f"{_PREFIX}/{_states}"


class StallWatch:
    """Where this rank's comm worker is, published to the store; a wait past ``warn_s`` names the late ranks.

    ``warn_s`` <= 0 turns the watch off (waits are plain ``wait()``, nothing is published).
    """

    def __init__(self, warn_s: float, name: str, group=None, publish_s: float = PUBLISH_S):
        self.warn_s, self.name, self.group = float(warn_s), name, group
        self.publish_s = min(publish_s, max(self.warn_s / 4, 0.05))  # published well before anyone warns
        self.rank = dist.get_rank()           # global ranks: what a user reads in logs and torchrun's output
        self.world = dist.get_world_size()
        default_store = getattr(dist.distributed_c10d, "_get_default_store", None)  # torch's own, private name
        if default_store is None:
            self.warn_s = 0.0
        self.store = default_store() if self.enabled else None
        self._ranks: Dict[Any, List[int]] = {}
        self.seq = 0
        self.step = 0
        self.bucket: Any = None
        self.position: Dict[str, Any] = {}
        self._published: Optional[str] = None
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        stop_at_exit(self)

    @property
    def enabled(self) -> bool:
        return self.warn_s > 0

    # -- the comm worker's side ---------------------------------------------------------------------------
    def at(self, step: int, bucket: Any) -> None:
        """The worker starts a bucket of ``step``."""
        self.step, self.bucket = step, bucket

    def issued(self, stage: str, group) -> Tuple[int, str]:
        """A collective was issued on ``group``; returns its number and its description."""
        self.seq += 1
        ranks = self.ranks_of(group)
        what = f"collective #{self.seq} (step {self.step}, bucket {self.bucket}, {stage} over ranks {ranks})"
        if self.enabled:
            with self._lock:
                self.position = {"seq": self.seq, "step": self.step, "bucket": self.bucket, "stage": stage,
                                 "ranks": ranks}
                self._start_publisher()
        return self.seq, what

    def ranks_of(self, group) -> List[int]:
        """The global ranks of ``group`` (the world for None), looked up once per group."""
        ranks = self._ranks.get(group)
        if ranks is None:
            ranks = self._ranks[group] = (dist.get_process_group_ranks(group) if group is not None
                                          else list(range(self.world)))
        return ranks

    def wait(self, work, seq: int, what: str, ranks: List[int]) -> None:
        """``work.wait()``; past :attr:`warn_s` seconds, say which of ``ranks`` have not reached collective
        ``seq``, then wait on."""
        if not self.enabled:
            work.wait()
            return
        started = time.monotonic()
        try:
            work.wait(timeout=timedelta(seconds=self.warn_s))
            return
        except RuntimeError:
            if work.is_completed():   # it failed: the error is the caller's
                raise
        self._report(seq, what, ranks, time.monotonic() - started)
        work.wait()

    # -- the report -----------------------------------------------------------------------------------------
    def _report(self, seq: int, what: str, ranks: List[int], waited: float) -> None:
        self._publish()   # this rank's own position first: a rank reporting later sees it
        if self.store.add(f"{self.name}/reported/{seq}/{','.join(map(str, ranks))}", 1) != 1:
            return        # another waiting rank of this group reports this collective
        late = []
        for rank in ranks:
            seen = self._position_of(rank)
            if seen is None or seen["seq"] < seq:
                late.append((rank, seen))
        if not late:
            return        # everyone has reached it since: it is merely slow (a slow link, a large bucket)
        where = "; ".join(f"rank {rank}: " + (f"last at collective #{p['seq']} (step {p['step']}, bucket "
                                               f"{p['bucket']}, {p['stage']})" if p else "no collective yet")
                          for rank, p in late)
        warn(f"aiak.comm: rank {self.rank} has waited {waited:.0f} s in {what} for rank(s) "
             f"{[rank for rank, _ in late]}, which have not reached it ({where}); still waiting "
             f"(comm.stall_warn_s: {self.warn_s:g})", everywhere=True)

    def _position_of(self, rank: int) -> Optional[Dict[str, Any]]:
        key = f"{self.name}/at/{rank}"
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key).decode())

    # -- the publisher ----------------------------------------------------------------------------------------
    def _publish(self) -> None:
        with self._lock:
            text = json.dumps(self.position) if self.position else None
        if text is not None and text != self._published:
            self.store.set(f"{self.name}/at/{self.rank}", text)
            self._published = text

    def _start_publisher(self) -> None:
        if self._thread is None:   # called under the lock
            self._stop.clear()
            self._thread = threading.Thread(target=_publish_loop, args=(weakref.ref(self),), daemon=True,
                                             name="aiak-comm-stall")
            self._thread.start()

    def stop_for_exit(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=2 * self.publish_s + 1)


def _publish_loop(ref: "weakref.ref[StallWatch]") -> None:
    """Publish the watch's position while it changes; exit when the watch is gone, stopped or idle."""
    idle_since = time.monotonic()
    last = None
    while True:
        watch = ref()
        if watch is None:
            return
        stop, period = watch._stop, watch.publish_s
        try:
            watch._publish()
        except Exception:  # noqa: BLE001 - the store is gone (the group was destroyed): nothing to watch
            with watch._lock:
                watch._thread = None
            return
        with watch._lock:
            if watch.seq != last:
                last, idle_since = watch.seq, time.monotonic()
            elif time.monotonic() - idle_since > IDLE_EXIT_S:
                watch._thread = None
                return
        del watch
        if stop.wait(period):
            return

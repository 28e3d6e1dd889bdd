"""Stalls that name their rank: a collective of aiak's comm path that waits too long says who it waits for.

A rank that never reaches a collective (a slow data loader, a crashed worker, a branch only some ranks took)
leaves every other rank blocked in it, silently, until the process group's timeout (30 minutes by default)
ends the job without saying which rank was late. Horovod's stall inspector warns after 60 s with the ranks
that have not submitted a tensor; OCCL (Pan et al. 2023) argues that an ordering mistake should never cost a
silent hang. Here:

- Every rank numbers the collectives its comm worker issues (all ranks issue the same sequence: the same
  buckets, algorithm and chunks, in the same order) and remembers where it is (collective number, step,
  bucket, stage, group) and which collective it waits in, since when. That is all the worker does: two
  assignments per collective, its ``wait()`` stays torch's own.
- A small watcher thread, every `StallWatch.publish_s` seconds, writes the position to the process
  group's store when it changed (no collective, nothing on the step's path), and when the worker has waited
  ``comm.stall_warn_s`` seconds in one collective, reads its group's positions from the store and warns which
  ranks have not reached it and where each was last seen (one waiting rank per collective, the first to claim
  it with ``store.add``). Which collective each rank waits in is published too, so a rank that has not reached
  it because it waits in an earlier one is followed to the ranks it waits for: the warning names the rank
  actually late. The collective is not touched: the worker keeps waiting. The process group's own
  timeout and the debug deadlock guard (`aiak.comm.diagnostics.deadlock`) are unchanged.

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
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

from aiak.util.background_threads import stop_at_exit
from aiak.util.warn import warn

STALL_WARN_S = 60.0   # comm.stall_warn_s's default: Horovod's stall inspector's
PUBLISH_S = 1.0       # the watcher looks (and publishes a changed position) at most this often ...
IDLE_EXIT_S = 30.0    # ... and exits after this long without a collective (the next one starts it again)
_PREFIX = "aiak/comm/stall"
_states = 0           # CommStates created in this process: the same count on every rank (they are collective)


def next_watch_name() -> str:
    """A name for the next state's keys in the store; every rank creates its states in the same order."""
    global _states
    _states += 1
    return f"{_PREFIX}/{_states}"


class StallWatch:
    """Where this rank's comm worker is, published to the store; a wait past ``warn_s`` names the late ranks.

    ``warn_s`` <= 0 turns the watch off (nothing is recorded or published).
    """

    def __init__(self, warn_s: float, name: str, publish_s: float = PUBLISH_S):
        self.warn_s, self.name = float(warn_s), name
        self.publish_s = min(publish_s, max(self.warn_s / 4, 0.05))  # published well before anyone warns
        self.rank = dist.get_rank()           # global ranks: what a user reads in logs and torchrun's output
        self.world = dist.get_world_size()
        default_store = getattr(dist.distributed_c10d, "_get_default_store", None)  # torch's own, private name
        if default_store is None:
            self.warn_s = 0.0
        self.store = default_store() if self.enabled else None
        self.seq = 0
        self.step = 0
        self.bucket: Any = None
        self.at_now: Optional[Tuple] = None      # (seq, step, bucket, stage, group) of the last collective issued
        self.waiting: Optional[Tuple] = None     # (at_now of the collective waited in, monotonic start)
        self._ranks: Dict[Any, List[int]] = {}
        self._published: Optional[Tuple] = None
        self._published_wait: Optional[Tuple] = None
        self._reported: Optional[int] = None
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        stop_at_exit(self)

    @property
    def enabled(self) -> bool:
        return self.warn_s > 0

    # -- the comm worker's side: assignments only ---------------------------------------------------------
    def at(self, step: int, bucket: Any) -> None:
        """The worker starts a bucket of ``step``."""
        self.step, self.bucket = step, bucket

    def issued(self, stage: str, group) -> Tuple:
        """A collective was issued on ``group``; returns where (to hand to `waiting_in`)."""
        self.seq += 1
        self.at_now = (self.seq, self.step, self.bucket, stage, group)
        if self._thread is None:
            with self._lock:
                self._start_watcher()
        return self.at_now

    def waiting_in(self, where: Optional[Tuple]) -> None:
        """The worker waits in the collective issued at ``where`` (None: it waits no more)."""
        self.waiting = (where, time.monotonic()) if where is not None else None

    # -- the watcher thread's side ------------------------------------------------------------------------
    def ranks_of(self, group) -> List[int]:
        """The global ranks of ``group`` (the world for None), looked up once per group."""
        ranks = self._ranks.get(group)
        if ranks is None:
            ranks = self._ranks[group] = (dist.get_process_group_ranks(group) if group is not None
                                          else list(range(self.world)))
        return ranks

    def look(self) -> None:
        """Publish a changed position; report a wait that has lasted `warn_s`."""
        at_now = self.at_now
        if at_now is not None and at_now is not self._published:
            seq, step, bucket, stage, _ = at_now
            self.store.set(f"{self.name}/at/{self.rank}", json.dumps([seq, step, bucket, stage]))
            self._published = at_now
        waiting = self.waiting
        where_waited = waiting[0] if waiting is not None else None
        if where_waited is not self._published_wait:   # who waits where: a report follows a chain of waits
            self.store.set(f"{self.name}/waiting/{self.rank}", json.dumps(
                [] if where_waited is None else [where_waited[0], self.ranks_of(where_waited[4])]))
            self._published_wait = where_waited
        if waiting is not None:
            where, since = waiting
            waited = time.monotonic() - since
            if waited >= self.warn_s and self._reported != where[0]:
                self._reported = where[0]
                self._report(where, waited)

    def _report(self, where: Tuple, waited: float) -> None:
        seq, step, bucket, stage, group = where
        ranks = self.ranks_of(group)
        if self.store.add(f"{self.name}/reported/{seq}/{','.join(map(str, ranks))}", 1) != 1:
            return        # another waiting rank of this group reports this collective
        late = self._not_reached(ranks, seq)
        if not late:
            return        # everyone has reached it since: it is merely slow (a slow link, a large bucket)
        late, blocked = self._holding_up(late)
        said = "; ".join([f"rank {rank} waits in collective #{at} for them" for rank, at in blocked] + [
            f"rank {rank}: " + (f"last at collective #{p[0]} (step {p[1]}, bucket {p[2]}, {p[3]})" if p else
                                "no collective yet") for rank, p in late])
        warn(f"aiak.comm: rank {self.rank} has waited {waited:.0f} s in collective #{seq} (step {step}, bucket "
             f"{bucket}, {stage} over ranks {ranks}) for rank(s) {[rank for rank, _ in late]}, which have not "
             f"reached it ({said}); still waiting (comm.stall_warn_s: {self.warn_s:g})", everywhere=True)

    def _not_reached(self, ranks: List[int], seq: int) -> List[Tuple[int, Optional[List[Any]]]]:
        """The ranks of ``ranks`` whose last collective comes before number ``seq``, with where they were."""
        out = []
        for rank in ranks:
            seen = self._position_of(rank)
            if seen is None or seen[0] < seq:
                out.append((rank, seen))
        return out

    def _holding_up(self, late):
        """``late`` resolved to the ranks actually holding the collective up: a late rank that is itself waiting
        in its last collective (its node's reduce-scatter, say) is only held up by the ranks that have not
        reached that one, and so on. Returns ``(the ranks at the ends of those chains, [(a waiting rank, the
        collective it waits in)])``; ``late`` as it was if every chain ends in a wait (a cycle: a real
        deadlock, which the deadlock guard explains)."""
        ends, blocked, seen_ranks, todo = [], [], set(), list(late)
        while todo:
            rank, position = todo.pop(0)
            if rank in seen_ranks:
                continue
            seen_ranks.add(rank)
            waits = self._waiting_of(rank)
            if position is not None and waits and waits[0] == position[0]:
                blocked.append((rank, waits[0]))
                todo += [(r, p) for r, p in self._not_reached(waits[1], waits[0]) if r != rank]
            else:
                ends.append((rank, position))
        return (ends, blocked) if ends else (late, [])


    def _position_of(self, rank: int) -> Optional[List[Any]]:
        """``[seq, step, bucket, stage]`` of ``rank``'s last collective, or None before its first."""
        return self._read("at", rank)

    def _waiting_of(self, rank: int) -> Optional[List[Any]]:
        """``[seq, group ranks]`` of the collective ``rank`` waits in, ``[]`` when it waits in none."""
        return self._read("waiting", rank)

    def _read(self, what: str, rank: int) -> Optional[List[Any]]:
        key = f"{self.name}/{what}/{rank}"
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key).decode())

    def _start_watcher(self) -> None:
        if self._thread is None:   # called under the lock
            self._stop.clear()
            self._thread = threading.Thread(target=_watch, args=(weakref.ref(self),), daemon=True,
                                            name="aiak-comm-stall")
            self._thread.start()

    def stop_for_exit(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=2 * self.publish_s + 1)


def _watch(ref: "weakref.ref[StallWatch]") -> None:
    """Look every ``publish_s`` while the watch lives; exit when it is gone, stopped, or idle (no collective for
    `IDLE_EXIT_S` and none waited in)."""
    last, idle_since = None, time.monotonic()
    while True:
        watch = ref()
        if watch is None:
            return
        stop, period = watch._stop, watch.publish_s
        try:
            watch.look()
        except Exception:  # noqa: BLE001 - the store is gone (the group was destroyed): nothing left to watch
            with watch._lock:
                watch._thread = None
            return
        if watch.seq != last or watch.waiting is not None:
            last, idle_since = watch.seq, time.monotonic()
        elif time.monotonic() - idle_since > IDLE_EXIT_S:
            with watch._lock:
                watch._thread = None
            return
        del watch
        if stop.wait(period):
            return

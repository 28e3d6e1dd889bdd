"""Environment settings that a process reads once, timed in fresh processes: one child per candidate per rank.

NCCL caches each of its parameters at the first read (``NCCL_PARAM`` keeps a static per variable, NVIDIA/nccl
``src/include/param.h``), so ``NCCL_SOCKET_NTHREADS`` / ``NCCL_NSOCKS_PERTHREAD`` (``src/transport/net_socket.cc``)
cannot be varied inside the training process; gloo reads ``GLOO_SOCKET_IFNAME`` when a group is created (one
device, and so one set of connections, per interface it lists: ``lo`` vs ``lo,lo``). `time_env_candidates`
therefore starts, on every rank, one child (a fresh Python running `_child_main`) per candidate environment. The
children of a candidate form their own process group through a TCPStore that rank 0 serves, check one sum, and
time one allreduce per gradient bucket each round. The parents run the rounds on the one timing engine,
`aiak.measure.rounds.alternate` (each candidate a contender whose step is one round of its children, timed by
the children): every candidate warms up, then each round runs every live candidate once, one at a time (they
never share the link), the order rotating from round to round; a round's figure is the slowest rank's. A
candidate that fails on any rank (its child errs, dies or hangs) is dropped on every rank, with that rank's
reason. The caller (the comm autotuner) recommends the winner: the environment to launch the next run with.
"""
from __future__ import annotations

import datetime
import functools
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from aiak.measure.rounds import Contender, alternate
from aiak.util.dist import is_distributed, rank0_object
from aiak.util.text import describe_error

__all__ = ["EnvTrial", "time_env_candidates"]

CHILD = ("import json, sys; from aiak.comm.allreduce.env_trials import _child_main; "
         "sys.exit(_child_main(json.loads(sys.argv[1])))")   # ``python -c``: no runpy warning once aiak.comm imports us
KEY_PREFIX = "aiak-env-trial"
POLL_S = 0.02          # between two looks at the store while a parent waits for its child
STOP_GRACE_S = 5.0     # for a finished child to exit on its own, then again after terminate, before kill
FAILED = "failed"     # the count of a candidate's children that failed, under its prefix
STDERR_TAIL = 400      # characters of a child's stderr quoted when it failed without saying why
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])   # the folder holding ``aiak``, for the child's imports


@dataclass
class EnvTrial:
    """One candidate environment's figures, the same on every rank: per timed round the slowest rank's seconds
    (empty when it failed), why it failed (``""`` if it did not), and the candidate's variables as rank 0's child
    saw them in ``os.environ`` (None: unset)."""

    env: Dict[str, Optional[str]]
    seconds: List[float] = field(default_factory=list)
    error: str = ""
    env_seen: Dict[str, Optional[str]] = field(default_factory=dict)

    @property
    def median(self) -> float:
        """The median round's seconds; ``inf`` for a candidate that failed."""
        return statistics.median(self.seconds) if self.seconds and not self.error else math.inf


@dataclass
class _Child:
    """A rank's child process for one candidate, the store its candidate's children share, its stderr; the rounds
    it ran, the candidate's variables as it saw them, and why it failed (``""``: it did not, or a peer did)."""

    process: subprocess.Popen
    store: dist.Store
    stderr: "tempfile._TemporaryFileWrapper"
    rounds: int = 0
    env_seen: Dict[str, Optional[str]] = field(default_factory=dict)
    error: str = ""


class TrialFailed(RuntimeError):
    """A candidate's child failed, here or on another rank: the contender stops (on every rank)."""


def time_env_candidates(candidates: Sequence[Mapping[str, Optional[str]]], bucket_numels: Sequence[int], *,
                        backend: str, device_index: Optional[int] = None, rounds: int = 3,
                        timeout_s: float = 120.0) -> List[EnvTrial]:
    """Each candidate environment's allreduce seconds for buckets of ``bucket_numels`` float32 values, measured
    in child processes started with ``os.environ`` updated by the candidate (a None value removes the variable)
    on ``backend`` (with ``device_index``: CUDA buffers on that device, as NCCL needs). ``rounds`` timed rounds
    follow one warm-up round. Every wait for a child is bounded by ``timeout_s``.

    Collective over torch's default process group: every rank calls it at the same point, and gets the same
    list, one `EnvTrial` per candidate in order. Without a group of more than one rank it still works,
    with children of world size 1 (they time the local path only)."""
    if not candidates or not bucket_numels or min(bucket_numels) < 1 or rounds < 1:
        raise ValueError(f"need candidates, positive bucket sizes and rounds >= 1; got {len(candidates)} "
                         f"candidates, buckets {list(bucket_numels)}, rounds {rounds}")
    distributed = is_distributed()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    timeout = datetime.timedelta(seconds=timeout_s)
    host = os.environ.get("MASTER_ADDR") or socket.gethostname()   # where the children reach rank 0
    server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout) if rank == 0 else None
    address, port, nonce = rank0_object(lambda: (host, server.port, uuid.uuid4().hex[:12]))
    client = server if server is not None else dist.TCPStore(address, port, is_master=False, timeout=timeout)
    trials = [EnvTrial(dict(env)) for env in candidates]
    children: List[_Child] = []
    try:
        for i, env in enumerate(candidates):
            prefix = f"{KEY_PREFIX}/{nonce}/{i}"
            args = dict(backend=backend, device=device_index, rank=rank, world=world, address=address, port=port,
                        prefix=prefix, numels=list(bucket_numels), rounds=rounds, timeout=timeout_s, keys=list(env),
                        go_timeout=timeout_s * (len(candidates) + 1))   # every other candidate's turn first
            children.append(_start(env, args, dist.PrefixStore(prefix, client)))
        contenders = [Contender(f"candidate {i}", functools.partial(_one_round, child, rank, timeout_s),
                                reports_seconds=True) for i, child in enumerate(children)]
        alternate(contenders, warmup=1, rounds=rounds, steps_per_round=1, slow_factor=math.inf, catch=True)
        for trial, child, contender in zip(trials, children, contenders):   # the same order on every rank
            if contender.stopped is not None:
                trial.error = _agreed(child.error)
                _stop([child], grace_s=0.0)
            else:
                trial.seconds = list(contender.step_seconds)
                trial.env_seen = rank0_object(lambda: child.env_seen)
    finally:
        _stop(children, grace_s=STOP_GRACE_S)   # then rank 0's server goes with the last reference to it
    return trials


def _start(env: Mapping[str, Optional[str]], args: dict, store: dist.Store) -> _Child:
    """A child for one candidate: this process's environment with ``env`` applied, ``aiak`` importable."""
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
    for name, value in env.items():
        if value is None:
            child_env.pop(name, None)
        else:
            child_env[name] = str(value)
    stderr = tempfile.TemporaryFile()   # a file, not a pipe: a chatty child never blocks on a full pipe
    process = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(args)], env=child_env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr)
    return _Child(process, store, stderr)


def _one_round(child: _Child, rank: int, timeout_s: float) -> float:
    """One round of a candidate (a contender's step): rank 0 says go, each rank waits for its own child's seconds.
    Raises `TrialFailed` when the child, or a peer's, failed."""
    r = child.rounds
    if rank == 0:
        child.store.set(f"go/{r}", "1")
    seconds, seen, why = _wait(child, r, rank, timeout_s)
    child.rounds += 1
    if not math.isfinite(seconds):
        child.error = why
        raise TrialFailed(why or "a trial process failed on another rank")
    if r == 0:
        child.env_seen = seen
    return seconds


def _wait(child: _Child, r: int, rank: int, timeout_s: float):
    """``(seconds, env seen, "")`` once this rank's child finished round ``r``; ``(inf, {}, why)`` when it
    failed (``why`` is ``""`` when only another rank's child did: that rank tells why). A child that fails
    without saying why gets its ``error`` key written here, so that the other ranks stop waiting for it."""
    done, mine = f"done/{r}/{rank}", f"error/{rank}"
    deadline = time.monotonic() + timeout_s
    while True:
        if child.store.check([done]):
            report = json.loads(child.store.get(done))
            return report["seconds"], report.get("env", {}), ""
        code, late = child.process.poll(), time.monotonic() > deadline
        if code is not None or late or child.store.check([FAILED]):
            if child.store.check([mine]):
                return math.inf, {}, f"rank {rank}: {child.store.get(mine).decode()}"
            if code is None and not late:
                return math.inf, {}, ""
            why = f"exited with code {code}" if code is not None else f"no result within {timeout_s:g} s"
            why += _stderr_tail(child)
            _report_failure(child.store, rank, why)
            return math.inf, {}, f"rank {rank}: {why}"
        time.sleep(POLL_S)


def _report_failure(store: dist.Store, rank: int, why: str) -> None:
    """``why`` under ``error/{rank}``, then one more on the candidate's `FAILED` count, which every
    parent of the candidate watches (one key to poll, whatever the world size)."""
    store.set(f"error/{rank}", why)
    store.add(FAILED, 1)


def _stderr_tail(child: _Child) -> str:
    """``; stderr: ...`` (its last characters) when the child wrote anything there, else ``""``."""
    child.stderr.seek(0)
    text = child.stderr.read().decode(errors="replace").strip()
    return f"; stderr: ...{text[-STDERR_TAIL:]}" if text else ""


def _agreed(why: str) -> str:
    """The first failing rank's reason, on every rank (a rank whose child waited on a failed peer has none)."""
    texts = [why]
    if is_distributed():
        texts = [None] * dist.get_world_size()
        dist.all_gather_object(texts, why)
    return next((t for t in texts if t), "a trial process failed")


def _stop(children: Sequence[_Child], grace_s: float) -> None:
    """Every child gone: those that finish within ``grace_s`` exit on their own, the rest are terminated, then
    killed."""
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.process.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            child.process.terminate()
    for child in children:
        try:
            child.process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()
        child.stderr.close()


def _child_main(args: dict) -> int:
    """A child: join the candidate's group, check a sum, report the environment, then time every round that
    its parents' ``go`` key starts. Any exception is written to ``error/{rank}``; exit status 1."""
    rank, world, timeout = args["rank"], args["world"], datetime.timedelta(seconds=args["timeout"])
    store = dist.PrefixStore(args["prefix"], dist.TCPStore(args["address"], args["port"], is_master=False,
                                                           timeout=timeout))
    try:
        cuda = args["device"] is not None
        if cuda:
            torch.cuda.set_device(args["device"])
        dist.init_process_group(args["backend"], store=store, rank=rank, world_size=world, timeout=timeout)
        device = torch.device("cuda", args["device"]) if cuda else torch.device("cpu")
        buffers = [torch.full((n,), float(rank + 1), dtype=torch.float32, device=device) for n in args["numels"]]
        for buffer in buffers:
            dist.all_reduce(buffer)
        expected = world * (world + 1) / 2
        if not all(bool((buffer == expected).all()) for buffer in buffers):
            raise RuntimeError(f"allreduce check failed: the sum of rank + 1 over {world} ranks is not {expected}")
        for buffer in buffers:
            buffer.zero_()   # zeros stay zeros: no overflow however many rounds
        env = {name: os.environ.get(name) for name in args["keys"]}
        for r in range(args["rounds"] + 1):
            store.wait([f"go/{r}"], datetime.timedelta(seconds=args["go_timeout"]))
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for buffer in buffers:
                dist.all_reduce(buffer)
            if cuda:
                torch.cuda.synchronize()
            report = {"seconds": time.perf_counter() - start, **({"env": env} if r == 0 else {})}
            store.set(f"done/{r}/{rank}", json.dumps(report))
        dist.destroy_process_group()
        return 0
    except Exception as e:  # noqa: BLE001 - every failure is the parent's to report, on every rank
        traceback.print_exc()
        _report_failure(store, rank, describe_error(e))
        return 1


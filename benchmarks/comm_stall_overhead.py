"""What watching for stalls costs aiak's communication path: ``comm.stall_warn_s`` 60 (the default) against 0.

Two gloo ranks on this machine average the same buckets through aiak's worker
(:func:`aiak.comm.allreduce.hooks.average`), flat and hierarchical-sized small buckets, the watched and the unwatched
state alternating in rounds on the one timing engine (:func:`aiak.measure.rounds.alternate`, the slowest rank's
figures). Small buckets put the per-collective cost (numbering, describing, the timed wait) at its largest share.

    python benchmarks/comm_stall_overhead.py [--buckets 32] [--numel 16384] [--rounds 12]
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    from aiak.comm.allreduce.hooks import CommState, average
    from aiak.measure.rounds import Contender, alternate, speedup

    buffers = [torch.randn(args.numel) for _ in range(args.buckets)]

    def step_of(state):
        def step():
            torch.futures.wait_all([average(state, b, key=k) for k, b in enumerate(buffers)])
        return step

    plain = Contender("stall_warn_s 0", step_of(CommState(stall_warn_s=0)))
    watched = Contender("stall_warn_s 60", step_of(CommState(stall_warn_s=60)))
    alternate([plain, watched], warmup=3, rounds=args.rounds, steps_per_round=args.steps, slow_factor=float("inf"))
    if rank == 0:
        s = speedup(plain.round_seconds, watched.round_seconds)
        out.put((plain.timing(), watched.timing(), s))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buckets", type=int, default=32, help="buckets per step (default 32)")
    ap.add_argument("--numel", type=int, default=16384, help="float32 values per bucket (default 16384: 64 KB)")
    ap.add_argument("--rounds", type=int, default=12, help="alternating rounds (default 12)")
    ap.add_argument("--steps", type=int, default=5, help="steps per contender per round (default 5)")
    args = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    plain, watched, ratio = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    print(f"2 gloo ranks, {args.buckets} buckets of {args.numel} float32 per step, {args.rounds} rounds x "
          f"{args.steps} steps, alternating (median, p10-p90 of steps; slowest rank)")
    for name, t in (("stall_warn_s 0 (off)", plain), ("stall_warn_s 60 (default)", watched)):
        print(f"  {name:28s} {t.median * 1e3:8.2f} ms  ({t.p10 * 1e3:.2f}-{t.p90 * 1e3:.2f})")
    print(f"  off / watched, per round: {ratio.describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Real gloo ranks for a test: ``spawn_ranks(worker, world)`` runs ``worker(rank, world)`` in each and returns
their results."""
import datetime
import io
import os
import queue
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(worker, rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    result = worker(rank, world)
    buffer = io.BytesIO()  # bytes, not tensors: a tensor sent through a queue dies with its sender process
    torch.save(result, buffer)
    out.put((rank, buffer.getvalue()))
    dist.barrier()
    dist.destroy_process_group()


def spawn_ranks(worker, world=2, timeout=120):
    """``worker(rank, world)`` on ``world`` spawned gloo ranks; returns each rank's result, by rank. A rank that
    fails or hangs fails the test within ``timeout`` seconds."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(worker, rank, world, port, out)) for rank in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, blob = out.get(timeout=timeout)
            results[rank] = torch.load(io.BytesIO(blob), weights_only=False)
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(world)) - set(results))} produced no result within {timeout} s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [results[rank] for rank in range(world)]

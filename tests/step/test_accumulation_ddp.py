"""Accumulation under DDP (2 gloo ranks): gradients are allreduced only on the last micro-step."""
import io
import os
import queue
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

N_ACC, MICRO, STEPS = 4, 4, 8  # STEPS micro-steps per rank = 2 real steps


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def _data(rank, world):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, world, MICRO, 6, generator=g)
    y = torch.randint(0, 2, (STEPS, world, MICRO), generator=g)
    return x, y


def _worker(rank, world, port, accumulation, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=60))
    import aiak
    from torch.profiler import profile

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt, _ = aiak.optimize(model, opt, strategy={"grad_accumulation": accumulation})
    assert isinstance(model, nn.parallel.DistributedDataParallel)
    x, y = _data(rank, world)
    with profile() as prof:
        for step in range(STEPS):
            nn.functional.cross_entropy(model(x[step, rank]), y[step, rank]).backward()
            opt.step()
            opt.zero_grad()
    allreduces = sum(e.name == "gloo:all_reduce" for e in prof.events())
    buffer = io.BytesIO()  # bytes, not tensors: a tensor sent through a queue dies with its sender process
    torch.save(model.state_dict(), buffer)
    out.put((rank, allreduces, buffer.getvalue()))
    dist.destroy_process_group()


def _launch(accumulation, world=2):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, accumulation, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, n, blob = out.get(timeout=120)
            results[rank] = (n, torch.load(io.BytesIO(blob)))
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(world)) - set(results))} produced no result within 120 s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return results


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_allreduce_only_on_the_last_micro_step_and_same_result_as_big_batch():
    with_acc = _launch(N_ACC)
    without = _launch(1)
    counts = {r: n for r, (n, _) in with_acc.items()}
    assert counts == {0: STEPS // N_ACC, 1: STEPS // N_ACC}, counts       # one bucket, 2 real steps
    assert {r: n for r, (n, _) in without.items()} == {0: STEPS, 1: STEPS}
    sd0, sd1 = with_acc[0][1], with_acc[1][1]
    assert list(sd0) == list(_model().state_dict())                         # the user's keys, no "module."
    for k in sd0:
        assert torch.equal(sd0[k], sd1[k]), k                                 # every rank ends identical
    # reference: one process, each real step on the concatenation of all ranks' micro-batches
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    x, y = _data(0, 2)
    for s in range(0, STEPS, N_ACC):
        xs = x[s:s + N_ACC].reshape(-1, 6)
        ys = y[s:s + N_ACC].reshape(-1)
        nn.functional.cross_entropy(ref(xs), ys).backward()
        opt.step()
        opt.zero_grad()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd0[k], v, rtol=1e-5, atol=1e-6)

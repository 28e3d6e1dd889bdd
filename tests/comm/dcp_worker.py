"""One rank of ``tests/comm/test_dcp.py``: torch.distributed.checkpoint (DCP) on the models ``aiak.optimize``
returns, launched as torchrun would by ``tests/comm/conftest.launch``. ``AIAK_TEST_DIR``: the checkpoints' folder."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.comm.dist_worker import main, rank_data, small_model  # noqa: E402


# The configurations each launch runs, one after the other (a launch's start is most of its time): the comm section
# (the engine, and what it keeps per rank: int8's residuals, PowerSGD's factors and residuals).
RESUMES = {"ddp": {}, "fsdp2": {"engine": "fsdp2"}, "int8": {"compression": "int8"},
           "powersgd": {"algorithm": "powersgd", "powersgd": {"warmup_steps": 2}}}
ACROSS = {"ddp": {}, "fsdp2": {"engine": "fsdp2"}, "int8": {"compression": "int8"}}


def _optimized(comm):
    import aiak

    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, _ = aiak.optimize(model, opt, strategy={"tune": False, "grad_accumulation": 2, "comm": comm})
    return model, opt


def _train(model, opt, rank, steps, start=0):
    for step in range(start, start + steps):
        x, y = rank_data(rank, step=step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _save(model, opt, folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    return sorted(model_state)


def _load(model, opt, folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, opt)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=model_state, optim_state_dict=optim_state)


def scenario_resumes(rank):
    """Each configuration of `RESUMES` (accumulation 2, AdamW): 8 micro-steps uninterrupted, against 4, a DCP save
    (``get_state_dict``, ``dcp.save``), a new model and optimizer, a DCP load (``dcp.load``, ``set_state_dict``) and 4
    more. Returns both runs' full weights and the keys ``get_state_dict`` gave, by configuration."""
    out = {}
    for name, comm in RESUMES.items():
        folder = os.path.join(os.environ["AIAK_TEST_DIR"], name)
        model, opt = _optimized(comm)
        _train(model, opt, rank, 8)
        uninterrupted = [_full(p).detach().clone() for p in model.parameters()]

        model, opt = _optimized(comm)
        _train(model, opt, rank, 4)
        keys = _save(model, opt, folder)

        model, opt = _optimized(comm)
        _load(model, opt, folder)
        _train(model, opt, rank, 4, start=4)
        out[name] = {"uninterrupted": uninterrupted, "resumed": [_full(p).detach().clone() for p in model.parameters()],
                     "keys": keys, "plain_keys": sorted(small_model().state_dict())}
    return out


def _global_batch(step, rank, world):
    """Rank ``rank``'s rows of the step's 16-row global batch (the same global batch whatever the world size)."""
    g = torch.Generator().manual_seed(7000 + step)
    x, y = torch.randn(16, 13, generator=g), torch.randn(16, 7, generator=g)
    rows = slice(rank * 16 // world, (rank + 1) * 16 // world)
    return x[rows], y[rows]


def _train_global(model, opt, rank, world, steps, start=0):
    for step in range(start, start + steps):
        x, y = _global_batch(step, rank, world)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _full_state(model, opt):
    """The full weights and the full optimizer state tensors, in the parameters' order."""
    weights = [_full(p).detach().clone() for p in model.parameters()]
    state = [_full(opt.state[p][k]).detach().clone() for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")]
    return weights, state


def scenario_save_at(rank):
    """For each configuration of `ACROSS`: train 4 micro-steps (2 windows of accumulation 2) on this world size and
    save through DCP; returns the full weights and optimizer state saved, by configuration."""
    out = {}
    for name, comm in ACROSS.items():
        model, opt = _optimized(comm)
        _train_global(model, opt, rank, dist.get_world_size(), 4)
        _save(model, opt, os.path.join(os.environ["AIAK_TEST_DIR"], name))
        out[name] = _full_state(model, opt)
    return out


def scenario_load_at(rank):
    """For each configuration of `ACROSS`: load its checkpoint on this world size (another one) and train 4
    micro-steps more; returns the full weights and optimizer state right after loading, the warnings of the load and
    the first step (where a checkpoint's residuals are read), the weights after, and (rank 0) one process's 8
    micro-steps on the same global batches."""
    import warnings

    world, out = dist.get_world_size(), {}
    for name, comm in ACROSS.items():
        model, opt = _optimized(comm)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            _load(model, opt, os.path.join(os.environ["AIAK_TEST_DIR"], name))
            loaded = _full_state(model, opt)
            _train_global(model, opt, rank, world, 1, start=4)
        _train_global(model, opt, rank, world, 3, start=5)
        out[name] = {"loaded": loaded, "weights": [_full(p).detach().clone() for p in model.parameters()],
                     "warnings": [str(w.message) for w in said]}
    if rank == 0:
        reference = small_model()
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
        for step in range(0, 8, 2):
            batches = [_global_batch(s, 0, 1) for s in (step, step + 1)]
            nn.functional.mse_loss(reference(torch.cat([b[0] for b in batches])),
                                   torch.cat([b[1] for b in batches])).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        out["reference"] = [p.detach().clone() for p in reference.parameters()]
    return out


if __name__ == "__main__":
    main(globals())

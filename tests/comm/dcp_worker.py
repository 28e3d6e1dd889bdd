"""One rank of ``tests/comm/test_dcp.py``: torch.distributed.checkpoint (DCP) on the models ``aiak.optimize``
returns, launched as torchrun would by ``tests/comm/conftest.launch``. ``AIAK_TEST_DIR``: the checkpoint's folder."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.comm.dist_worker import main, rank_data, small_model  # noqa: E402


def _optimized():
    import aiak

    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, _ = aiak.optimize(model, opt, strategy={"tune": False, "grad_accumulation": 2})
    return model, opt


def _train(model, opt, rank, steps, start=0):
    for step in range(start, start + steps):
        x, y = rank_data(rank, step=step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def scenario_ddp_resume(rank):
    """aiak's DDP (accumulation 2, AdamW): 8 micro-steps uninterrupted, against 4, a DCP save (``get_state_dict``,
    ``dcp.save``), a new model and optimizer, a DCP load (``dcp.load``, ``set_state_dict``) and 4 more. Returns
    both runs' weights and the keys ``get_state_dict`` gave."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder = os.environ["AIAK_TEST_DIR"]
    model, opt = _optimized()
    _train(model, opt, rank, 8)
    uninterrupted = [p.detach().clone() for p in model.parameters()]

    model, opt = _optimized()
    _train(model, opt, rank, 4)
    model_state, optim_state = get_state_dict(model, opt)
    keys = sorted(model_state)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)

    model, opt = _optimized()
    model_state, optim_state = get_state_dict(model, opt)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=model_state, optim_state_dict=optim_state)
    _train(model, opt, rank, 4, start=4)
    return {"uninterrupted": uninterrupted, "resumed": [p.detach().clone() for p in model.parameters()],
            "keys": keys, "plain_keys": sorted(small_model().state_dict())}


if __name__ == "__main__":
    main(globals())

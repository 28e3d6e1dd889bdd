"""One rank of tests/integrations/test_torchrun.py, started by ``torchrun --nproc-per-node 2`` (gloo, CPU).

Trains a few steps with ``aiak.optimize`` on a loader that has (``sharded``) or lacks a ``DistributedSampler``,
logging the ``aiak`` logger to stderr as a user's ``logging.basicConfig(level=INFO)`` would, and writes what this
rank saw (aiak's warnings, its final weights) to ``<out>/rank<N>.json``.
"""
import json
import logging
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

import aiak


def main(out_dir: str, sharded: bool) -> None:
    logging.basicConfig(level=logging.INFO, format="[rank %(rank)s] %(name)s: %(message)s")
    old_factory = logging.getLogRecordFactory()

    def with_rank(*args, **kwargs):
        record = old_factory(*args, **kwargs)
        record.rank = dist.get_rank() if dist.is_initialized() else "?"
        return record

    logging.setLogRecordFactory(with_rank)
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(0)
    dataset = torch.utils.data.TensorDataset(torch.randn(64, 12, generator=g), torch.randint(0, 3, (64,), generator=g))
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=False) if sharded else None
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model, opt, loader = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                                           strategy={"grad_accumulation": 2})
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    said = [str(w.message) for w in record if str(w.message).startswith("aiak")]
    weights = [p.detach().flatten().tolist() for p in model.parameters()]
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "warnings": said, "weights": weights}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "sharded")

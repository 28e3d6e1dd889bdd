"""One rank of test_distributed_probes.py: join a gloo group, probe, compose, write what it found as JSON."""
import datetime
import json
import sys

import torch.distributed as dist
from torch import nn

from aiak.strategy import select


def main(out_path: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        selection = select(model)
        p = selection.probes
        result = {"world_size": p.world_size, "local_size": p.local_size, "nodes": p.nodes, "backend": p.backend,
                  "matched": selection.matched, "strategy": selection.strategy.to_dict(),
                  "digest": selection.profiles_digest}
        with open(out_path, "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

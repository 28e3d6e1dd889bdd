"""A Lightning script on 2 CPU processes with ``strategy="ddp"`` (Lightning launches rank 1 by running this file
again). ``python lightning_ddp_script.py aiak|lightning OUTDIR``: ``aiak`` fits with ``AiakCallback(grad_accumulation
2, fp16 compression)``, ``lightning`` with Lightning's own ``accumulate_grad_batches=2``; each rank saves what it saw."""
import gc
import os
import sys

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from aiak.integrations.lightning import AiakCallback


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        self.seen = []

    def training_step(self, batch, batch_idx):
        ddps = [o for o in gc.get_objects() if isinstance(o, DDP)]
        wrapper = self.trainer.strategy.model
        hook = getattr(wrapper, "aiak_comm_state", None)
        self.seen.append({"ddps": len(ddps), "sync": bool(wrapper.require_backward_grad_sync),
                          "compression": getattr(hook, "compression", None)})
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(mode, out):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,), generator=g))
    module = Classifier()
    extra = ({"callbacks": [AiakCallback({"grad_accumulation": 2, "comm": {"compression": "fp16"}})]}
             if mode == "aiak" else {"accumulate_grad_batches": 2})
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **extra)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    torch.save({"seen": module.seen, "weights": {k: v.clone() for k, v in module.net.state_dict().items()}},
               os.path.join(out, f"{mode}-rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

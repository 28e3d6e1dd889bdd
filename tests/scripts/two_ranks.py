"""One rank of the reference scripts' torchrun test (``python -m torch.distributed.run --nproc-per-node 2 -m
tests.scripts.two_ranks <out_dir> <image_folder>``).

Runs each script in plain PyTorch, then with ``strategy="default"`` (the aiak line before the script's own DDP
line), and the torchvision script's per-sample variant on batches of 8 against batches of 4 with
``grad_accumulation: 2``, and the timm script's own accumulation with aiak's stacked on it, in one process group; ``torch.save``s what every run returned, keyed by
``(setup, strategy)``, to ``<out_dir>/rank<N>.pt``. The test process makes the assertions.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from tests.scripts import timm_style, torchvision_style

PER_SAMPLE = {"norm_layer": "group", "dropout": 0.0}  # half batches hold exactly the full batch's gradient
# (setup, strategy, script, arguments); every plain run first: none of them runs after aiak patched anything
RUNS = (
    ("torchvision", "plain", torchvision_style, {}),
    ("timm", "plain", timm_style, {"workers": 0}),
    ("torchvision_per_sample", "plain", torchvision_style, PER_SAMPLE),
    ("torchvision", "default", torchvision_style, {"aiak": "default"}),
    ("timm", "default", timm_style, {"workers": 0, "aiak": "default"}),
    ("torchvision_per_sample", "grad_accumulation", torchvision_style,
     {**PER_SAMPLE, "batch_size": 4, "aiak": {"grad_accumulation": 2, "tune": False}}),
    ("timm", "stacked_accumulation", timm_style, {"workers": 0, "aiak": {"grad_accumulation": 2, "tune": False}}),
)


def main(out_dir: str, image_folder: str) -> None:
    results = {}
    for setup, strategy, script, args in RUNS:
        data_arg = "data_path" if script is torchvision_style else "data_dir"
        results[setup, strategy] = script.main({data_arg: image_folder, **args})
    rank = dist.get_rank()
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.barrier()  # rank 0 hosts the store: keep it up until every rank has saved
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""A classification training script shaped like timm's ``train.py``, CPU-sized, with aiak's one line added where a
user would add it.

What it keeps of the reference: ``timm.utils.random_seed(seed, rank)``, ``timm.create_model``, the optimizer from
``timm.optim.create_optimizer_v2`` (no weight decay on biases and norms), an image folder read by
``timm.data.ImageDataset`` with ``timm.data.create_transform`` augmentation, ``timm.data.Mixup`` in the loader's
collate with ``mixup_off_epoch`` (the loop turns it off with ``loader.mixup_enabled = False``, as timm does on its
prefetching loader), ``SoftTargetCrossEntropy`` under mixup, ``timm.utils.ModelEmaV3`` with warm-up (its decay
depends on the update count), clipping through ``timm.utils.dispatch_clip_grad`` (``clip_mode`` norm, value or
agc: adaptive gradient clipping, Brock et al. 2021, "High-Performance Large-Scale Image Recognition Without
Normalization", head excluded as timm does), the script's own gradient accumulation (``grad_accum_steps``: the
loss divided by it, ``optimizer.step()`` on every ``grad_accum_steps``-th batch, DDP's ``no_sync`` in between), a
``timm.scheduler`` cosine schedule with warm-up stepped per update (``step_update``), and the script's own
``DistributedDataParallel(model, device_ids=None, broadcast_buffers=...)`` line.

The aiak edits: the ``aiak.optimize`` line (after the model, optimizer, loader and EMA exist, before the DDP line),
and ``aiak.stepped(optimizer)`` where the loop counts updates: under aiak's ``grad_accumulation`` a step the
script meant as an update may be a micro-step, and the EMA and the schedule must count real updates.

``main(args)`` takes an ``argparse.Namespace`` or a dict of overrides of :func:`get_args_parser`'s defaults and
returns the final weights with what a test checks (see :func:`main`).
"""
from __future__ import annotations

import argparse
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
from timm.data import ImageDataset, Mixup, create_transform
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.models import create_model, model_parameters
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3, dispatch_clip_grad, random_seed
from torch import nn
from torch.nn.parallel import DistributedDataParallel as NativeDDP
from torch.utils.data import DataLoader, RandomSampler, default_collate
from torch.utils.data.distributed import DistributedSampler

import aiak
from tests.scripts.synthetic_data import write_image_folder


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="timm-style classification training (CPU-sized)")
    parser.add_argument("--data-dir", default=None, help="an image folder root (default: a synthetic one)")
    parser.add_argument("--model", default="test_nfnet")
    parser.add_argument("--num-classes", default=4, type=int)
    parser.add_argument("--img-size", default=32, type=int)
    parser.add_argument("-b", "--batch-size", default=4, type=int)
    parser.add_argument("--grad-accum-steps", default=2, type=int)
    parser.add_argument("--epochs", default=3, type=int)
    parser.add_argument("-j", "--workers", default=1, type=int)
    parser.add_argument("--opt", default="sgd")
    parser.add_argument("--lr", default=0.05, type=float)
    parser.add_argument("--momentum", default=0.9, type=float)
    parser.add_argument("--weight-decay", default=1e-4, type=float)
    parser.add_argument("--sched", default="cosine", help="a timm scheduler name; empty: a constant learning rate")
    parser.add_argument("--warmup-epochs", default=1, type=int)
    parser.add_argument("--warmup-lr", default=0.005, type=float)
    parser.add_argument("--min-lr", default=0.001, type=float)
    parser.add_argument("--mixup", default=0.8, type=float)
    parser.add_argument("--cutmix", default=1.0, type=float)
    parser.add_argument("--mixup-off-epoch", default=1, type=int)
    parser.add_argument("--smoothing", default=0.1, type=float)
    parser.add_argument("--clip-grad", default=0.05, type=float)
    parser.add_argument("--clip-mode", default="agc", choices=("norm", "value", "agc"))
    parser.add_argument("--model-ema", default=True, action=argparse.BooleanOptionalAction)
    parser.add_argument("--model-ema-decay", default=0.9, type=float)
    parser.add_argument("--no-ddp-bb", default=False, action="store_true")
    parser.add_argument("--seed", default=42, type=int)
    parser.add_argument("--aiak", default=None, help="the strategy for aiak.optimize (default: plain PyTorch)")
    return parser


def parse(args) -> argparse.Namespace:
    """``args`` as a namespace: a dict overrides the parser's defaults."""
    if isinstance(args, argparse.Namespace):
        return args
    defaults = vars(get_args_parser().parse_args([]))
    unknown = sorted(set(args) - set(defaults))
    if unknown:
        raise ValueError(f"unknown argument(s) {unknown}; valid: {sorted(defaults)}")
    return argparse.Namespace(**{**defaults, **args})


class MixupCollate:
    """Collate, then Mix/CutMix the batch: what timm's ``FastCollateMixup`` does in the loader's workers. Off, it
    still turns the labels into smoothed one-hot targets (Mixup with lam = 1)."""

    def __init__(self, mixup: Mixup):
        self.mixup = mixup

    def __call__(self, samples):
        return self.mixup(*default_collate(samples))


class TrainLoader:
    """The training loader, with timm's ``mixup_enabled`` switch on it: the collate reads it, in the workers of the
    next epoch."""

    def __init__(self, dataset, batch_size: int, sampler, workers: int, mixup=None):
        self.mixup = mixup
        collate = MixupCollate(mixup) if mixup is not None else None
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                                 collate_fn=collate, drop_last=True)

    @property
    def mixup_enabled(self) -> bool:
        return self.mixup is not None and self.mixup.mixup_enabled

    @mixup_enabled.setter
    def mixup_enabled(self, enabled: bool) -> None:
        if self.mixup is not None:
            self.mixup.mixup_enabled = enabled

    @property
    def sampler(self):
        return self.loader.sampler

    def __iter__(self):
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


def init_distributed(args) -> None:
    """torchrun's environment (``RANK``, ``WORLD_SIZE``): one gloo process group, every wait bounded."""
    args.distributed = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if args.distributed and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    args.rank = dist.get_rank() if args.distributed else 0
    args.world_size = dist.get_world_size() if args.distributed else 1


def is_mixed(target: torch.Tensor, args) -> bool:
    """Some row of a batch's soft targets is a blend of two classes (below the smoothed one-hot's peak)."""
    peak = 1 - args.smoothing + args.smoothing / args.num_classes
    return target.dim() == 2 and bool((target.amax(1) < peak - 1e-6).any())


def train_one_epoch(epoch, model, loader, optimizer, loss_fn, args, lr_scheduler, model_ema, num_updates, record):
    """One epoch; returns the update count after it."""
    if args.mixup_off_epoch and epoch >= args.mixup_off_epoch and loader.mixup_enabled:
        loader.mixup_enabled = False
    has_no_sync = args.distributed and hasattr(model, "no_sync")
    model.train()
    accum_steps = args.grad_accum_steps
    last_accum_steps = len(loader) % accum_steps
    last_batch_idx = len(loader) - 1
    last_batch_idx_to_accum = len(loader) - last_accum_steps
    mixed = 0
    optimizer.zero_grad()
    for batch_idx, (input, target) in enumerate(loader):
        last_batch = batch_idx == last_batch_idx
        need_update = last_batch or (batch_idx + 1) % accum_steps == 0
        if batch_idx >= last_batch_idx_to_accum:
            accum_steps = last_accum_steps
        mixed += int(is_mixed(target, args))

        def forward_backward():
            loss = loss_fn(model(input), target)
            if accum_steps > 1:
                loss = loss / accum_steps
            loss.backward()

        if has_no_sync and not need_update:
            with model.no_sync():
                forward_backward()
        else:
            forward_backward()
        if need_update:
            if args.clip_grad is not None:
                dispatch_clip_grad(model_parameters(model, exclude_head="agc" in args.clip_mode), value=args.clip_grad,
                                   mode=args.clip_mode)
            optimizer.step()
        if not need_update or not aiak.stepped(optimizer):
            continue  # an accumulation micro-step, the script's or aiak's: no update yet

        num_updates += 1
        optimizer.zero_grad()
        if model_ema is not None:
            model_ema.update(model, step=num_updates)
        record["lr"].append(optimizer.param_groups[0]["lr"])
        if lr_scheduler is not None:
            lr_scheduler.step_update(num_updates=num_updates)
    record["mixed_batches"].append(mixed)
    return num_updates


def main(args) -> dict:
    """Train; returns ``model`` and ``model_ema`` (state dicts, cloned), ``lr`` (the rate of each update),
    ``updates``, ``mixed_batches`` (per epoch, batches whose targets were mixed) and, under torchrun, ``ddp``
    (what the script's DDP line built)."""
    args = parse(args)
    init_distributed(args)
    random_seed(args.seed, args.rank)
    if args.data_dir is None:
        args.data_dir = str(write_image_folder(tempfile.mkdtemp(prefix="timm-style-"), classes=args.num_classes))

    model = create_model(args.model, num_classes=args.num_classes)
    optimizer = create_optimizer_v2(model, opt=args.opt, lr=args.lr, weight_decay=args.weight_decay,
                                    momentum=args.momentum)

    transform = create_transform(args.img_size, is_training=True, scale=(0.5, 1.0), interpolation="bilinear")
    dataset_train = ImageDataset(args.data_dir, transform=transform)
    mixup_fn = None
    if args.mixup > 0 or args.cutmix > 0:
        mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                         num_classes=args.num_classes)
    sampler = DistributedSampler(dataset_train) if args.distributed else RandomSampler(dataset_train)
    loader_train = TrainLoader(dataset_train, args.batch_size, sampler, args.workers, mixup_fn)
    if mixup_fn is not None:
        train_loss_fn = SoftTargetCrossEntropy()
    elif args.smoothing:
        train_loss_fn = LabelSmoothingCrossEntropy(smoothing=args.smoothing)
    else:
        train_loss_fn = nn.CrossEntropyLoss()

    # the EMA is created before DDP (timm: "after cuda(), DP wrapper, and AMP but before DDP wrapper")
    model_ema = ModelEmaV3(model, decay=args.model_ema_decay, use_warmup=True) if args.model_ema else None

    if args.aiak is not None:
        model, optimizer, loader_train = aiak.optimize(model, optimizer, loader_train, strategy=args.aiak)

    if args.distributed:
        model = NativeDDP(model, device_ids=None, broadcast_buffers=not args.no_ddp_bb)

    updates_per_epoch = (len(loader_train) + args.grad_accum_steps - 1) // args.grad_accum_steps
    lr_scheduler = None
    if args.sched:
        lr_scheduler, _ = create_scheduler_v2(optimizer, sched=args.sched, num_epochs=args.epochs,
                                              warmup_epochs=args.warmup_epochs, warmup_lr=args.warmup_lr,
                                              min_lr=args.min_lr, step_on_epochs=False,
                                              updates_per_epoch=updates_per_epoch)

    record = {"lr": [], "mixed_batches": []}
    num_updates = 0
    for epoch in range(args.epochs):
        if args.distributed:
            sampler.set_epoch(epoch)
        num_updates = train_one_epoch(epoch, model, loader_train, optimizer, train_loss_fn, args, lr_scheduler,
                                      model_ema, num_updates, record)
    record["updates"] = num_updates
    record["fused_groups"] = [bool(g.get("fused")) for g in optimizer.param_groups]   # torch's fused step, per group
    bare = model.module if isinstance(model, NativeDDP) else model
    if args.distributed:
        record["ddp"] = {"module_type": type(model.module).__name__,
                         "ddp_count": sum(isinstance(m, NativeDDP) for m in model.modules())}
    record["model"] = {k: v.detach().clone() for k, v in bare.state_dict().items()}
    record["model_ema"] = ({k: v.detach().clone() for k, v in model_ema.module.state_dict().items()}
                           if model_ema is not None else None)
    return record


if __name__ == "__main__":
    main(get_args_parser().parse_args())

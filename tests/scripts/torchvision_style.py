"""A classification training script shaped like torchvision's ``references/classification/train.py``, CPU-sized,
with aiak's one line added where a user would add it.

What it keeps of the reference: an ``ImageFolder`` with random train augmentation, a ``RandomSampler`` (a
``DistributedSampler`` with ``set_epoch`` under torchrun), SGD over two parameter groups (no weight decay on
normalization layers), ``CrossEntropyLoss(label_smoothing=...)``, gradient clipping with
``torch.nn.utils.clip_grad_norm_``, a linear warm-up then cosine schedule (``SequentialLR``) stepped once per
epoch, a model EMA (``AveragedModel`` with an EMA average, updated every ``model_ema_steps`` optimizer steps and
reset during warm-up), a checkpoint after every epoch and ``resume``, and the script's own
``DistributedDataParallel(model, device_ids=None)`` line with ``model_without_ddp = model.module``.

The aiak edits: the ``aiak.optimize`` line (after the model, optimizer, loader and scheduler exist, before the DDP
line), and ``aiak.stepped(optimizer)`` where the loop counts optimizer steps (the EMA cadence): under
``grad_accumulation`` a loop iteration is a micro-step, and the EMA must follow real steps.

For a seeded run to resume exactly, the checkpoint also carries torch's random state (the sampler's order and the
augmentation draw from it); the reference leaves that out. The EMA decay is taken per update as given, without the
reference's adjustment by batch size (which would differ between a full batch and the same batch in two halves).

``main(args)`` takes an ``argparse.Namespace`` or a dict of overrides of :func:`get_args_parser`'s defaults and
returns the final weights with what a test checks (see :func:`main`).
"""
from __future__ import annotations

import argparse
import datetime
import os
import tempfile
from functools import partial

import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torchvision import transforms

import aiak
from tests.scripts.synthetic_data import write_image_folder

NORM_LAYERS = {"batch": None, "group": partial(nn.GroupNorm, 1)}  # None: the model's own BatchNorm


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="torchvision-style classification training (CPU-sized)")
    parser.add_argument("--data-path", default=None, help="an ImageFolder root (default: a synthetic one)")
    parser.add_argument("--model", default="mobilenet_v3_small")
    parser.add_argument("--norm-layer", default="batch", choices=sorted(NORM_LAYERS),
                        help="group: GroupNorm(1, C), a per-sample normalization (half batches then accumulate to "
                             "the full batch's gradient exactly; BatchNorm's batch statistics would not)")
    parser.add_argument("--dropout", default=0.2, type=float)
    parser.add_argument("-b", "--batch-size", default=8, type=int)
    parser.add_argument("--epochs", default=3, type=int)
    parser.add_argument("-j", "--workers", default=0, type=int)
    parser.add_argument("--lr", default=0.1, type=float)
    parser.add_argument("--momentum", default=0.9, type=float)
    parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
    parser.add_argument("--norm-weight-decay", default=0.0, type=float)
    parser.add_argument("--label-smoothing", default=0.1, type=float)
    parser.add_argument("--lr-warmup-epochs", default=1, type=int)
    parser.add_argument("--lr-warmup-decay", default=0.1, type=float)
    parser.add_argument("--clip-grad-norm", default=1.0, type=float)
    parser.add_argument("--model-ema", default=True, action=argparse.BooleanOptionalAction)
    parser.add_argument("--model-ema-steps", default=2, type=int)
    parser.add_argument("--model-ema-decay", default=0.9, type=float)
    parser.add_argument("--output-dir", default=None, help="save a checkpoint after every epoch here")
    parser.add_argument("--resume", default=None, help="a checkpoint to resume from")
    parser.add_argument("--start-epoch", default=0, type=int)
    parser.add_argument("--seed", default=0, type=int)
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


def init_distributed_mode(args) -> None:
    """torchrun's environment (``RANK``, ``WORLD_SIZE``): one gloo process group, every wait bounded."""
    args.distributed = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if args.distributed and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    args.rank = dist.get_rank() if args.distributed else 0
    args.world_size = dist.get_world_size() if args.distributed else 1


def load_data(args):
    train_transform = transforms.Compose([
        transforms.RandomResizedCrop(32, scale=(0.5, 1.0), antialias=True),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)),
    ])
    dataset = torchvision.datasets.ImageFolder(args.data_path, train_transform)
    if args.distributed:
        sampler = torch.utils.data.distributed.DistributedSampler(dataset)
    else:
        sampler = torch.utils.data.RandomSampler(dataset)
    return dataset, sampler


def create_model(args, num_classes: int) -> nn.Module:
    kwargs = {"num_classes": num_classes, "dropout": args.dropout}
    if NORM_LAYERS[args.norm_layer] is not None:
        kwargs["norm_layer"] = NORM_LAYERS[args.norm_layer]
    return torchvision.models.get_model(args.model, **kwargs)


def optimizer_params(optimizer):
    for group in optimizer.param_groups:
        yield from group["params"]


def train_one_epoch(model, criterion, optimizer, data_loader, epoch, args, model_ema, record) -> None:
    model.train()
    update = 0  # optimizer steps taken this epoch: what the reference's batch index counts without accumulation
    for image, target in data_loader:
        output = model(image)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        norm = None
        if args.clip_grad_norm is not None:
            norm = nn.utils.clip_grad_norm_(optimizer_params(optimizer), args.clip_grad_norm)
        optimizer.step()
        if not aiak.stepped(optimizer):
            continue  # an accumulation micro-step: the weights did not change
        record["lr"].append(optimizer.param_groups[0]["lr"])
        if norm is not None:
            record["grad_norm"].append(norm.item())
        if model_ema is not None and update % args.model_ema_steps == 0:
            model_ema.update_parameters(model)
            record["ema_updates"] += 1
            if epoch < args.lr_warmup_epochs:
                model_ema.n_averaged.fill_(0)  # during warm-up the EMA keeps copying the weights
        update += 1
        record["optimizer_steps"] += 1


def evaluate(model, criterion, data_loader) -> dict:
    """The reference's evaluation: ``model.eval()``, every batch under ``torch.inference_mode()``."""
    model.eval()
    total, correct, loss_sum = 0, 0, 0.0
    with torch.inference_mode():
        for image, target in data_loader:
            output = model(image)
            loss_sum += criterion(output, target).item() * target.numel()
            correct += int((output.argmax(dim=1) == target).sum())
            total += target.numel()
    return {"loss": loss_sum / total, "acc1": correct / total, "output_dtype": str(output.dtype)}


def main(args) -> dict:
    """Train; returns ``model`` and ``model_ema`` (state dicts, cloned), ``lr`` and ``grad_norm`` (one per optimizer
    step), ``optimizer_steps``, ``ema_updates`` and, under torchrun, ``ddp`` (what the script's DDP line built)."""
    args = parse(args)
    init_distributed_mode(args)
    torch.manual_seed(args.seed)
    if args.data_path is None:
        args.data_path = str(write_image_folder(tempfile.mkdtemp(prefix="torchvision-style-")))

    dataset, train_sampler = load_data(args)
    data_loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=train_sampler,
                                              num_workers=args.workers, drop_last=True)
    test_transform = transforms.Compose([transforms.Resize(36), transforms.CenterCrop(32), transforms.ToTensor()])
    data_loader_test = torch.utils.data.DataLoader(
        torchvision.datasets.ImageFolder(args.data_path, test_transform), batch_size=args.batch_size,
        sampler=torch.utils.data.SequentialSampler(range(len(dataset))), num_workers=args.workers)

    model = create_model(args, num_classes=len(dataset.classes))
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    norm_params, other_params = torchvision.ops._utils.split_normalization_params(model)
    parameters = [{"params": p, "weight_decay": w}
                  for p, w in ((norm_params, args.norm_weight_decay), (other_params, args.weight_decay)) if p]
    optimizer = torch.optim.SGD(parameters, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)

    main_lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer,
                                                                   T_max=args.epochs - args.lr_warmup_epochs)
    warmup_lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=args.lr_warmup_decay,
                                                            total_iters=args.lr_warmup_epochs)
    lr_scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup_lr_scheduler, main_lr_scheduler],
                                                         milestones=[args.lr_warmup_epochs])

    if args.aiak is not None:
        model, optimizer, data_loader, lr_scheduler = aiak.optimize(
            model, optimizer, data_loader, scheduler=lr_scheduler, strategy=args.aiak)

    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=None)
        model_without_ddp = model.module

    model_ema = None
    if args.model_ema:
        model_ema = AveragedModel(model_without_ddp, multi_avg_fn=get_ema_multi_avg_fn(args.model_ema_decay),
                                  use_buffers=True)

    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu", weights_only=True)
        model_without_ddp.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
        args.start_epoch = checkpoint["epoch"] + 1
        if model_ema is not None:
            model_ema.load_state_dict(checkpoint["model_ema"])
        torch.set_rng_state(checkpoint["rng_state"])

    record = {"lr": [], "grad_norm": [], "optimizer_steps": 0, "ema_updates": 0, "eval": [], "eval_ema": []}
    for epoch in range(args.start_epoch, args.epochs):
        if args.distributed:
            train_sampler.set_epoch(epoch)
        train_one_epoch(model, criterion, optimizer, data_loader, epoch, args, model_ema, record)
        lr_scheduler.step()
        record["eval"].append(evaluate(model, criterion, data_loader_test))
        if model_ema is not None:
            record["eval_ema"].append(evaluate(model_ema, criterion, data_loader_test))
        if args.output_dir and args.rank == 0:
            checkpoint = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                          "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch,
                          "rng_state": torch.get_rng_state()}
            if model_ema is not None:
                checkpoint["model_ema"] = model_ema.state_dict()
            torch.save(checkpoint, os.path.join(args.output_dir, f"model_{epoch}.pth"))

    if args.distributed:
        record["ddp"] = {"module_type": type(model.module).__name__,
                         "ddp_count": sum(isinstance(m, nn.parallel.DistributedDataParallel) for m in model.modules())}
    record["model"] = clone_state(model_without_ddp)
    record["model_ema"] = clone_state(model_ema.module) if model_ema is not None else None
    return record


def clone_state(module: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


if __name__ == "__main__":
    main(get_args_parser().parse_args())

"""Large-batch ResNet training: LARS, gradient accumulation, O2 mixed precision and prefetching, one added line.

The script is what a user already has (``build`` and ``train``: a torchvision ResNet, SGD, a cosine schedule,
``loss.backward(); optimizer.step(); optimizer.zero_grad()``) plus ``aiak.optimize(...)`` in ``main``, with a
strategy that swaps SGD for LARS (You, Gitman and Ginsburg 2017: layer-wise trust ratios keep large batches
trainable), accumulates ``--accumulation`` micro-batches per optimizer step (an effective batch of
``--batch-size x --accumulation``), runs O2 (half-precision compute copies of the fp32 parameters; Micikevicius
et al. 2018; fp32 where the device only emulates bf16) and prefetches batches to the device. The checkpoint it saves loads into a plain torchvision model.

    python examples/train_cnn.py                                # GPU-sized: resnet50, 224x224, batch 256 x 4
    python examples/train_cnn.py --smoke                        # CPU-small: resnet18, 32x32, under a minute
    python examples/train_cnn.py --smoke --strategy examples/my_profile.yaml   # any profile, YAML or "auto"
    python examples/train_cnn.py --no-compare                   # train with aiak only

With ``--compare`` (the default) the same setup is also trained plain, alternating with the aiak run in rounds,
and the last line printed compares the two (``plain_vs_aiak.py``). Random weights and synthetic images:
nothing is downloaded.
"""
from __future__ import annotations

import argparse
import logging
import os
import tempfile

import torch
import torchvision
from torch import nn
from torch.utils.data import DataLoader

import aiak
from synthetic_data import SyntheticImages


def build(args, device):
    """The user's setup: model, optimizer, loader, scheduler (built the same way from the same seed every time)."""
    torch.manual_seed(args.seed)
    model = getattr(torchvision.models, args.model)(num_classes=args.num_classes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    dataset = SyntheticImages(args.samples, args.image_size, args.num_classes, args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        num_workers=args.workers, generator=torch.Generator().manual_seed(args.seed))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)  # stepped per epoch
    return model, optimizer, loader, scheduler


def held_out(args):
    """Validation batches: other images of the same classes (the comparison's loss)."""
    data = SyntheticImages(4 * args.batch_size, args.image_size, args.num_classes, args.seed, split="held_out")
    return list(DataLoader(data, batch_size=args.batch_size))


def train(model, optimizer, loader, scheduler, epochs, device):
    """The user's training loop, one step per ``next()``: each yields that step's loss."""
    criterion = nn.CrossEntropyLoss()
    model.train()
    for epoch in range(epochs):
        for images, labels in loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            loss = criterion(model(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            yield loss
        scheduler.step()


def strategy(args, device) -> dict:
    """What aiak applies (``aiak explain`` shows the same knobs for a YAML profile).

    LARS runs at ``--lars-lr`` (at the paper's trust coefficient 0.001); the scheduler passed to
    ``aiak.optimize`` keeps its cosine shape around that rate, as if it had been built on the LARS optimizer.
    """
    on_cuda = device.type == "cuda"
    return {
        "name": "train_cnn",
        "optimizer": {"name": "lars", "lr": args.lars_lr},
        "grad_accumulation": args.accumulation,
        "precision": ({"level": "O0"} if args.precision == "fp32"
                      else {"level": "O2", "dtype": args.precision, "loss_scale": "dynamic"}),
        "loader": {"prefetch": 2, "pin_memory": on_cuda},
        "channels_last": on_cuda,      # cuDNN's fastest layout with tensor cores; no gain on a CPU
        "cudnn_benchmark": on_cuda,
    }


def default_precision(device) -> str:
    """bf16 where ``device`` computes it natively, else fp32 (said on stdout, with how to force bf16)."""
    if aiak.amp.emulation_warning("bf16", device) is None:
        return "bf16"
    print(f"precision: fp32, since bf16 is emulated on this {device.type} (--precision bf16 forces it)")
    return "fp32"


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", default="cuda" if cuda else "cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU-small run (resnet18, 32x32 images, batch 16 x 2): checks the script in under a minute")
    ap.add_argument("--model", default="resnet50", help="a torchvision.models constructor (random weights)")
    ap.add_argument("--image-size", type=int, default=224, help="side of the square synthetic images")
    ap.add_argument("--num-classes", type=int, default=1000, help="classes of the synthetic images")
    ap.add_argument("--samples", type=int, default=65536, help="synthetic training images per epoch")
    ap.add_argument("--epochs", type=int, default=1, help="passes over the synthetic images")
    ap.add_argument("--batch-size", type=int, default=256, help="micro-batch: samples per forward/backward")
    ap.add_argument("--accumulation", type=int, default=4,
                    help="micro-batches per optimizer step (effective batch = batch size x this)")
    ap.add_argument("--lr", type=float, default=None,
                    help="SGD learning rate (default: 0.1 x batch size / 256, the linear scaling rule)")
    ap.add_argument("--lars-lr", type=float, default=2.0,
                    help="LARS learning rate of the aiak run, at trust coefficient 0.001 (You et al. 2017)")
    ap.add_argument("--weight-decay", type=float, default=5e-5, help="SGD weight decay (LARS takes it over)")
    ap.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default=None,
                    help="O2 half dtype (fp16 adds dynamic loss scaling; fp32 = O0). Default: bf16 where the device "
                         "computes it natively (a GPU >= sm80, a CPU with AVX512-BF16/AMX), else fp32: emulated bf16 "
                         "runs ~15x slower than fp32")
    ap.add_argument("--strategy", default=None,
                    help="use this aiak strategy instead of the script's: 'auto', a profile name or a YAML file")
    ap.add_argument("--workers", type=int, default=None, help="DataLoader workers (default: 4 on CUDA, 0 on CPU)")
    ap.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "aiak_train_cnn.pt"),
                    help="where to save the trained model (a plain torchvision state_dict under 'model')")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (both runs use it)")
    ap.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                    help="also train plain PyTorch, alternating with aiak in rounds, and print the before/after line")
    ap.add_argument("--rounds", type=int, default=8, help="rounds of the comparison (6 or more give a verdict)")
    args = ap.parse_args(argv)
    if args.smoke:
        small = dict(model="resnet18", image_size=32, num_classes=10, samples=768, epochs=1, batch_size=16,
                     accumulation=2)
        for key, value in small.items():
            if getattr(args, key) == ap.get_default(key):
                setattr(args, key, value)
    if args.precision is None:
        args.precision = default_precision(torch.device(args.device))
    if args.lr is None:
        args.lr = 0.1 * args.batch_size / 256
    if args.workers is None:
        args.workers = 4 if torch.device(args.device).type == "cuda" else 0
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")   # aiak logs what it applied, and why
    device = torch.device(args.device)
    model, optimizer, loader, scheduler = build(args, device)
    plan = aiak.load_strategy(args.strategy) if args.strategy not in (None, "auto") else None
    accumulation = plan.grad_accumulation if plan is not None else args.accumulation
    if args.compare:  # --- comparison only: the same setup again, left plain -----------------------------------
        from plain_vs_aiak import Side, check_steps, compare

        from aiak.runtime.rollback import read_switches

        check_steps(args.epochs * len(loader), args.rounds, multiple_of=accumulation)
        plain_setup, plain_switches = build(args, device), read_switches()

    # the one added line
    model, optimizer, loader, scheduler = aiak.optimize(model, optimizer, loader, scheduler=scheduler,
                                                        strategy=args.strategy or strategy(args, device))

    steps = train(model, optimizer, loader, scheduler, args.epochs, device)
    if args.compare:  # --- comparison only ---------------------------------------------------------------------
        line = compare(Side("plain", train(*plain_setup, args.epochs, device), plain_setup[0], plain_switches),
                       Side("aiak", steps, model, read_switches()), total_steps=args.epochs * len(loader),
                       samples_per_step=args.batch_size, device=device, held_out=held_out(args),
                       rounds=args.rounds, multiple_of=accumulation)
    else:
        for step, loss in enumerate(steps):
            if step % 100 == 0:
                print(f"step {step}: loss {loss.item():.4f}", flush=True)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "args": vars(args)}, args.checkpoint)
    print(f"checkpoint: {args.checkpoint} (load it with torchvision.models.{args.model}"
          f"(num_classes={args.num_classes}).load_state_dict(torch.load(path)['model']))")
    if args.compare:
        print(line)


if __name__ == "__main__":
    main()

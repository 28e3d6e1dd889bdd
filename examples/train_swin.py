"""Swin Transformer training with aiak's fused window attention and O2 bf16, one added line.

The script is what a user already has (``build`` and ``train``: a timm Swin, AdamW, the plain loop) plus
``aiak.optimize(...)`` in ``main``, with a strategy that swaps every timm ``WindowAttention`` for aiak's fused
one (``fused_ops: [window_attention]``: one Triton kernel on CUDA, one SDPA call elsewhere; the same function
within float rounding, same parameters and state_dict keys) and runs O2 in bf16 (bf16 compute copies of the
fp32 parameters, no loss scaling since bf16 has fp32's range; fp32 where the device only emulates bf16), with
TF32 and prefetching on CUDA.

    python examples/train_swin.py              # GPU-sized: swin_tiny_patch4_window7_224, 224x224, batch 128
    python examples/train_swin.py --smoke      # CPU-small: a 2-stage Swin, 32x32 images, window 4
    python examples/train_swin.py --no-compare # train with aiak only

It prints how many window-attention modules were fused. With ``--compare`` (the default) the same setup is also
trained plain, alternating with the aiak run in rounds, and the last line compares the two (``plain_vs_aiak.py``).
Random weights and synthetic images: nothing is downloaded.
"""
from __future__ import annotations

import argparse
import logging
import os
import tempfile

import timm
import torch
from timm.models.swin_transformer import WindowAttention
from torch import nn
from torch.utils.data import DataLoader

import aiak
from synthetic_data import SyntheticImages


def build(args, device):
    """The user's setup: model, optimizer, loader (built the same way from the same seed every time)."""
    torch.manual_seed(args.seed)
    model = timm.create_model(args.model, pretrained=False, num_classes=args.num_classes, img_size=args.image_size,
                              drop_path_rate=0.0, **args.model_overrides).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    dataset = SyntheticImages(args.samples, args.image_size, args.num_classes, args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        num_workers=args.workers, generator=torch.Generator().manual_seed(args.seed))
    return model, optimizer, loader


def held_out(args):
    """Validation batches: other images of the same classes (the comparison's loss)."""
    data = SyntheticImages(4 * args.batch_size, args.image_size, args.num_classes, args.seed, split="held_out")
    return list(DataLoader(data, batch_size=args.batch_size))


def train(model, optimizer, loader, epochs, device):
    """The user's training loop, one step per ``next()``: each yields that step's loss."""
    criterion = nn.CrossEntropyLoss()
    model.train()
    for _ in range(epochs):
        for images, labels in loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            loss = criterion(model(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            yield loss


def strategy(args, device) -> dict:
    """What aiak applies: the built-in ``swin`` profile's knobs (``aiak explain --strategy swin``), set here
    explicitly so that they apply on any device (O2 bf16; fp32 with ``--precision fp32``)."""
    on_cuda = device.type == "cuda"
    return {
        "name": "train_swin",
        "fused_ops": ["window_attention"],
        "precision": {"level": "O0"} if args.precision == "fp32" else {"level": "O2", "dtype": "bf16"},
        "tf32": on_cuda,
        "loader": {"prefetch": 2, "pin_memory": on_cuda},
    }


def fused_attention(model) -> str:
    """``"<fused> of <all> window-attention modules fused"``: aiak's surgery gives each module it swaps the class
    ``Fused<Name>`` (a subclass of timm's, so isinstance still holds)."""
    attention = [m for m in model.modules() if isinstance(m, WindowAttention)]
    fused = [m for m in attention if type(m).__name__.startswith("Fused")]
    return f"{len(fused)} of {len(attention)} window-attention modules fused"


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", default="cuda" if cuda else "cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU-small run (a 2-stage Swin, embed 32, 32x32 images, window 4, batch 16): under a minute")
    ap.add_argument("--model", default="swin_tiny_patch4_window7_224", help="a timm Swin name (random weights)")
    ap.add_argument("--image-size", type=int, default=224, help="side of the square synthetic images")
    ap.add_argument("--num-classes", type=int, default=1000, help="classes of the synthetic images")
    ap.add_argument("--samples", type=int, default=32768, help="synthetic training images per epoch")
    ap.add_argument("--epochs", type=int, default=1, help="passes over the synthetic images")
    ap.add_argument("--batch-size", type=int, default=128, help="images per step")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    ap.add_argument("--workers", type=int, default=None, help="DataLoader workers (default: 4 on CUDA, 0 on CPU)")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default=None,
                    help="O2 bf16, or fp32 (O0). Default: bf16 where the device computes it natively (a GPU >= sm80, "
                         "a CPU with AVX512-BF16/AMX), else fp32: emulated bf16 runs ~15x slower")
    ap.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "aiak_train_swin.pt"),
                    help="where to save the trained model (timm's own state_dict keys, under 'model')")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (both runs use it)")
    ap.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                    help="also train plain PyTorch, alternating with aiak in rounds, and print the before/after line")
    ap.add_argument("--rounds", type=int, default=8, help="rounds of the comparison (6 or more give a verdict)")
    args = ap.parse_args(argv)
    args.model_overrides = {}
    if args.smoke:
        small = dict(image_size=32, num_classes=10, samples=1024, batch_size=16)
        for key, value in small.items():
            if getattr(args, key) == ap.get_default(key):
                setattr(args, key, value)
        args.model_overrides = dict(window_size=4, embed_dim=32, depths=(2, 2), num_heads=(2, 4))
    if args.workers is None:
        args.workers = 4 if torch.device(args.device).type == "cuda" else 0
    if args.precision is None:
        args.precision = default_precision(torch.device(args.device))
    return args


def default_precision(device) -> str:
    """bf16 where ``device`` computes it natively, else fp32 (said on stdout, with how to force bf16)."""
    if aiak.amp.emulation_warning("bf16", device) is None:
        return "bf16"
    print(f"precision: fp32, since bf16 is emulated on this {device.type} (--precision bf16 forces it)")
    return "fp32"


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")   # aiak logs what it applied, and why
    device = torch.device(args.device)
    model, optimizer, loader = build(args, device)
    if args.compare:  # --- comparison only: the same setup again, left plain -----------------------------------
        from plain_vs_aiak import Side, check_steps, compare

        from aiak.runtime.rollback import read_switches

        check_steps(args.epochs * len(loader), args.rounds)
        plain_setup, plain_switches = build(args, device), read_switches()

    # the one added line
    model, optimizer, loader = aiak.optimize(model, optimizer, loader, strategy=strategy(args, device))

    print(f"fused window attention: {fused_attention(model)}", flush=True)
    steps = train(model, optimizer, loader, args.epochs, device)
    if args.compare:  # --- comparison only ---------------------------------------------------------------------
        line = compare(Side("plain", train(*plain_setup, args.epochs, device), plain_setup[0], plain_switches),
                       Side("aiak", steps, model, read_switches()), total_steps=args.epochs * len(loader),
                       samples_per_step=args.batch_size, device=device, held_out=held_out(args),
                       rounds=args.rounds)
    else:
        for step, loss in enumerate(steps):
            if step % 100 == 0:
                print(f"step {step}: loss {loss.item():.4f}", flush=True)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "args": vars(args)},
               args.checkpoint)
    print(f"checkpoint: {args.checkpoint}")
    if args.compare:
        print(line)


if __name__ == "__main__":
    main()

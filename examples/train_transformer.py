"""Transformer text classification on variable-length sequences: LAMB and length-balanced batches, one added line.

The script is what a user already has (``build`` and ``train``: a Transformer encoder classifier, AdamW, batches
padded to their longest sequence, the plain loop; ``DistributedSampler`` under ``torchrun``) plus
``aiak.optimize(...)`` in ``main``, with a strategy that swaps AdamW for LAMB (You et al. 2019: layer-wise
trust ratios for large batches), rebuilds the loader's batches from sequences of similar length
(``loader: {balanced: true}``: random batches of long-tailed text are mostly padding, and under DDP the rank
with the longest sequence makes every other rank wait), prefetches, and on CUDA runs O2 bf16 with TF32.
Under ``torchrun`` aiak wraps the model in DDP itself, with the ``comm:`` settings of ``--hierarchical`` and
``--compression`` (``multinode.sh`` runs it over 2 nodes).

    python examples/train_transformer.py                # GPU-sized: 6 layers x 512, sequences of 16-512 tokens
    python examples/train_transformer.py --smoke        # CPU-small: 2 layers x 64, 8-128 tokens, under a minute
    torchrun --nproc-per-node 2 examples/train_transformer.py --smoke --hierarchical true --compression fp16

It prints the share of padded tokens with plain batches and with aiak's. With ``--compare`` (the default) the
same setup is also trained plain (under ``torchrun``: in plain DDP), alternating with the aiak run in rounds, and
the last line compares the two (``plain_vs_aiak.py``). ``--checksum-file`` appends every rank's weight digest,
which must agree across ranks. Synthetic token sequences: nothing is downloaded.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

import aiak
from synthetic_data import SyntheticText

PAD = SyntheticText.PAD


class TextClassifier(nn.Module):
    """Token + learned position embeddings, a pre-norm Transformer encoder that ignores padding, the mean of the
    real tokens, a linear head."""

    def __init__(self, vocab: int, num_classes: int, dim: int, heads: int, layers: int, max_len: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.position = nn.Embedding(max_len, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pad = tokens.eq(PAD)
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        x = self.encoder(x, src_key_padding_mask=pad)
        real = (~pad).unsqueeze(-1).to(x.dtype)
        return self.head(self.norm((x * real).sum(1) / real.sum(1)))


def pad_batch(samples):
    """Collate ``(tokens, label)`` pairs into a ``[batch, longest]`` tensor padded with ``PAD``, and the labels."""
    tokens, labels = zip(*samples)
    return pad_sequence(list(tokens), batch_first=True, padding_value=PAD), torch.stack(list(labels))


def build(args, device):
    """The user's setup: model, optimizer, loader and its sampler (the same from the same seed every time)."""
    torch.manual_seed(args.seed)
    model = TextClassifier(args.vocab, args.num_classes, args.dim, args.heads, args.layers, args.max_len).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    dataset = SyntheticText(args.samples, args.vocab, args.num_classes, args.min_len, args.max_len, args.seed)
    sampler = (DistributedSampler(dataset, shuffle=True, seed=args.seed) if dist.is_initialized()
               else RandomSampler(dataset, generator=torch.Generator().manual_seed(args.seed)))
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, collate_fn=pad_batch, drop_last=True,
                        num_workers=args.workers)
    return model, optimizer, loader, sampler


def held_out(args):
    """Validation batches: other sequences of the same classes (the comparison's loss)."""
    data = SyntheticText(4 * args.batch_size, args.vocab, args.num_classes, args.min_len, args.max_len, args.seed,
                         split="held_out")
    return list(DataLoader(data, batch_size=args.batch_size, collate_fn=pad_batch))


class PaddingCount:
    """Padded token slots against all token slots of the batches a run trained on."""

    def __init__(self):
        self.slots, self.padded = 0, 0

    def add(self, tokens: torch.Tensor) -> None:
        self.slots += tokens.numel()
        self.padded = self.padded + tokens.eq(PAD).sum()   # stays on the device: no sync per step

    def share(self) -> float:
        return float(self.padded) / max(self.slots, 1)


def train(model, optimizer, loader, sampler, epochs, device, padding: PaddingCount):
    """The user's training loop, one step per ``next()``: each yields that step's loss."""
    criterion = nn.CrossEntropyLoss()
    model.train()
    for epoch in range(epochs):
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
        for tokens, labels in loader:
            tokens, labels = tokens.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            loss = criterion(model(tokens), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            padding.add(tokens)
            yield loss


def strategy(args, device) -> dict:
    """What aiak applies (``aiak explain`` shows the same knobs for a YAML profile)."""
    on_cuda = device.type == "cuda"
    return {
        "name": "train_transformer",
        "optimizer": {"name": "lamb", "lr": args.lamb_lr},     # betas and weight decay carried over from AdamW
        "loader": {"balanced": True, "prefetch": 2, "pin_memory": on_cuda},
        "precision": ({"level": "O0"} if args.precision == "fp32"
                      else {"level": "O2", "dtype": args.precision, "loss_scale": "dynamic"}),
        "tf32": on_cuda,
        "comm": {"hierarchical": args.hierarchical, "compression": args.compression},
    }


def init_distributed(args) -> torch.device:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1) join the process group, one GPU per local rank; the device to use."""
    device = torch.device(args.device)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=timedelta(seconds=args.dist_timeout))
    return device


def weight_digest(model) -> str:
    """sha256 of every tensor of ``model.state_dict()`` (its bytes, in key order): equal on every rank of a DDP job
    whose ranks stayed in step."""
    digest = hashlib.sha256()
    for key, tensor in model.state_dict().items():
        digest.update(key.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _bool_or_auto(value: str):
    choices = {"auto": "auto", "true": True, "false": False}
    if value.lower() not in choices:
        raise argparse.ArgumentTypeError(f"expected auto, true or false, got {value!r}")
    return choices[value.lower()]


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", default="cuda" if cuda else "cpu", help="cpu or cuda (under torchrun: cuda:LOCAL_RANK)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU-small run (2 layers x 64, sequences of 8-128 tokens, batch 16): under a minute")
    ap.add_argument("--vocab", type=int, default=32000, help="token ids 1..vocab-1 (0 is padding)")
    ap.add_argument("--num-classes", type=int, default=16, help="classes of the synthetic sequences")
    ap.add_argument("--dim", type=int, default=512, help="model width")
    ap.add_argument("--heads", type=int, default=8, help="attention heads")
    ap.add_argument("--layers", type=int, default=6, help="encoder layers")
    ap.add_argument("--min-len", type=int, default=16, help="shortest sequence (tokens)")
    ap.add_argument("--max-len", type=int, default=512, help="longest sequence (tokens)")
    ap.add_argument("--samples", type=int, default=131072, help="synthetic sequences per epoch (all ranks)")
    ap.add_argument("--epochs", type=int, default=1, help="passes over the synthetic sequences")
    ap.add_argument("--batch-size", type=int, default=64, help="sequences per rank and step")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (the plain run's)")
    ap.add_argument("--lamb-lr", type=float, default=5e-3,
                    help="LAMB learning rate (aiak's run): its layer-wise trust ratio bounds each step by the "
                         "weights' norm, so it takes larger rates than Adam")
    ap.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default=None,
                    help="O2 half dtype, fp32 = O0 (default: bf16 on CUDA, fp32 on a CPU)")
    ap.add_argument("--hierarchical", type=_bool_or_auto, default="auto",
                    help="comm.hierarchical under torchrun: auto, true or false (two-level allreduce across nodes)")
    ap.add_argument("--compression", choices=["none", "fp16", "bf16", "int8"], default="none",
                    help="comm.compression under torchrun: gradients on the wire in this dtype")
    ap.add_argument("--dist-timeout", type=float, default=300.0, help="seconds a collective may wait for a rank")
    ap.add_argument("--workers", type=int, default=None, help="DataLoader workers (default: 4 on CUDA, 0 on CPU)")
    ap.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "aiak_train_transformer.pt"),
                    help="where rank 0 saves the trained model (a plain state_dict under 'model')")
    ap.add_argument("--checksum-file", default=None,
                    help="append 'rank <r> <sha256 of the weights>' for every rank to this file")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (both runs use it)")
    ap.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                    help="also train plain PyTorch, alternating with aiak in rounds, and print the before/after line")
    ap.add_argument("--rounds", type=int, default=8, help="rounds of the comparison (6 or more give a verdict)")
    args = ap.parse_args(argv)
    if args.smoke:
        small = dict(vocab=1000, num_classes=4, dim=64, heads=4, layers=2, min_len=8, max_len=128, samples=1024,
                     batch_size=16)
        for key, value in small.items():
            if getattr(args, key) == ap.get_default(key):
                setattr(args, key, value)
    on_cuda = torch.device(args.device).type == "cuda"
    if args.precision is None:
        args.precision = "bf16" if on_cuda else "fp32"
    if args.workers is None:
        args.workers = 4 if on_cuda else 0
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device = init_distributed(args)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    model, optimizer, loader, sampler = build(args, device)
    if args.compare:  # --- comparison only: the same setup again, left plain (in plain DDP under torchrun) -----
        from torch.nn.parallel import DistributedDataParallel as DDP

        from plain_vs_aiak import Side, check_steps, compare

        from aiak.runtime.rollback import read_switches

        check_steps(args.epochs * len(loader), args.rounds)
        plain_model, plain_optimizer, plain_loader, plain_sampler = build(args, device)
        if world > 1:
            plain_model = DDP(plain_model, device_ids=[device.index] if device.type == "cuda" else None)
        plain_padding, plain_switches = PaddingCount(), read_switches()

    # the one added line
    model, optimizer, loader = aiak.optimize(model, optimizer, loader, strategy=strategy(args, device))

    padding = PaddingCount()
    steps = train(model, optimizer, loader, sampler, args.epochs, device, padding)
    if args.compare:  # --- comparison only ---------------------------------------------------------------------
        plain_steps = train(plain_model, plain_optimizer, plain_loader, plain_sampler, args.epochs, device,
                            plain_padding)
        line = compare(Side("plain", plain_steps, plain_model, plain_switches),
                       Side("aiak", steps, model, read_switches()),
                       total_steps=args.epochs * min(len(plain_loader), len(loader)),
                       samples_per_step=args.batch_size * world, device=device, held_out=held_out(args),
                       rounds=args.rounds)
    else:
        for step, loss in enumerate(steps):
            if step % 100 == 0 and rank == 0:
                print(f"step {step}: loss {loss.item():.4f}", flush=True)
    if args.checksum_file:
        digest = weight_digest(model)
        with open(args.checksum_file, "a") as f:
            f.write(f"rank {rank} {digest}\n")
        print(f"rank {rank}: weights sha256 {digest}", flush=True)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "args": vars(args)},
                   args.checkpoint)
        print(f"checkpoint: {args.checkpoint}")
        plain_share = f"plain {plain_padding.share():.0%}, " if args.compare else ""
        print(f"padded tokens (rank 0): {plain_share}aiak {padding.share():.0%} of all token slots")
        if args.compare:
            print(line, flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A plain PyTorch training script with one added line: ``aiak.optimize``.

    python examples/train_cnn.py                      # strategy "auto"
    python examples/train_cnn.py --strategy large_batch
    python examples/train_cnn.py --strategy examples/my_profile.yaml

CPU-small by default (a few seconds); on a GPU pass --device cuda and a bigger --samples.
"""
import argparse
import logging

import torch
from torch import nn
from torch.utils.data import DataLoader

import aiak
from aiak.demo import DemoNet, synthetic_dataset


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    model = DemoNet().to(args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    loader = DataLoader(synthetic_dataset(args.samples), batch_size=64, shuffle=True, drop_last=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))

    # the one added line
    model, optimizer, loader, scheduler = aiak.optimize(model, optimizer, loader, strategy=args.strategy,
                                                        scheduler=scheduler)

    criterion = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        for x, y in loader:
            x, y = x.to(args.device), y.to(args.device)
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        print(f"epoch {epoch}: loss {loss.item():.4f}")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, "/tmp/aiak_example.pt")


if __name__ == "__main__":
    main()

"""A tiny image-classification folder on disk (``root/<class>/<n>.png``), the layout torchvision's ``ImageFolder``
and timm's ``ImageDataset`` read: the reference scripts train from such a folder, so ours do too, and their
augmentation runs on real decoded images.

Each class has its own mean colour under per-pixel noise, so a few epochs of training move the weights in a
consistent direction; the images are a pure function of ``seed``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = 4


def write_image_folder(root, classes: int = CLASSES, per_class: int = 8, size: int = 40, seed: int = 0) -> Path:
    """Write ``classes * per_class`` RGB PNGs of ``size`` x ``size`` pixels under ``root``; returns ``root``."""
    root = Path(root)
    rng = np.random.RandomState(seed)
    for c in range(classes):
        folder = root / f"class_{c}"
        folder.mkdir(parents=True, exist_ok=True)
        tint = rng.uniform(40, 215, size=3)
        for n in range(per_class):
            pixels = np.clip(tint + rng.normal(0, 40, size=(size, size, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"{n}.png")
    return root

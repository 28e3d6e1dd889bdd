"""dali_loader on a generated JPEG folder with a CPU-only DALI pipeline (device_id=None).

Every image is one solid colour that encodes its identity (red = index in its class, green = class), so
a batch can be traced back to the files it came from through decoding, resizing and normalization.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("nvidia.dali", reason="needs the dali extra")
np = pytest.importorskip("numpy")
Image = pytest.importorskip("PIL.Image")

from aiak.loaders import dali_loader  # noqa: E402
from aiak.loaders.dali import IMAGENET_MEAN, IMAGENET_STD  # noqa: E402

pytestmark = pytest.mark.timeout(120)

CLASSES, PER_CLASS = 3, 7


def red(index: int) -> int:
    return 20 + 30 * index


def green(label: int) -> int:
    return 40 + 80 * label


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    for label in range(CLASSES):
        (root / f"class_{label}").mkdir()
        for index in range(PER_CLASS):
            h, w = 40 + 6 * index, 64 - 4 * label  # different sizes and aspect ratios
            pixels = np.empty((h, w, 3), dtype=np.uint8)
            pixels[...] = (red(index), green(label), 128)
            Image.fromarray(pixels).save(root / f"class_{label}" / f"{index}.jpg", quality=95)
    return str(root)


def pixel_values(images: torch.Tensor, layout: str) -> torch.Tensor:
    """Undo the normalization: (N, 3) mean RGB in 0..255."""
    channels = images if layout == "NCHW" else images.permute(0, 3, 1, 2)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255
    return (channels * std + mean).mean(dim=(2, 3))


def identities(loader, layout="NCHW"):
    seen = []
    for images, labels in loader:
        rgb = pixel_values(images, layout)
        for (r, g, _), label in zip(rgb.tolist(), labels.tolist()):
            assert round((g - 40) / 80) == label, "label does not match the image's class folder"
            seen.append((label, round((r - 20) / 30)))
    return seen


def test_eval_shards_are_disjoint_cover_the_data_and_labels_match(image_folder):
    loaders = [dali_loader(image_folder, 4, train=False, size=32, rank=r, world_size=2, num_threads=1)
               for r in range(2)]
    assert len(loaders[0]) == len(loaders[1]) == 3  # 21 files -> shards of 11 (padded) -> 3 batches each
    shards = [identities(loader) for loader in loaders]
    assert set(shards[0]).isdisjoint(shards[1])
    assert sorted(shards[0] + shards[1]) == [(c, i) for c in range(CLASSES) for i in range(PER_CLASS)]
    again = [identities(loader) for loader in loaders]  # second epoch: still a partition
    assert sorted(again[0] + again[1]) == sorted(shards[0] + shards[1])


def test_eval_batches_shapes_dtypes_and_normalized_values(image_folder):
    loader = dali_loader(image_folder, 5, train=False, size=24, num_threads=1)
    assert len(loader) == 5 and loader.num_samples == 21  # eval keeps the partial last batch
    sizes = []
    for images, labels in loader:
        assert images.dtype == torch.float32 and images.shape[1:] == (3, 24, 24) and images.device.type == "cpu"
        assert labels.dtype == torch.int64 and labels.shape == (images.shape[0],)
        pixels = pixel_values(images, "NCHW")[:, 2]
        torch.testing.assert_close(pixels, torch.full_like(pixels, 128.0), atol=3.0, rtol=0)  # blue = 128
        sizes.append(images.shape[0])
    assert sum(sizes) == 21


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_train_random_crop_flip_layout_and_value_range(image_folder, layout):
    loader = dali_loader(image_folder, 4, train=True, size=16, layout=layout, num_threads=1, seed=3)
    assert len(loader) == 5  # 21 // 4, the partial batch is dropped for training
    low = min((0 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD))
    high = max((1 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD))
    count = 0
    for epoch in range(2):
        for images, labels in loader:
            expected = (4, 3, 16, 16) if layout == "NCHW" else (4, 16, 16, 3)
            assert images.shape == expected and images.dtype == torch.float32
            assert float(images.min()) >= low - 1e-3 and float(images.max()) <= high + 1e-3
            assert labels.dtype == torch.int64 and set(labels.tolist()) <= set(range(CLASSES))
            identities([(images, labels)], layout)  # labels still match the pixels after augmentation
            count += 1
    assert count == 10  # two full epochs


def test_bad_arguments_name_the_argument(image_folder, tmp_path):
    with pytest.raises(ValueError, match=r"layout must be one of \['NCHW', 'NHWC'\]"):
        dali_loader(image_folder, 4, layout="CHW")
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        dali_loader(image_folder, 0)
    with pytest.raises(FileNotFoundError, match="root"):
        dali_loader(str(tmp_path / "missing"), 4)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        dali_loader(image_folder, 4, rank=2, world_size=2)


def test_missing_dali_raises_an_import_error_naming_the_extra(image_folder, monkeypatch):
    for name in ("nvidia.dali", "nvidia.dali.fn", "nvidia.dali.plugin.pytorch"):
        monkeypatch.setitem(sys.modules, name, None)  # what ``import`` sees when the package is absent
    with pytest.raises(ImportError, match=r"pip install 'aiak\[dali\]'"):
        dali_loader(image_folder, 4)


def test_importing_aiak_loaders_does_not_import_dali():
    code = "import sys, aiak, aiak.loaders; assert 'nvidia.dali' not in sys.modules, 'DALI imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.fixture(scope="module")
def half_bright_folder(tmp_path_factory):
    """One class of images whose left half is black and right half white."""
    root = tmp_path_factory.mktemp("halves")
    (root / "only").mkdir()
    for index in range(8):
        pixels = np.zeros((48, 64 + 8 * index, 3), dtype=np.uint8)
        pixels[:, pixels.shape[1] // 2:] = 255
        Image.fromarray(pixels).save(root / "only" / f"{index}.jpg", quality=95)
    return str(root)


def bright_on_right(images: torch.Tensor) -> list:
    """Per image: mean of the right half minus mean of the left half (> 0: not flipped)."""
    w = images.shape[-1]
    return (images[..., w // 2:].mean(dim=(1, 2, 3)) - images[..., :w // 2].mean(dim=(1, 2, 3))).tolist()


def test_train_flips_and_crops_at_random_while_eval_is_deterministic(half_bright_folder):
    train = dali_loader(half_bright_folder, 4, train=True, size=32, num_threads=1, seed=11)
    contrasts = [c for _ in range(2) for images, _ in train for c in bright_on_right(images)]
    assert any(c > 0.5 for c in contrasts) and any(c < -0.5 for c in contrasts), "no random flip seen"
    means = [float(m) for _ in range(2) for images, _ in train for m in images.mean(dim=(1, 2, 3))]
    assert max(means) - min(means) > 0.1, "random-resized crops should vary the bright fraction"
    evaluation = dali_loader(half_bright_folder, 4, train=False, size=32, num_threads=1)
    assert all(c > 0.5 for images, _ in evaluation for c in bright_on_right(images))

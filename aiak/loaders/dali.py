"""An NVIDIA DALI image-classification pipeline (JPEG files in class subfolders) as an iterable of torch batches.

The pipeline is the standard ImageNet recipe of the DALI ResNet-50 example and of Goyal et al. (2017,
"Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour"): training reads a reshuffled, per-rank shard of
the file list, decodes, takes a random-resized crop (scale 8%-100%, aspect 3/4-4/3) and a random horizontal
flip; evaluation resizes the shorter side to ``size * 256 / 224`` and takes a center crop. Both normalize
with per-channel mean/std and return float images (NCHW or NHWC) and int64 labels.

Decoding runs on the CPU when ``device_id`` is None (a CPU-only machine), otherwise with DALI's "mixed"
decoder (nvJPEG) and the augmentations on that GPU. Requires the ``dali`` extra: ``pip install 'aiak[dali]'``.
"""
from __future__ import annotations

import os
from typing import Iterator, Optional, Sequence, Tuple

import torch

from aiak.loaders.balanced_sampler import _default_rank_and_world

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
LAYOUTS = ("NCHW", "NHWC")


def _import_dali():
    try:
        import nvidia.dali  # noqa: F401
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
    except ImportError as exc:
        raise ImportError("aiak.loaders.dali_loader needs NVIDIA DALI: pip install 'aiak[dali]' "
                          f"(nvidia-dali-cuda120); import failed with: {exc}") from exc
    return fn, pipeline_def, types, DALIGenericIterator, LastBatchPolicy


def _build_pipeline(root: str, *, train: bool, size: int, batch_size: int, device_id: Optional[int], num_threads: int,
                    shard_id: int, num_shards: int, seed: int, mean: Sequence[float], std: Sequence[float],
                    layout: str, scale: Tuple[float, float], ratio: Tuple[float, float], resize_ratio: float,
                    prefetch_queue_depth: int, reader_name: str):
    fn, pipeline_def, types, _, _ = _import_dali()
    on_gpu = device_id is not None

    @pipeline_def
    def image_folder_pipeline():
        # Same reader seed on every rank: all ranks shuffle the file list identically, then take disjoint shards.
        jpegs, labels = fn.readers.file(file_root=root, shard_id=shard_id, num_shards=num_shards,
                                        shuffle_after_epoch=train, pad_last_batch=True, seed=seed,
                                        name=reader_name)
        decode_device = "mixed" if on_gpu else "cpu"
        if train:
            images = fn.decoders.image_random_crop(jpegs, device=decode_device, output_type=types.RGB,
                                                   random_area=list(scale), random_aspect_ratio=list(ratio),
                                                   num_attempts=10)
            images = fn.resize(images, resize_x=size, resize_y=size)
            mirror = fn.random.coin_flip(probability=0.5)
        else:
            images = fn.decoders.image(jpegs, device=decode_device, output_type=types.RGB)
            images = fn.resize(images, resize_shorter=int(round(size * resize_ratio)))
            mirror = False
        images = fn.crop_mirror_normalize(
            images, dtype=types.FLOAT, output_layout="CHW" if layout == "NCHW" else "HWC", crop=(size, size),
            mean=[m * 255.0 for m in mean], std=[s * 255.0 for s in std], mirror=mirror)
        if on_gpu:
            labels = labels.gpu()
        return images, labels

    # Augmentation seeds differ per rank; the reader seed above is shared.
    pipe = image_folder_pipeline(batch_size=batch_size, num_threads=num_threads, device_id=device_id,
                                 seed=seed + 1 + shard_id, prefetch_queue_depth=prefetch_queue_depth)
    pipe.build()
    return pipe


class DaliLoader:
    """Iterable of ``(images, labels)`` torch batches from a DALI pipeline; ``len()`` is batches per epoch.

    Images are float32 in the requested layout, labels int64 of shape ``(batch,)``; tensors live on the CPU
    for a CPU pipeline and on the pipeline's GPU otherwise.
    """

    def __init__(self, iterator, batch_size: int, num_samples: int, device: torch.device):
        self._iterator = iterator
        self.batch_size = batch_size
        self.num_samples = num_samples
        self.device = device

    def __len__(self) -> int:
        return len(self._iterator)

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        # The DALI iterator resets itself at the end of each epoch (auto_reset). It cannot rewind mid-epoch:
        # after a ``break`` the next ``iter()`` continues the interrupted epoch.
        for outputs in self._iterator:
            out = outputs[0]
            yield out["images"], out["labels"].view(-1).long()

    def set_epoch(self, epoch: int) -> None:
        """Nothing to do: the DALI reader reshuffles on its own at each epoch (kept for loop compatibility)."""


def dali_loader(root: str, batch_size: int, *, train: bool = True, size: int = 224, device_id: Optional[int] = None,
                num_threads: int = 2, rank: Optional[int] = None, world_size: Optional[int] = None, seed: int = 0,
                mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD, layout: str = "NCHW",
                scale: Tuple[float, float] = (0.08, 1.0), ratio: Tuple[float, float] = (3 / 4, 4 / 3),
                resize_ratio: float = 256 / 224, drop_last: Optional[bool] = None,
                prefetch_queue_depth: int = 2) -> DaliLoader:
    """Build a DALI pipeline over `root/<class>/<image>.jpg` and return it as an iterable of torch batches.

    JPEG decoding and augmentation on the GPU (nvJPEG) keep the CPU from being the bottleneck of an image model's
    training; the result is iterated like a `DataLoader` of `(images, labels)`. NVIDIA DALI is imported only here.

    Args:
        root: folder with one subfolder per class (labels are the sorted subfolder indices).
        batch_size: images per rank per step.
        train: random-resized crop + flip (True) or resize + center crop (False).
        size: output height and width.
        device_id: GPU to decode and augment on; None decodes on the CPU and returns CPU tensors.
        num_threads: CPU threads of the pipeline.
        rank: the shard of the data this process reads (default: the process group's rank, else 0). Shards are
            disjoint and cover the dataset every epoch.
        world_size: the number of shards (default: the process group's size, else 1).
        seed: must be the same on every rank (it shuffles the file list); augmentations use `seed + rank`.
        mean: per-channel mean in [0, 1] units, subtracted after decoding.
        std: per-channel standard deviation in [0, 1] units.
        layout: "NCHW" or "NHWC" output.
        scale: the random-resized crop's range of area fractions (training).
        ratio: the random-resized crop's range of aspect ratios (training).
        resize_ratio: evaluation resizes the shorter side to `size * resize_ratio`, then crops the center.
        drop_last: drop the last partial batch (default: True for training, False for eval). Every rank gets
            the same number of batches either way (shards are padded to equal size).
        prefetch_queue_depth: batches DALI prepares ahead.

    Returns:
        An iterable of `(images, labels)` torch batches with `len()` (batches per epoch) and `set_epoch()`.

    Raises:
        ImportError: NVIDIA DALI is not installed (`pip install 'aiak[dali]'`).
        FileNotFoundError: `root` is not a folder.
        ValueError: an unknown `layout`, a `batch_size` that is not a positive integer, `mean`/`std` without 3
            values, or a `rank` outside `[0, world_size)`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"dali_loader: layout must be one of {list(LAYOUTS)}, got {layout!r}")
    if not os.path.isdir(root):
        raise FileNotFoundError(f"dali_loader: root {root!r} is not a folder of class subfolders")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"dali_loader: batch_size must be a positive integer, got {batch_size!r}")
    if len(mean) != 3 or len(std) != 3:
        raise ValueError(f"dali_loader: mean and std need 3 values (RGB), got {list(mean)} and {list(std)}")
    rank, world_size = _default_rank_and_world(rank, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"dali_loader: rank must be in [0, {world_size}), got {rank}")
    _, _, _, DALIGenericIterator, LastBatchPolicy = _import_dali()
    reader_name = "aiak_reader"
    pipe = _build_pipeline(root, train=train, size=size, batch_size=batch_size, device_id=device_id,
                           num_threads=num_threads, shard_id=rank, num_shards=world_size, seed=seed, mean=mean,
                           std=std, layout=layout, scale=tuple(scale), ratio=tuple(ratio),
                           resize_ratio=resize_ratio, prefetch_queue_depth=prefetch_queue_depth,
                           reader_name=reader_name)
    drop_last = train if drop_last is None else drop_last
    policy = LastBatchPolicy.DROP if drop_last else LastBatchPolicy.PARTIAL
    iterator = DALIGenericIterator([pipe], ["images", "labels"], reader_name=reader_name,
                                   last_batch_policy=policy, auto_reset=True)
    num_samples = pipe.reader_meta(reader_name)["epoch_size"]
    device = torch.device("cuda", device_id) if device_id is not None else torch.device("cpu")
    return DaliLoader(iterator, batch_size, num_samples, device)

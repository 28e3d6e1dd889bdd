"""PrefetchLoader: same batches as the wrapped loader, real overlap, clean stops, errors surfaced, no leaks."""
from __future__ import annotations

import collections
import dataclasses
import gc
import threading
import time
import traceback
import weakref

import pytest
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from aiak.loaders import PrefetchLoader

pytestmark = pytest.mark.timeout(120)


def prefetch_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "aiak-prefetch")


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


class Squares(Dataset):
    def __init__(self, n: int, fail_at: int = -1, delay: float = 0.0):
        self.n, self.fail_at, self.delay = n, fail_at, delay
        self.reads = 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads += 1
        if self.delay:
            time.sleep(self.delay)
        if i == self.fail_at:
            raise ValueError(f"corrupt sample {i}")
        return torch.tensor([float(i), float(i * i)])


@pytest.fixture(autouse=True)
def no_thread_left_behind():
    before = prefetch_threads()
    yield
    assert wait_until(lambda: prefetch_threads() <= before), "a prefetch thread outlived its test"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_same_batches_in_same_order_as_the_wrapped_dataloader(num_workers):
    loader = DataLoader(Squares(23), batch_size=4, num_workers=num_workers)
    expected = [b.clone() for b in loader]
    got = list(PrefetchLoader(loader, "cpu", depth=3))
    assert len(got) == len(expected) == 6
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_wraps_any_reiterable_and_a_one_shot_generator():
    batches = [torch.randn(2, 3) for _ in range(5)]
    assert all(torch.equal(a, b) for a, b in zip(PrefetchLoader(batches, "cpu"), batches))
    generator = (b * 2 for b in batches)
    assert [torch.equal(a, b * 2) for a, b in zip(PrefetchLoader(generator, "cpu"), batches)] == [True] * 5


Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass
class Record:
    x: torch.Tensor
    meta: str


class Custom:
    """A user batch type that knows how to move itself (like torch_geometric's Batch)."""

    def __init__(self, x):
        self.x = x
        self.moved_to = None

    def to(self, device, non_blocking=False):
        out = Custom(self.x.to(device, non_blocking=non_blocking))
        out.moved_to = torch.device(device)
        return out


def test_nested_batches_keep_their_types_and_values():
    x = torch.arange(6.0).view(2, 3)
    batches = [(x, [x + 1, {"k": x + 2}]), Pair(x, 7), Record(x, "m"), {"a": Pair(x, x)}, Custom(x)]
    got = list(PrefetchLoader(batches, "cpu"))
    assert isinstance(got[0], tuple) and isinstance(got[0][1], list) and torch.equal(got[0][1][1]["k"], x + 2)
    assert isinstance(got[1], Pair) and got[1].y == 7 and torch.equal(got[1].x, x)
    assert isinstance(got[2], Record) and got[2].meta == "m" and torch.equal(got[2].x, x)
    assert isinstance(got[3]["a"], Pair) and torch.equal(got[3]["a"].y, x)
    assert isinstance(got[4], Custom) and got[4].moved_to == torch.device("cpu") and torch.equal(got[4].x, x)


def test_loading_overlaps_the_step_and_keeps_depth_batches_ready():
    """Batches 0 and 1 load in the step (telling whether loading draws random numbers); while the consumer is
    still busy with batch 1, the thread loads batch 2, ... up to depth + 1 more."""
    depth = 3
    started = []
    started_third = threading.Event()

    def source():
        for i in range(20):
            started.append(i)
            if i == 2:
                started_third.set()
            yield torch.tensor([i])

    it = iter(PrefetchLoader(type("Once", (), {"__iter__": lambda self: source()})(), "cpu", depth=depth))
    first, second = next(it), next(it)
    # A serial loader would only start batch 2 after we ask for it: this wait would time out.
    assert started_third.wait(timeout=10), "batch 2 was not loaded while batch 1 was being processed"
    assert wait_until(lambda: len(started) >= depth + 3)
    time.sleep(0.2)  # the thread must now be blocked: depth batches queued + one in hand
    assert len(started) == depth + 3
    assert (first.item(), second.item()) == (0, 1) and [b.item() for b in it] == list(range(2, 20))


class ThreadsSeen(Dataset):
    """Records, for each sample, the loading thread's name and its torch intra-op thread count."""

    def __init__(self, n: int):
        self.n, self.seen = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.seen.append((threading.current_thread().name, torch.get_num_threads()))
        return torch.full((3, 64, 64), float(i))


def test_loading_in_the_prefetch_thread_computes_on_one_intra_op_thread():
    """The thread's torch ops (the collate's stack, the channels_last layout) run on one intra-op thread: an OpenMP
    team of its own would make every thread of the process, the training loop's, sleep between parallel regions
    (aiak.util.background_threads). The loop's own count is untouched."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        data = ThreadsSeen(64)
        batches = list(PrefetchLoader(DataLoader(data, batch_size=16), "cpu", channels_last=True))
        in_thread = {count for name, count in data.seen if name == "aiak-prefetch"}
        assert in_thread == {1}, data.seen
        assert torch.get_num_threads() == 2
        assert [float(b[0, 0, 0, 0]) for b in batches] == [0.0, 16.0, 32.0, 48.0]
        assert all(b.is_contiguous(memory_format=torch.channels_last) for b in batches)
    finally:
        torch.set_num_threads(before)


def test_error_in_fifth_sample_reraises_with_its_traceback():
    loader = PrefetchLoader(DataLoader(Squares(10, fail_at=4), batch_size=1), "cpu")
    seen = []
    with pytest.raises(ValueError, match="corrupt sample 4") as info:
        for batch in loader:
            seen.append(int(batch[0, 0]))
    assert seen == [0, 1, 2, 3]
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "__getitem__" in frames, frames  # the original frames where loading failed are kept
    assert wait_until(lambda: prefetch_threads() == 0)
    # The next epoch is fresh and fails at the same place again (no stale state).
    with pytest.raises(ValueError, match="corrupt sample 4"):
        list(loader)


@pytest.mark.slow
def test_error_in_a_worker_process_reraises_in_the_loop():
    loader = PrefetchLoader(DataLoader(Squares(10, fail_at=4), batch_size=1, num_workers=2), "cpu")
    with pytest.raises(ValueError, match="corrupt sample 4"):
        for _ in loader:
            pass
    gc.collect()  # torch shuts the failed workers down when the exception's frames are collected (~10 s)


def test_break_after_three_batches_a_hundred_times_leaves_no_thread():
    baseline = threading.active_count()
    loader = PrefetchLoader(DataLoader(Squares(64), batch_size=2), "cpu", depth=2)
    firsts = []
    for _ in range(100):
        for step, batch in enumerate(loader):
            if step == 0:
                firsts.append(int(batch[0, 0]))
            if step == 2:
                break
    assert firsts == [0] * 100  # every iter() is a fresh epoch
    assert wait_until(lambda: threading.active_count() <= baseline), (threading.active_count(), baseline)


@pytest.mark.slow
def test_break_then_new_epoch_with_persistent_workers():
    """A persistent-workers DataLoader reuses one iterator: the old thread must be out of it before reset."""
    plain = DataLoader(Squares(40, delay=0.005), batch_size=2, num_workers=2, persistent_workers=True)
    loader = PrefetchLoader(plain, "cpu")
    for _ in range(20):
        for step, batch in enumerate(loader):
            if step == 0:
                assert batch[:, 0].tolist() == [0.0, 1.0]
            if step == 2:
                break
    assert torch.equal(torch.cat(list(loader)), torch.cat(list(plain)))
    del plain._iterator  # shut the persistent workers down now


def test_break_stops_loading_at_once():
    dataset = Squares(1000, delay=0.02)
    loader = PrefetchLoader(DataLoader(dataset, batch_size=1), "cpu", depth=2)
    for step, _ in enumerate(loader):
        if step == 2:
            break
    assert wait_until(lambda: prefetch_threads() == 0)
    reads = dataset.reads
    time.sleep(0.3)
    assert dataset.reads == reads <= 3 + 2 + 2, "the loader kept reading after the loop left"


def test_new_iter_stops_the_previous_epoch():
    loader = PrefetchLoader(DataLoader(Squares(100), batch_size=1), "cpu")
    first = iter(loader)
    next(first), next(first)  # the first two batches load in the step, then the thread takes over
    assert prefetch_threads() == 1
    second = iter(loader)
    assert wait_until(lambda: prefetch_threads() == 0)
    with pytest.raises(StopIteration):
        next(first)
    assert [int(next(second)[0, 0]) for _ in range(2)] == [0, 1]
    assert prefetch_threads() == 1
    del first, second


def test_hundreds_of_epochs_leak_no_thread_and_no_epoch_object():
    baseline = threading.active_count()
    loader = PrefetchLoader(DataLoader(Squares(8), batch_size=2), "cpu")
    epochs = []
    for _ in range(300):
        it = iter(loader)
        epochs.append(weakref.ref(it))
        assert sum(b.shape[0] for b in it) == 8
    del it
    gc.collect()
    assert all(ref() is None for ref in epochs), "epoch iterators (and their queues) are kept alive"
    assert wait_until(lambda: threading.active_count() <= baseline), (baseline, threading.enumerate())


def test_passthrough_len_sampler_dataset_batch_size_set_epoch():
    dataset = Squares(40)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=3)
    plain = DataLoader(dataset, batch_size=5, sampler=sampler)
    loader = PrefetchLoader(plain, "cpu")
    assert len(loader) == len(plain) == 4
    assert loader.sampler is sampler and loader.dataset is dataset and loader.batch_size == 5
    assert loader.drop_last is False  # any other attribute is forwarded
    loader.set_epoch(1)
    epoch1 = torch.cat(list(loader))
    loader.set_epoch(2)
    epoch2 = torch.cat(list(loader))
    sampler.set_epoch(1)
    torch.testing.assert_close(epoch1, torch.cat(list(plain)), rtol=0, atol=0)
    assert not torch.equal(epoch1, epoch2)  # set_epoch reached the DistributedSampler


def test_normalize_uint8_images_and_channels_last():
    images = torch.randint(0, 256, (4, 3, 5, 6), dtype=torch.uint8)
    labels = torch.arange(4)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    (x, y), = list(PrefetchLoader([(images, labels)], "cpu", mean=mean, std=std, channels_last=True))
    ref = (images.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    torch.testing.assert_close(x, ref, rtol=1e-6, atol=1e-6)
    assert x.dtype == torch.float32 and x.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(y, labels) and y.dtype == torch.int64  # labels untouched

    floats = images.float() / 255
    source = floats.clone()
    (x,), = list(PrefetchLoader([(floats,)], "cpu", mean=mean, std=std))
    torch.testing.assert_close(x, ref, rtol=1e-6, atol=1e-6)  # float input is taken as [0, 1]
    assert torch.equal(floats, source), "the loader's own tensor was modified in place"


@pytest.mark.parametrize("kwargs, match", [
    ({"depth": 0}, "depth must be an integer >= 1"),
    ({"mean": (0.5,)}, "mean and std must be given together"),
    ({"mean": (0.5,), "std": (0.1, 0.2)}, "same length"),
    ({"dtype": torch.int64}, "floating dtype"),
])
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrefetchLoader([torch.zeros(1)], "cpu", **kwargs)
    with pytest.raises(TypeError, match="iterable of batches"):
        PrefetchLoader(3, "cpu")


def test_training_through_the_prefetcher_gives_the_same_weights():
    """Same batches, same order: a model trained through PrefetchLoader ends bit-identical to the baseline."""
    def train(wrap):
        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 5), torch.randn(64, 1))
        loader = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
        loader = PrefetchLoader(loader, "cpu", depth=2) if wrap else loader
        model = torch.nn.Linear(5, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            for x, y in loader:
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    torch.testing.assert_close(train(True), train(False), rtol=0, atol=0)


def test_attribute_writes_reach_the_wrapped_loader_as_reads_do():
    """timm's train.py turns mixup off in a late epoch with ``loader_train.mixup_enabled = False``: on aiak's
    prefetcher around timm's own loader the write must reach timm's collate (it once landed on the wrapper, and
    mixup stayed on); the wrapper's own settings and names the loader lacks stay on the wrapper."""
    import numpy as np
    from timm.data import FastCollateMixup
    from timm.data.loader import PrefetchLoader as TimmPrefetchLoader

    import aiak

    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return np.full((3, 4, 4), i * 10, dtype=np.uint8), i % 2

    mixup = FastCollateMixup(mixup_alpha=1.0, num_classes=2)
    timm_loader = TimmPrefetchLoader(torch.utils.data.DataLoader(Images(), batch_size=4, collate_fn=mixup),
                                     device=torch.device("cpu"))
    model = torch.nn.Linear(2, 2)
    _, _, loader = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), timm_loader,
                                 strategy={"loader": {"prefetch": 2}})
    assert isinstance(loader, PrefetchLoader) and loader.mixup_enabled is True
    loader.mixup_enabled = False
    assert mixup.mixup_enabled is False and loader.mixup_enabled is False
    loader.depth = 3                      # the wrapper's own setting
    loader.note = "mine"                  # a name the loader lacks
    assert loader.__dict__["depth"] == 3 and not hasattr(timm_loader, "note") and loader.note == "mine"
    images, targets = next(iter(loader))  # unmixed now: one-hot targets (with timm's label smoothing)
    assert torch.all(targets.max(dim=1).values > 0.8)

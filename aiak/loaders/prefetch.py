"""Prefetching loader: a background thread keeps ``depth`` batches ready, on the device, while the model computes.

Without prefetching, loading batch ``i + 1`` and the training step on batch ``i`` run in series, so an epoch
costs ``n * (L + C)`` instead of ``n * max(L, C)``. Pinned host memory makes the host-to-device copy faster, but
only a copy issued on a side CUDA stream, overlapped with the forward pass, removes it from the critical path.

The CUDA path follows the idea of timm's ``PrefetchLoader`` (``timm/data/loader.py``: side-stream copy,
on-device normalize, ``wait_stream`` before use) and adds what a correct prefetcher also needs:

* the copy runs on a side stream and records an event; the consumer's current stream waits on that event;
* a batch that is already on the GPU (DALI's GPU output, a loader yielding CUDA tensors) was written by kernels
  the source queued on the current stream of the thread that called its ``next()``; the side stream waits on
  that stream before it reads the batch, and the batch's tensors get ``record_stream(side_stream)``, so the
  caching allocator does not hand their memory to the source's next batch while side-stream kernels still read
  them. Tensors that need no work are returned as they are, ordered after the source's kernels through the
  same wait and event;
* every tensor handed to the consumer gets ``record_stream(consumer_stream)``, so the caching allocator does
  not hand its memory back to the side stream while the compute stream still reads it;
* the work happens in a thread, so loading overlaps the step even over a ``DataLoader(num_workers=0)``,
  a generator or a DALI iterator;
* unless loading draws random numbers in this process (``num_workers=0`` with random augmentation): torch's,
  Python's and NumPy's generators are shared by all threads, so a loading thread and a step drawing too
  (dropout) would race for them, and a seeded run would give other weights each time. The first batch of each
  epoch is loaded in the step, and the generators' states compared around it: if it drew nothing, or only the
  seed a ``RandomSampler`` draws once per epoch (checked by replaying that one draw on a copy of the state),
  the thread takes over from the second batch. Otherwise the second batch is loaded in the step too and the
  states compared again (the first may have drawn a sampler's permutation): if it drew, the epoch goes on
  loading in the step, in plain PyTorch's order (one warning says to use ``num_workers >= 1``, whose workers
  draw from their own seeded generators); otherwise the thread takes over.

On CPU the same thread still overlaps loading with compute; pinning and streams are skipped.
"""
from __future__ import annotations

import copy
import queue
import threading
import weakref
from collections.abc import Mapping
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import torch

from aiak.util.nested import iter_tensors, map_tensors
from aiak.util.rng import GlobalRng
from aiak.util.background_threads import compute_on_one_thread, stop_at_exit
from aiak.util.warn import warn, warn_once


_END = object()  # sentinel put by the worker thread after the last batch


class _Failure:
    """An exception raised while loading, carried to the consumer thread and re-raised there."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


def _is_leaf_object(obj: Any) -> bool:
    """A batch that is neither a tensor nor a container ``map_tensors`` walks, e.g. a user class with ``.to()``."""
    return not isinstance(obj, (torch.Tensor, list, tuple, Mapping)) and not hasattr(obj, "__dataclass_fields__") \
        and callable(getattr(obj, "to", None))


class _BatchMover:
    """Pins, copies, normalizes and lays out one batch (runs in the worker thread)."""

    def __init__(self, device: torch.device, pin_memory: bool, mean: Optional[Sequence[float]],
                 std: Optional[Sequence[float]], channels_last: bool, dtype: torch.dtype):
        self.device = device
        self.cuda = device.type == "cuda"
        self.pin_memory = pin_memory and self.cuda
        self.channels_last = channels_last
        self.dtype = dtype
        self.mean = self.std = None
        if mean is not None:
            # Kept as (1, C, 1, 1) on the target device; created lazily in the worker (CUDA context there).
            self._mean_host = torch.as_tensor(mean, dtype=dtype).view(1, -1, 1, 1)
            self._std_host = torch.as_tensor(std, dtype=dtype).view(1, -1, 1, 1)
        else:
            self._mean_host = self._std_host = None
        self.stream = None

    def _image_tensor(self, t: torch.Tensor) -> bool:
        """Normalize / channels_last apply to 4-D NCHW image batches (channel count = len(mean) when given)."""
        if t.dim() != 4:
            return False
        if self._mean_host is not None:
            return t.shape[1] == self._mean_host.shape[1]
        return t.is_floating_point()

    def _finish(self, t: torch.Tensor) -> torch.Tensor:
        if not self._image_tensor(t):
            return t
        if self._mean_host is not None:
            if self.mean is None or self.mean.device != t.device:
                self.mean = self._mean_host.to(t.device)
                self.std = self._std_host.to(t.device)
            x = t.to(self.dtype)
            x = x / 255.0 if not t.is_floating_point() else x
            t = x.sub(self.mean).div_(self.std)  # out of place first: never modify the loader's own tensor
        if self.channels_last:
            t = t.contiguous(memory_format=torch.channels_last)
        return t

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        if self.pin_memory and t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()
        t = t.to(self.device, non_blocking=self.cuda)
        return self._finish(t)

    def __call__(self, batch: Any):
        """Return ``(moved_batch, event)``; ``event`` is None off CUDA. Called right after the source's ``next()``."""
        if not self.cuda:
            return self._move(batch), None
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=self.device)
        cuda_inputs = [t for t in _tensors_of(batch) if t.is_cuda]
        with torch.cuda.device(self.device):
            # The kernels writing a CUDA batch were queued by the source on this thread's current stream of
            # their device, before it returned from next(): all of them are in the queue now.
            for device in {t.device for t in cuda_inputs}:
                self.stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self.stream):
                moved = self._move(batch)
                event = torch.cuda.Event()
                event.record(self.stream)
        for t in cuda_inputs:
            t.record_stream(self.stream)
        return moved, event

    def _move(self, batch: Any) -> Any:
        if _is_leaf_object(batch):
            if self.pin_memory and callable(getattr(batch, "pin_memory", None)):
                batch = batch.pin_memory()
            return batch.to(self.device, non_blocking=self.cuda)
        return map_tensors(batch, self._tensor)


def _tensors_of(batch: Any):
    """Tensors to protect with ``record_stream``: those ``map_tensors`` sees, or a leaf object's attributes."""
    if _is_leaf_object(batch) and hasattr(batch, "__dict__"):
        return iter_tensors(dict(vars(batch)))
    return iter_tensors(batch)


def _produce(source: Iterator, mover: _BatchMover, out: "queue.Queue", stop: threading.Event) -> None:
    """Worker thread body: load, move, enqueue; stop as soon as ``stop`` is set. Never blocks forever. Its torch ops
    (a collate's ``torch.stack``, the layout) run on one intra-op thread: the training loop's cores are computing
    (`aiak.util.background_threads.compute_on_one_thread`)."""
    compute_on_one_thread()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    try:
        while not stop.is_set():
            try:
                batch = next(source)
            except StopIteration:
                put(_END)
                return
            if stop.is_set() or not put(mover(batch)):
                return
    except BaseException as exc:  # re-raised in the consumer, with its traceback
        put(_Failure(exc))
    finally:
        del source  # drop the loader iterator here (shuts DataLoader workers down) instead of at thread teardown


def _after_a_sampler_seed(a: GlobalRng) -> GlobalRng:
    """``a`` advanced by exactly the draw ``RandomSampler.__iter__`` makes without a generator of its own."""
    g = torch.Generator()
    g.set_state(a.torch)
    torch.empty((), dtype=torch.int64).random_(generator=g)
    advanced = copy.copy(a)
    advanced.torch = g.get_state()
    return advanced


def _draws_a_sampler_seed(loader: Any) -> bool:
    """True if the first ``next()`` on a fresh iterator of ``loader`` draws one seed from torch's generator: a
    ``DataLoader(num_workers=0)`` whose ``RandomSampler`` has no generator (with workers, ``iter()`` draws it)."""
    from torch.utils.data import DataLoader, RandomSampler

    if not isinstance(loader, DataLoader) or loader.num_workers > 0:
        return False
    sampler = loader.sampler if loader.batch_sampler is None else getattr(loader.batch_sampler, "sampler", None)
    return isinstance(sampler, RandomSampler) and sampler.generator is None


class _PrefetchIterator:
    """One epoch: loads its first batch (or two) in the step, then, if loading drew no random numbers, owns a
    worker thread; closing it (``break``, garbage collection) stops the thread.

    ``sampler_seed``: the first batch may draw one ``RandomSampler`` seed (see ``_draws_a_sampler_seed``).
    """

    def __init__(self, source: Iterator, mover: _BatchMover, depth: int, join_timeout: float,
                 sampler_seed: bool = False):
        self._queue: "queue.Queue" = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._source: Optional[Iterator] = source
        self._mover = mover
        self._join_timeout = join_timeout
        self._thread: Optional[threading.Thread] = None
        self._in_step = None  # decided at batch 0 or 1: load in the step (True) or in the thread (False)
        self._sampler_seed = sampler_seed
        self._loaded = 0
        self._done = False

    def __iter__(self) -> "_PrefetchIterator":
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        if self._in_step is None and self._loaded == 0:
            self._loaded += 1
            before = GlobalRng()
            batch = self._load_in_step()
            after = GlobalRng()
            if before.same_as(after) or (self._sampler_seed and _after_a_sampler_seed(before).same_as(after)):
                self._start_thread()
            return batch
        if self._in_step is None:  # batch 0 drew something besides a sampler seed: does batch 1 draw too?
            before = GlobalRng()
            batch = self._load_in_step()
            self._in_step = not before.same_as(GlobalRng())
            if self._in_step:
                warn_once("prefetch-rng", "aiak PrefetchLoader: loading draws random numbers in the training process "
                          "(a DataLoader with num_workers=0 and random augmentation): prefetching it in a thread "
                          "would race with the step for the same generators and make a seeded run "
                          "non-deterministic, so batches load in the step, without overlap. Use num_workers >= 1 "
                          "to load in the background")
            else:
                self._start_thread()
            return batch
        if self._in_step:
            return self._load_in_step()
        while True:
            try:
                item = self._queue.get(timeout=0.1)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self.close()
                    raise RuntimeError("aiak PrefetchLoader: the loading thread stopped without a result") from None
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.exc  # the original exception object: its traceback shows where loading failed
        return self._hand_over(*item)

    def _start_thread(self) -> None:
        self._in_step = False
        self._thread = threading.Thread(target=_produce, args=(self._source, self._mover, self._queue, self._stop),
                                        name="aiak-prefetch", daemon=True)
        self._source = None
        self._thread.start()
        stop_at_exit(self)

    def _load_in_step(self) -> Any:
        try:
            batch = next(self._source)
        except BaseException:  # StopIteration at the end, or the loader's error
            self.close()
            raise
        return self._hand_over(*self._mover(batch))

    def _hand_over(self, batch: Any, event) -> Any:
        if event is not None:
            consumer = torch.cuda.current_stream(self._mover.device)
            consumer.wait_event(event)
            for t in _tensors_of(batch):
                if t.device.type == "cuda":
                    t.record_stream(consumer)
        return batch

    def wait_stopped(self, timeout: float) -> bool:
        """Wait until the worker thread has left the loader (it may be finishing a batch); True if it has."""
        self.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)
        return self._thread is None or not self._thread.is_alive()

    def stop_for_exit(self) -> None:
        """At interpreter exit: the thread leaves the loader before Python finalizes (``aiak.util.background_threads``)."""
        self.close()

    def close(self) -> None:
        """Stop the worker thread now; batches already prepared are dropped."""
        if self._done:
            return
        self._done = True
        self._stop.set()
        self._source = None  # loading in the step: drop the loader's iterator now (shuts DataLoader workers down)
        while True:  # free prepared batches (device memory) and unblock a pending put
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not None and self._thread is not threading.current_thread():
            # A loader blocked inside ``next()`` finishes its current batch, then sees ``stop`` and exits.
            self._thread.join(timeout=self._join_timeout)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


_OWN = frozenset({"loader", "device", "depth", "pin_memory", "join_timeout", "_mover_args", "_active"})


class PrefetchLoader:
    """Wrap any iterable of batches so that the next `depth` batches load, and move to `device`, in the background.

    The training step then never waits for the loader's next batch or its host-to-device copy (a side CUDA stream
    on a GPU, a thread everywhere), as timm's `PrefetchLoader` does. `len()`, `.sampler`, `.dataset`, `.batch_size`,
    `set_epoch()` and other attributes pass through to `loader`, for writes too (`loader.mixup_enabled = False`
    reaches a loader that has `mixup_enabled`). Every `iter()` starts a fresh epoch (and stops the previous epoch's
    thread); leaving an epoch early stops its thread at once; an exception raised while loading is re-raised in the
    training loop.

    Args:
        loader: a `DataLoader`, a DALI iterator, a list or any re-iterable of batches. Batches may be tensors or
            nested tuples/lists/dicts/namedtuples/dataclasses of tensors, or objects with `.to()` (and optionally
            `.pin_memory()`).
        device: target device (default: the current CUDA device if CUDA is available, else CPU).
        depth: batches kept ready (>= 1). The thread prepares one more while the queue is full.
        pin_memory: pin host tensors before the copy (CUDA only; a no-op elsewhere).
        mean: optional per-channel mean in [0, 1] units, subtracted on the device from 4-D NCHW tensors with
            `len(mean)` channels; uint8 inputs are divided by 255 first and come out as `dtype`.
        std: the per-channel standard deviation that goes with `mean`.
        channels_last: return 4-D image tensors in `torch.channels_last` memory format.
        dtype: floating dtype of normalized images.
        join_timeout: seconds `break` waits for the thread to stop (a loader stuck in `next()` is left to
            finish its current batch as a daemon thread; it never blocks the training loop longer).

    Raises:
        TypeError: `loader` is not an iterable of batches.
        ValueError: `depth` is not an integer >= 1.
    """

    def __init__(self, loader: Iterable, device: Union[str, torch.device, None] = None, depth: int = 2, *,
                 pin_memory: bool = True, mean: Optional[Sequence[float]] = None,
                 std: Optional[Sequence[float]] = None, channels_last: bool = False,
                 dtype: torch.dtype = torch.float32, join_timeout: float = 1.0):
        if not hasattr(loader, "__iter__"):
            raise TypeError(f"PrefetchLoader: loader must be an iterable of batches, got {type(loader).__name__}")
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"PrefetchLoader: depth must be an integer >= 1, got {depth!r}")
        if (mean is None) != (std is None):
            raise ValueError("PrefetchLoader: mean and std must be given together (or neither)")
        if mean is not None and len(mean) != len(std):
            raise ValueError(f"PrefetchLoader: mean and std must have the same length, got {len(mean)} and {len(std)}")
        if not dtype.is_floating_point:
            raise ValueError(f"PrefetchLoader: dtype must be a floating dtype, got {dtype}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.loader = loader
        self.device = device
        self.depth = depth
        self.pin_memory = pin_memory
        self.join_timeout = join_timeout
        self._mover_args = (device, pin_memory, mean, std, channels_last, dtype)
        self._active: Optional[weakref.ref] = None

    def __iter__(self) -> Iterator:
        previous = self._active() if self._active is not None else None
        # The previous epoch's thread must be out of the loader before a new iter() touches it (a DataLoader
        # with persistent_workers resets the very iterator that thread may still be reading).
        if previous is not None and not previous.wait_stopped(timeout=60.0):
            warn("aiak PrefetchLoader: the previous epoch's loading thread is still inside the loader after 60 s; "
                 "starting the new epoch anyway")
        epoch = _PrefetchIterator(iter(self.loader), _BatchMover(*self._mover_args), self.depth, self.join_timeout,
                                  sampler_seed=_draws_a_sampler_seed(self.loader))
        self._active = weakref.ref(epoch)
        return epoch

    def prepare(self, batch: Any) -> Any:
        """One batch of the wrapped loader as this loader would yield it (on its device, normalized, laid out),
        made now in the calling thread: what the trials of ``aiak.optimize`` feed a model."""
        moved, event = _BatchMover(*self._mover_args)(batch)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        return moved

    def around(self, loader: Iterable) -> "PrefetchLoader":
        """A PrefetchLoader with this one's settings around ``loader``."""
        device, pin_memory, mean, std, channels_last, dtype = self._mover_args
        return PrefetchLoader(loader, device, self.depth, pin_memory=pin_memory, mean=mean, std=std,
                              channels_last=channels_last, dtype=dtype, join_timeout=self.join_timeout)

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """Forward to the loader, or to its sampler / batch sampler (``DistributedSampler`` shuffling)."""
        if callable(getattr(self.loader, "set_epoch", None)):
            self.loader.set_epoch(epoch)
            return
        for owner in (getattr(self.loader, "sampler", None), getattr(self.loader, "batch_sampler", None)):
            if callable(getattr(owner, "set_epoch", None)):
                owner.set_epoch(epoch)

    @property
    def sampler(self):
        return self.loader.sampler

    @property
    def dataset(self):
        return self.loader.dataset

    @property
    def batch_size(self):
        return self.loader.batch_size

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "loader" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["loader"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        """A write the wrapped loader can take reaches it, as a read does (timm turns mixup off with
        ``loader.mixup_enabled = False``); the wrapper's own settings, and names the loader lacks, stay here."""
        loader = self.__dict__.get("loader")
        if name in _OWN or loader is None or not hasattr(loader, name):
            object.__setattr__(self, name, value)
        else:
            setattr(loader, name, value)

    def __repr__(self) -> str:
        return f"PrefetchLoader({self.loader!r}, device={self.device}, depth={self.depth})"

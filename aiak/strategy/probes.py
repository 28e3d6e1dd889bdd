"""Probes: the facts the auto-selector's ``match:`` rules are evaluated against.

:func:`probe` gathers, in one :class:`Probes` record (``to_dict()`` is JSON-ready, for the decision record):

* hardware: the model's device, the CUDA device's name / capability / count / memory, this CPU's ISA flags,
  model name and usable cores, and whether bf16 / fp16 run in hardware there;
* distribution: world size, ranks per node, nodes and backend of the initialized process group;
* model: parameter counts and how many modules of each kind in :data:`MODULE_KINDS`;
* loader: batch size, workers, pinned memory and whether the samples differ in length;
* the optimizer's class name.

Probes only observe. Importing this module reads no file and never touches CUDA; :func:`probe` touches CUDA
only when the model's device is a CUDA device. With an initialized process group, :func:`probe` is a
collective (the topology is gathered from every rank, :func:`aiak.comm.topology.detect_topology`), so every
rank calls it, as ``optimize()`` does.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import platform
import random
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Set, Tuple

import torch
from torch import nn
from torch.utils.data import IterableDataset

CPUINFO = "/proc/cpuinfo"

# CPU flags (as /proc/cpuinfo spells them) under which oneDNN runs bf16 convolutions and matmuls in
# hardware: AVX512-BF16 (Cooper Lake, Zen 4 and later), AMX-BF16 (Sapphire Rapids and later), and
# FEAT_BF16 on aarch64 (its "Features" line says "bf16").
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
# Flags that give the CPU fp16 arithmetic (AVX512-FP16, AMX-FP16; aarch64 "fphp"/"asimdhp").
NATIVE_FP16_CPU_FLAGS = frozenset({"avx512_fp16", "amx_fp16", "fphp", "asimdhp"})

# Compute capabilities from which CUDA runs bf16 (Ampere tensor cores) and fp16 (Volta tensor cores) natively.
CUDA_NATIVE_BF16 = (8, 0)
CUDA_NATIVE_FP16 = (7, 0)

# Module kinds a profile's ``match.modules`` can name; :func:`module_counts` counts each.
MODULE_KINDS = ("conv2d", "conv3d", "batchnorm", "layernorm", "groupnorm", "linear", "embedding",
                "multihead_attention", "window_attention", "dropout")

# How many samples of a map-style dataset the loader probe reads, at most, to tell variable-length data.
LENGTH_PROBE_SAMPLES = 32


@dataclass
class Probes:
    """What :func:`probe` found. Hand-built instances describe other machines (tests, ``aiak explain``)."""

    # hardware
    device: str = "cpu"                             # the model's device type: "cpu" | "cuda"
    cuda: Optional[Dict[str, Any]] = None           # {name, capability "8.0", count, memory_gb} of that device
    cpu_features: FrozenSet[str] = frozenset()
    cpu_cores: int = 1
    cpu_model: str = ""
    bf16_native: bool = False
    fp16_native: bool = False
    # distribution
    world_size: int = 1
    local_size: int = 1
    nodes: int = 1
    backend: Optional[str] = None
    # model
    params: int = 0
    trainable_params: int = 0
    modules: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(MODULE_KINDS, 0))
    # loader and optimizer
    loader: Dict[str, Any] = field(default_factory=lambda: {
        "present": False, "batch_size": None, "num_workers": None, "pin_memory": None, "variable_length": None})
    optimizer: Optional[str] = None

    @property
    def cuda_capability(self) -> Optional[Tuple[int, int]]:
        """``(major, minor)`` of the CUDA device, None off CUDA."""
        if self.device != "cuda" or not self.cuda:
            return None
        major, _, minor = str(self.cuda["capability"]).partition(".")
        return int(major), int(minor or 0)

    def to_dict(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        out["cpu_features"] = sorted(self.cpu_features)
        return out


def probe(model: Optional[nn.Module] = None, optimizer: Any = None, loader: Any = None,
          device: Any = None) -> Probes:
    """Probe the hardware ``model`` runs on (``device`` overrides it, as in ``optimize``), the process group,
    the model, the loader and the optimizer."""
    dev = model_device(model, device)
    features = cpu_features()
    cuda, capability = _cuda_info(dev), cuda_capability(dev)
    if dev.type == "cuda":
        bf16 = capability is not None and capability >= CUDA_NATIVE_BF16
        fp16 = capability is not None and capability >= CUDA_NATIVE_FP16
    else:
        bf16, fp16 = has_native_bf16_cpu(features), bool(features & NATIVE_FP16_CPU_FLAGS)
    world_size, local_size, nodes, backend = _distribution()
    params = list(model.parameters()) if model is not None else []
    return Probes(
        device=dev.type, cuda=cuda, cpu_features=features, cpu_cores=_usable_cores(), cpu_model=cpu_model(),
        bf16_native=bf16, fp16_native=fp16,
        world_size=world_size, local_size=local_size, nodes=nodes, backend=backend,
        params=sum(p.numel() for p in params), trainable_params=sum(p.numel() for p in params if p.requires_grad),
        modules=module_counts(model), loader=loader_facts(loader),
        optimizer=type(optimizer).__name__ if optimizer is not None else None)


def model_device(model: Optional[nn.Module], device: Any = None) -> torch.device:
    """``device`` if given, else the device of the model's first parameter, else the CPU."""
    if device is not None:
        return torch.device(device)
    if model is not None:
        for p in model.parameters():
            return p.device
    return torch.device("cpu")


# -- hardware -------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def cpu_features() -> FrozenSet[str]:
    """The flags of the first CPU listed in ``/proc/cpuinfo`` (Linux), e.g. ``{"avx512f", "avx512_bf16",
    "amx_bf16", "amx_tile", ...}``; an empty set on other systems or when the file cannot be read.

    x86 kernels list them on a ``flags`` line, aarch64 kernels on a ``Features`` line.
    """
    value = _cpuinfo_field(("flags", "Features"))
    return frozenset(value.split()) if value else frozenset()


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    """The ``model name`` line of ``/proc/cpuinfo`` (e.g. "AMD EPYC"), else ``platform.processor()``."""
    return _cpuinfo_field(("model name",)) or platform.processor()


def _cpuinfo_field(keys: Tuple[str, ...]) -> Optional[str]:
    """The value of the first line of ``/proc/cpuinfo`` whose key is in ``keys``; None off Linux or unreadable."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open(CPUINFO, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() in keys:
                    return value.strip()
    except OSError:
        pass
    return None


def _usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers and ``taskset`` narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def has_native_bf16_cpu(features: Optional[FrozenSet[str]] = None) -> bool:
    """True if the CPU (default: this one) computes bf16 in hardware (see ``NATIVE_BF16_CPU_FLAGS``)."""
    return bool((cpu_features() if features is None else features) & NATIVE_BF16_CPU_FLAGS)


def cuda_capability(device: Any) -> Optional[Tuple[int, int]]:
    """``(major, minor)`` compute capability of a CUDA device; None for any other device or without CUDA.

    ``device`` is a ``torch.device`` or anything ``torch.device()`` accepts (``"cuda:1"``); a bare ``"cuda"``
    means the current CUDA device. Only a CUDA device makes this touch CUDA.
    """
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return _capability_of(dev.index if dev.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _capability_of(index: int) -> Tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def _cuda_info(dev: torch.device) -> Optional[Dict[str, Any]]:
    """Name, capability, device count and memory of the CUDA device ``dev``; None off CUDA."""
    capability = cuda_capability(dev)
    if capability is None:
        return None
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {"name": props.name, "capability": f"{capability[0]}.{capability[1]}",
            "count": torch.cuda.device_count(), "memory_gb": round(props.total_memory / 2 ** 30, 1)}


# -- distribution ---------------------------------------------------------------------------------------------
def _distribution() -> Tuple[int, int, int, Optional[str]]:
    """``(world_size, local_size, nodes, backend)`` of the default process group; 1, 1, 1, None without one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1, 1, 1, None
    from aiak.comm.topology import detect_topology

    topology = detect_topology()
    return topology.world_size, topology.local_size, topology.num_nodes, str(dist.get_backend())


# -- model ----------------------------------------------------------------------------------------------------
def module_counts(model: Optional[nn.Module]) -> Dict[str, int]:
    """How many modules of each kind in :data:`MODULE_KINDS` ``model`` holds (every kind present as a key).

    * ``window_attention``: Swin window attention, found by the recogniser module surgery uses
      (:func:`aiak.ops.surgery.is_window_attention`);
    * ``multihead_attention``: ``nn.MultiheadAttention``, or a class named ``*Attention`` (``*SelfAttention``)
      that neither is nor holds window attention;
    * an attention module is counted once: attention modules nested inside it (Hugging Face's
      ``BertAttention`` holding ``BertSelfAttention``, ``SwinAttention`` holding its bias table) are parts of it;
    * ``layernorm``: ``nn.LayerNorm`` and classes named ``*LayerNorm*`` (``LayerNorm2d``, ``T5LayerNorm``);
    * ``batchnorm``: every ``_BatchNorm`` (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``); ``embedding``:
      ``nn.Embedding`` and ``nn.EmbeddingBag``;
    * ``dropout``: dropout modules with ``p > 0`` (``p = 0`` is the identity many models build by default).
    """
    counts = dict.fromkeys(MODULE_KINDS, 0)
    if model is None:
        return counts
    from aiak.ops.surgery import is_window_attention

    modules = list(model.named_modules())  # parents before children
    windows = {name for name, m in modules if is_window_attention(m)}
    holds_window = set().union(*(_ancestors(name) for name in windows))
    counted_attention: List[str] = []  # what is inside these is part of them

    for name, m in modules:
        for kind, is_kind in _SIMPLE_KINDS:
            counts[kind] += is_kind(m)
        if any(name.startswith(outer + ".") or (outer == "" and name) for outer in counted_attention):
            continue
        if name in windows:
            counts["window_attention"] += 1
            counted_attention.append(name)
        elif (isinstance(m, nn.MultiheadAttention) or type(m).__name__.lower().endswith("attention")) \
                and name not in holds_window:
            counts["multihead_attention"] += 1
            counted_attention.append(name)
    return counts


_SIMPLE_KINDS = (
    ("conv2d", lambda m: isinstance(m, nn.Conv2d)),
    ("conv3d", lambda m: isinstance(m, nn.Conv3d)),
    ("batchnorm", lambda m: isinstance(m, nn.modules.batchnorm._BatchNorm)),
    ("layernorm", lambda m: isinstance(m, nn.LayerNorm) or "layernorm" in type(m).__name__.lower()),
    ("groupnorm", lambda m: isinstance(m, nn.GroupNorm)),
    ("linear", lambda m: isinstance(m, nn.Linear)),
    ("embedding", lambda m: isinstance(m, (nn.Embedding, nn.EmbeddingBag))),
    ("dropout", lambda m: isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0),
)


def _ancestors(name: str) -> Set[str]:
    """Names of the modules holding the module ``name``: ``"a.b.c"`` -> ``{"", "a", "a.b"}``."""
    parts = name.split(".") if name else []
    return {".".join(parts[:i]) for i in range(len(parts))}


def model_features(model: Optional[nn.Module]) -> Set[str]:
    """The module kinds present in ``model`` (those :func:`module_counts` finds at least once)."""
    return {kind for kind, count in module_counts(model).items() if count}


# -- loader ---------------------------------------------------------------------------------------------------
def loader_facts(loader: Any) -> Dict[str, Any]:
    """``{present, batch_size, num_workers, pin_memory, variable_length}``; None for what cannot be known."""
    if loader is None:
        return {"present": False, "batch_size": None, "num_workers": None, "pin_memory": None,
                "variable_length": None}
    return {"present": True, "batch_size": getattr(loader, "batch_size", None),
            "num_workers": getattr(loader, "num_workers", None), "pin_memory": getattr(loader, "pin_memory", None),
            "variable_length": variable_length(getattr(loader, "dataset", None))}


def variable_length(dataset: Any) -> Optional[bool]:
    """Whether the first :data:`LENGTH_PROBE_SAMPLES` samples of a map-style dataset differ in length.

    Lengths follow :func:`aiak.loaders.balanced_loader.sample_lengths` (a declared ``dataset.lengths``, else
    each sample measured); only those first samples are read, never the whole dataset, and the RNG states
    (torch CPU, Python, NumPy) are restored afterwards, so random transforms still draw what they would have
    drawn without aiak. None when unknown: no dataset, an iterable-style one, or unmeasurable samples.
    """
    if dataset is None or isinstance(dataset, IterableDataset):
        return None
    declared = getattr(dataset, "lengths", None)
    try:
        if declared is not None:
            lengths = list((declared() if callable(declared) else declared)[:LENGTH_PROBE_SAMPLES])
        else:
            from aiak.loaders.balanced_loader import sample_length

            with _rng_preserved():
                lengths = [sample_length(dataset[i]) for i in range(min(len(dataset), LENGTH_PROBE_SAMPLES))]
    except Exception:  # no len(), no indexing, or a sample without a length: unknown
        return None
    if not lengths:
        return None
    return len(set(int(n) for n in lengths)) > 1


@contextlib.contextmanager
def _rng_preserved():
    """Restores the torch (CPU), Python and NumPy global RNG states on exit; never touches CUDA."""
    torch_state, python_state = torch.random.get_rng_state(), random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        torch.random.set_rng_state(torch_state)
        random.setstate(python_state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)

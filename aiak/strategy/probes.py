"""Probes: the facts the auto-selector's ``match:`` rules are evaluated against.

`probe` gathers, in one `Probes` record (``to_dict()`` is JSON-ready, for the decision record):

* hardware: the model's device, the CUDA device's name / capability / count / memory, this CPU's ISA flags,
  model name and usable cores, and whether bf16 / fp16 run in hardware there;
* distribution: world size, ranks per node, nodes and backend of the initialized process group;
* model: parameter counts and how many modules of each kind in `MODULE_KINDS`;
* loader: batch size, workers, pinned memory and whether the samples differ in length;
* the optimizer's class name.

Probes only observe. Importing this module reads no file and never touches CUDA; `probe` touches CUDA
only when the model's device is a CUDA device. With an initialized process group, `probe` is a
collective (the topology is gathered from every rank, `aiak.comm.allreduce.topology.detect_topology`), so every
rank calls it, as ``optimize()`` does.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Set, Tuple

from torch import nn
from torch.utils.data import IterableDataset

from aiak.amp.fp8 import plan_fp8
from aiak.comm.allreduce.topology import detect_topology
from aiak.comm.sharded import sharding_of
from aiak.loaders.balanced_loader import sample_length
from aiak.ops.lm_head import fusable_lm_heads
from aiak.ops.pointwise_conv import is_pointwise_conv
from aiak.ops.surgery import is_window_attention
from aiak.util.machine.cpu import NATIVE_FP16_CPU_FLAGS, cpu_features, cpu_model, has_native_bf16_cpu, usable_cores
from aiak.util.dist import process_group_exists
from aiak.util.machine.devices import (CUDA_NATIVE_BF16, CUDA_NATIVE_FP16, cuda_capability, cuda_info,
                                       host_memory_gb, model_device)
from aiak.util.norm_layers import norm_kind
from aiak.util.rng import preserved

# Module kinds a profile's ``match.modules`` can name; `module_counts` counts each.
MODULE_KINDS = ("conv2d", "pointwise_conv", "conv3d", "batchnorm", "layernorm", "groupnorm", "linear", "embedding",
                "multihead_attention", "window_attention", "dropout")

# How many samples of a map-style dataset the loader probe reads, at most, to tell variable-length data.
LENGTH_PROBE_SAMPLES = 32


# Bytes of optimizer state per trainable parameter, by class name: two fp32 moments (Adam and its kin, LAMB), one
# (SGD's momentum, LARS's, Adagrad's and RMSprop's sums). Other optimizers count as two moments.
OPTIMIZER_STATE_BYTES = {"Adam": 8, "AdamW": 8, "Adamax": 8, "NAdam": 8, "RAdam": 8, "Lamb": 8, "SGD": 4, "Lars": 4,
                         "Adagrad": 4, "RMSprop": 4}


@dataclass
class Probes:
    """What `probe` found. Hand-built instances describe other machines (tests, ``aiak explain``)."""

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
    sharding: Optional[str] = None                  # the script sharded the model: aiak.comm.sharded.sharding_of
    # model
    params: int = 0
    trainable_params: int = 0
    modules: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(MODULE_KINDS, 0))
    # loader and optimizer
    loader: Dict[str, Any] = field(default_factory=lambda: {
        "present": False, "batch_size": None, "num_workers": None, "pin_memory": None, "variable_length": None})
    optimizer: Optional[str] = None
    fp8_linear_share: float = 0.0                   # `fp8_linear_share`
    param_bytes: int = 0                            # the parameters' bytes (0: 4 per parameter)
    host_memory_gb: float = 0.0                     # the host's memory, shared by its local ranks on a CPU
    lm_head_logits_bytes: int = 0                   # `lm_head_logits_bytes`

    @property
    def cuda_capability(self) -> Optional[Tuple[int, int]]:
        """``(major, minor)`` of the CUDA device, None off CUDA."""
        if self.device != "cuda" or not self.cuda:
            return None
        major, _, minor = str(self.cuda["capability"]).partition(".")
        return int(major), int(minor or 0)

    @property
    def training_state_share(self) -> float:
        """The share of one device's memory the model's training state would take on every rank under DDP: the
        parameters, an fp32 gradient per trainable parameter, and the optimizer's state per trainable parameter
        (`OPTIMIZER_STATE_BYTES`; 8 bytes for an optimizer not listed). A device is a GPU's memory, or on a CPU the
        host's memory over its local ranks; 0 where the memory is unknown."""
        memory = (self.cuda or {}).get("memory_gb", 0.0) if self.device == "cuda" else \
            self.host_memory_gb / max(self.local_size, 1)
        if not memory:
            return 0.0
        state = 0 if self.optimizer is None else OPTIMIZER_STATE_BYTES.get(self.optimizer, 8)
        total = (self.param_bytes or 4 * self.params) + (4 + state) * self.trainable_params
        return total / (memory * 2 ** 30)

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
    cuda, capability = cuda_info(dev), cuda_capability(dev)
    if dev.type == "cuda":
        bf16 = capability is not None and capability >= CUDA_NATIVE_BF16
        fp16 = capability is not None and capability >= CUDA_NATIVE_FP16
    else:
        bf16, fp16 = has_native_bf16_cpu(features), bool(features & NATIVE_FP16_CPU_FLAGS)
    world_size, local_size, nodes, backend = _distribution()
    params = list(model.parameters()) if model is not None else []
    return Probes(
        device=dev.type, cuda=cuda, cpu_features=features, cpu_cores=usable_cores(), cpu_model=cpu_model(),
        bf16_native=bf16, fp16_native=fp16,
        world_size=world_size, local_size=local_size, nodes=nodes, backend=backend, sharding=sharding_of(model),
        params=sum(p.numel() for p in params), trainable_params=sum(p.numel() for p in params if p.requires_grad),
        param_bytes=sum(p.numel() * p.element_size() for p in params), host_memory_gb=host_memory_gb(),
        modules=module_counts(model), loader=loader_facts(loader), fp8_linear_share=fp8_linear_share(model),
        optimizer=type(optimizer).__name__ if optimizer is not None else None,
        lm_head_logits_bytes=lm_head_logits_bytes(model, loader))


# -- distribution ---------------------------------------------------------------------------------------------
def _distribution() -> Tuple[int, int, int, Optional[str]]:
    """``(world_size, local_size, nodes, backend)`` of the default process group; 1, 1, 1, None without one."""
    import torch.distributed as dist

    if not process_group_exists():
        return 1, 1, 1, None
    topology = detect_topology()
    return topology.world_size, topology.local_size, topology.num_nodes, str(dist.get_backend())


# -- model ----------------------------------------------------------------------------------------------------
def module_counts(model: Optional[nn.Module]) -> Dict[str, int]:
    """How many modules of each kind in `MODULE_KINDS` ``model`` holds (every kind present as a key).

    * ``window_attention``: Swin window attention, found by the recogniser module surgery uses
      (`aiak.ops.surgery.is_window_attention`);
    * ``multihead_attention``: ``nn.MultiheadAttention``, or a class named ``*Attention`` (``*SelfAttention``)
      that neither is nor holds window attention;
    * an attention module is counted once: attention modules nested inside it (Hugging Face's
      ``BertAttention`` holding ``BertSelfAttention``, ``SwinAttention`` holding its bias table) are parts of it;
    * ``layernorm``: ``nn.LayerNorm`` and norm layers named ``*LayerNorm*`` (``LayerNorm2d``, ``T5LayerNorm``;
      `aiak.util.norm_layers.norm_kind`);
    * ``batchnorm``: every ``_BatchNorm`` (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``); ``embedding``:
      ``nn.Embedding`` and ``nn.EmbeddingBag``;
    * ``dropout``: dropout modules with ``p > 0`` (``p = 0`` is the identity many models build by default);
    * ``pointwise_conv``: the 1x1 convolutions ``fused_ops: [pointwise_conv]`` would compute as a matrix multiply
      (`aiak.ops.pointwise_conv.is_pointwise_conv`), also counted in ``conv2d``.
    """
    counts = dict.fromkeys(MODULE_KINDS, 0)
    if model is None:
        return counts
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
    ("pointwise_conv", is_pointwise_conv),
    ("conv3d", lambda m: isinstance(m, nn.Conv3d)),
    ("batchnorm", lambda m: norm_kind(m) == "batchnorm"),
    ("layernorm", lambda m: norm_kind(m) == "layernorm"),
    ("groupnorm", lambda m: norm_kind(m) == "groupnorm"),
    ("linear", lambda m: isinstance(m, nn.Linear)),
    ("embedding", lambda m: isinstance(m, (nn.Embedding, nn.EmbeddingBag))),
    ("dropout", lambda m: isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0),
)


def _ancestors(name: str) -> Set[str]:
    """Names of the modules holding the module ``name``: ``"a.b.c"`` -> ``{"", "a", "a.b"}``."""
    parts = name.split(".") if name else []
    return {".".join(parts[:i]) for i in range(len(parts))}


# Output positions each convolution weight is taken to be used at: a 7x7 map, the smallest of a ResNet at 224 px.
CONV_POSITIONS = 49


def fp8_linear_share(model: Optional[nn.Module]) -> float:
    """The share of ``model``'s matrix-multiply work that ``precision.fp8`` would run in fp8 (the match key
    ``fp8_linear_share``), estimated from the weights alone, without an input.

    A Linear layer uses each weight once per token (2 x in x out FLOPs per token). A convolution uses each weight
    once per output position, counted as `CONV_POSITIONS`: a lower bound, which makes the share an upper
    bound for convolutional nets (torchvision's ResNet-50 comes out near 0, a ViT's patch embedding counts as
    one layer). ``nn.MultiheadAttention``'s input projection, which fp8 cannot reach, counts like a Linear
    layer. Attention's score products have no weights and are left out: per token and layer they add 4 x T x d
    FLOPs to a block's 24 x d^2 (T tokens of width d), so the estimate holds while T is below about 6d. Returns
    eligible Linear weight uses / all weight uses (0 for a model with neither Linear layers nor convolutions).
    """
    if model is None:
        return 0.0
    modules = dict(model.named_modules())
    eligible = sum(modules[path].weight.numel() for path in plan_fp8(model, "tensorwise").converted)
    total = 0
    for module in modules.values():
        if isinstance(module, nn.Linear):
            total += module.weight.numel()
        elif isinstance(module, nn.modules.conv._ConvNd):
            total += module.weight.numel() * CONV_POSITIONS
        elif isinstance(module, nn.MultiheadAttention) and module.in_proj_weight is not None:
            total += module.in_proj_weight.numel()
    return eligible / total if total else 0.0


def model_features(model: Optional[nn.Module]) -> Set[str]:
    """The module kinds present in ``model`` (those `module_counts` finds at least once)."""
    return {kind for kind, count in module_counts(model).items() if count}


# -- loader ---------------------------------------------------------------------------------------------------
def lm_head_logits_bytes(model: Optional[nn.Module], loader: Any) -> int:
    """The bytes of one batch's fp32 logits in the causal and masked language models
    ``fused_ops: [linear_cross_entropy]`` would fuse (`aiak.ops.lm_head.fusable_lm_heads`): tokens per batch (the
    loader's ``batch_size`` times the longest of the first `LENGTH_PROBE_SAMPLES` samples of its map-style
    dataset) x vocabulary x 4. The
    unfused head holds about three tensors of that size at its peak (the logits, their log-softmax and its
    gradient). 0 without such a model or a loader whose batches can be measured."""
    vocab = sum(head.out_features if isinstance(head, nn.Linear) else head.base_layer.out_features
                for head in fusable_lm_heads(model)) if model is not None else 0
    batch_size = getattr(loader, "batch_size", None)
    dataset = getattr(loader, "dataset", None)
    if not vocab or not isinstance(batch_size, int) or dataset is None or isinstance(dataset, IterableDataset):
        return 0
    try:
        with preserved():
            longest = max(sample_length(dataset[i]) for i in range(min(len(dataset), LENGTH_PROBE_SAMPLES)))
    except Exception:  # no len(), no indexing, no samples, or a sample without a length: unknown
        return 0
    return batch_size * longest * vocab * 4


def loader_facts(loader: Any) -> Dict[str, Any]:
    """``{present, batch_size, num_workers, pin_memory, variable_length}``; None for what cannot be known."""
    if loader is None:
        return {"present": False, "batch_size": None, "num_workers": None, "pin_memory": None,
                "variable_length": None}
    return {"present": True, "batch_size": getattr(loader, "batch_size", None),
            "num_workers": getattr(loader, "num_workers", None), "pin_memory": getattr(loader, "pin_memory", None),
            "variable_length": variable_length(getattr(loader, "dataset", None))}


def variable_length(dataset: Any) -> Optional[bool]:
    """Whether the first `LENGTH_PROBE_SAMPLES` samples of a map-style dataset differ in length.

    Lengths follow `aiak.loaders.balanced_loader.sample_lengths` (a declared ``dataset.lengths``, else
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
            with preserved():
                lengths = [sample_length(dataset[i]) for i in range(min(len(dataset), LENGTH_PROBE_SAMPLES))]
    except Exception:  # no len(), no indexing, or a sample without a length: unknown
        return None
    if not lengths:
        return None
    return len(set(int(n) for n in lengths)) > 1

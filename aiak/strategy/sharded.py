"""What composes with a model the script sharded (FSDP2, FSDP1, tensor parallelism; `aiak.comm.sharded`), knob by
knob: one list of refusals, each with why and what to do instead.

A strategy the user named is refused whole when any of its knobs cannot apply (`check_sharded`: every problem in
one `StrategyError`); ``"auto"`` composes as usual and then leaves each refused knob at ``default.yaml``'s value,
saying why (`aiak.strategy.select.compose`), and runs no trials: they time deep copies of the model, and a sharded
model cannot be copied (its parameters are shards whose other parts live on the other ranks).

What does compose, and why: the loader; accumulation (FSDP2's own switch keeps a micro-step from reduce-scattering);
counted items (summed over the ranks FSDP averages over); clipping (torch's norms of DTensor gradients are the full
tensors'); schedulers; LAMB and LARS (trust ratios of the full tensors); O1 (autocast around FSDP's all-gathered
parameters); ``compile``; checkpoints (DCP); under FSDP2 the language-model head's fused loss (a class swap that
reads the head's weight inside the forward, where FSDP2 has gathered it).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from aiak.comm.algorithms import AllReduce
from aiak.comm.sharded import AIAK_FSDP2, ENGINE_NAMES, FSDP1, FSDP2
from aiak.strategy.key_paths import get_leaf
from aiak.strategy.schema import called
from aiak.util.config import StrategyError

DDP_HOOK_SWITCHES = ("hierarchical", "autotune", "compress_intra", "cpu_reduce", "deadlock_guard")


def sharded_by(data: Dict[str, Any], script_sharding: Optional[str], world_size: int) -> Optional[str]:
    """Who shards the model this strategy trains: the script (``script_sharding``, `aiak.comm.sharded.sharding_of`),
    aiak (``comm.engine: fsdp2`` on several ranks: `aiak.comm.sharded.AIAK_FSDP2`), or nobody (None)."""
    if script_sharding:
        return script_sharding
    return AIAK_FSDP2 if get_leaf(data, "comm.engine") == "fsdp2" and world_size > 1 else None


def refusals(data: Dict[str, Any], sharding: str) -> List[Tuple[str, str]]:
    """``(key path, why and what instead)`` for each knob of ``data`` (a strategy as ``Strategy.to_dict()``) that
    cannot apply to a model sharded by ``sharding`` (`sharded_by`). Under aiak's own FSDP2 the model's knobs apply
    before sharding (surgery, channels_last, fp8), and O2 becomes FSDP2's MixedPrecisionPolicy."""
    engine = ENGINE_NAMES[sharding]
    out: List[Tuple[str, str]] = []
    if sharding != AIAK_FSDP2 and get_leaf(data, "comm.engine") == "fsdp2":
        out.append(("comm.engine", f"the script sharded the model with {engine} already: leave comm.engine at ddp "
                                   "(aiak composes with the script's sharding)"))
    if get_leaf(data, "tune.enabled"):
        out.append(("tune", "the trials time copies of the model in one process: a model the script sharded cannot "
                            "be copied (the rest of each parameter lives on the other ranks), and one aiak shards "
                            "would be timed unsharded, not as it trains: set tune: false"))
    if sharding != AIAK_FSDP2:
        out.extend(_script_sharded(data, engine, sharding))
    elif get_leaf(data, "precision.fp8") != "off":
        out.append(("precision.fp8", "torchao's float8 layers under FSDP2 need float8 all-gathers of their own, which "
                                     "aiak does not set up: set fp8 off, or comm.engine ddp"))
    if get_leaf(data, "precision.level") != "O0" and get_leaf(data, "precision.dtype") == "fp16":
        out.append(("precision.dtype", "fp16 loss scaling checks each rank's gradients for overflow, and a sharded "
                                       "model's gradients are shards: one rank would skip a step the others take. "
                                       "Use dtype bf16, or precision O0 with torch's ShardedGradScaler in the script"))
    algorithm = get_leaf(data, "comm.algorithm")
    if algorithm != AllReduce.name:
        out.append(("comm.algorithm", f"{algorithm} synchronises through aiak's DDP communication hook, and {engine} "
                                      "synchronises the gradients itself: use allreduce (FSDP's own reduction)"))
    for key in _ddp_hook_settings(get_leaf(data, "comm", {})):
        out.append((f"comm.{key}", f"a setting of aiak's DDP communication hook, and {engine} reduces the "
                                   "gradients itself: leave it at its default"))
    return out


def _ddp_hook_settings(comm: Dict[str, Any]) -> List[str]:
    """The keys of the ``comm:`` section set to something only aiak's DDP communication hook does."""
    keys = ["compression"] if comm.get("compression", "none") != "none" else []
    keys += [key for key in DDP_HOOK_SWITCHES if comm.get(key) is True]
    connections = comm.get("connections")
    if isinstance(connections, int) and not isinstance(connections, bool) and connections > 1:
        keys.append("connections")
    return keys


def _script_sharded(data: Dict[str, Any], engine: str, sharding: str) -> List[Tuple[str, str]]:
    """What a model the script sharded cannot take: changes to modules or parameters FSDP already holds as shards,
    O2's swapped copies, and (FSDP1) aiak's accumulation and layer-wise optimizers."""
    out: List[Tuple[str, str]] = []
    # The language-model head's surgery swaps classes and reads the head's weight inside the forward, where FSDP2
    # has gathered it; the others would replace modules whose parameters are shards.
    surgery = [op for op in get_leaf(data, "fused_ops") or [] if sharding != FSDP2 or op != "linear_cross_entropy"]
    if surgery:
        out.append(("fused_ops", f"module surgery ({', '.join(surgery)}) would replace modules whose parameters "
                                 f"{engine} already sharded: leave fused_ops empty"
                                 + (", or linear_cross_entropy alone" if sharding == FSDP2 else "")))
    if get_leaf(data, "channels_last"):
        out.append(("channels_last", f"NHWC rewrites the parameters' tensors, which {engine} holds as shards: set it "
                                     "false, and convert the model (model.to(memory_format=torch.channels_last)) "
                                     "before sharding"))
    if get_leaf(data, "precision.level") == "O2":
        out.append(("precision.level", f"O2 swaps half copies of the parameters in at each forward, and {engine} "
                                       "all-gathers its own parameters at each forward: shard with "
                                       "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) "
                                       "(fully_shard's mp_policy) and use precision O1 or O0 here"))
    if get_leaf(data, "precision.fp8") != "off":
        out.append(("precision.fp8", f"fp8 replaces linear layers whose parameters {engine} already sharded: set it "
                                     "off"))
    if sharding == FSDP1 and get_leaf(data, "grad_accumulation") > 1:
        out.append(("grad_accumulation", "FSDP1 keeps a micro-step from synchronising only inside its no_sync() "
                                         "context: shard with fully_shard (FSDP2), or accumulate in the script under "
                                         "no_sync() and set grad_accumulation: 1"))
    if sharding == FSDP1 and get_leaf(data, "optimizer.name") in ("lamb", "lars"):
        out.append(("optimizer", "FSDP1 flattens the parameters, so per-tensor trust ratios would be the flat "
                                 "parameter's: shard with fully_shard (FSDP2), whose parameters stay tensors"))
    return out


def check_sharded(data: Dict[str, Any], sharding: str, name: str, count_items: Any = None) -> None:
    """Refuse a strategy named by the user (``name``) whose knobs cannot apply to a model sharded by ``sharding``:
    one `StrategyError` with every problem, naming the engine."""
    engine = ENGINE_NAMES[sharding]
    problems = [f"{path}: {why}" for path, why in refusals(data, sharding)]
    if count_items and sharding == FSDP1:
        problems.append("count_items: FSDP1's accumulation is the script's (no_sync()): shard with fully_shard (FSDP2) "
                        "to count items")
    given = called(name)
    if problems:
        raise StrategyError([f"{given}, on a model sharded by {engine}: {p}" for p in problems])


def what_auto_leaves_out(sharding: str) -> str:
    """The reason ``auto`` gives for each knob it leaves at its default on a sharded model."""
    if sharding == AIAK_FSDP2:
        return "aiak shards the model with FSDP2 (comm.engine: fsdp2, profile fsdp2)"
    return f"the model is sharded by {ENGINE_NAMES[sharding]}"

"""What composes with a model the script sharded (FSDP2, FSDP1, tensor parallelism; `aiak.comm.sharded`), knob by
knob: one list of refusals, each with why and what to do instead.

A strategy the user named is refused whole when any of its knobs cannot apply (`check_sharded`: every problem in
one `StrategyError`); ``"auto"`` composes as usual and then leaves each refused knob at ``default.yaml``'s value,
saying why (`aiak.strategy.select.compose`), and runs no trials: they time deep copies of the model, and a sharded
model cannot be copied (its parameters are shards whose other parts live on the other ranks).

What does compose, and why: the loader; accumulation (FSDP2's own switch keeps a micro-step from reduce-scattering);
counted items (summed over the ranks FSDP averages over); clipping (torch's norms of DTensor gradients are the full
tensors'); schedulers; LAMB and LARS (trust ratios of the full tensors); O1 (autocast around FSDP's all-gathered
parameters); ``compile``; checkpoints (DCP).
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

from aiak.comm.sharded import ENGINE_NAMES, FSDP1
from aiak.strategy.key_paths import get_leaf
from aiak.util.config import StrategyError

DDP_HOOK_KEYS = (("compression", "none"), ("hierarchical", True), ("autotune", True), ("compress_intra", True),
                 ("cpu_reduce", True), ("deadlock_guard", True))


def refusals(data: Dict[str, Any], sharding: str) -> List[Tuple[str, str]]:
    """``(key path, why and what instead)`` for each knob of ``data`` (a strategy as ``Strategy.to_dict()``) that
    cannot apply to a model sharded by ``sharding`` (a value of `aiak.comm.sharded.sharding_of`)."""
    engine = ENGINE_NAMES[sharding]
    out: List[Tuple[str, str]] = []

    def refuse(path: str, why: str) -> None:
        out.append((path, why))

    if get_leaf(data, "tune.enabled"):
        refuse("tune", "the trials time deep copies of the model, and a sharded model cannot be copied (the rest of "
                       "each parameter lives on the other ranks): set tune: false")
    if get_leaf(data, "fused_ops"):
        refuse("fused_ops", f"module surgery would replace modules whose parameters {engine} already sharded: leave "
                            "fused_ops empty")
    if get_leaf(data, "channels_last"):
        refuse("channels_last", f"NHWC rewrites the parameters' tensors, which {engine} holds as shards: set it false, "
                                "and convert the model (model.to(memory_format=torch.channels_last)) before sharding")
    level, dtype = get_leaf(data, "precision.level"), get_leaf(data, "precision.dtype")
    if level == "O2":
        refuse("precision.level", f"O2 swaps half copies of the parameters in at each forward, and {engine} "
                                  "all-gathers its own parameters at each forward: shard with "
                                  "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) "
                                  "(fully_shard's mp_policy) and use precision O1 or O0 here")
    if level != "O0" and dtype == "fp16":
        refuse("precision.dtype", "fp16 loss scaling checks each rank's gradients for overflow, and a sharded "
                                  "model's gradients are shards: one rank would skip a step the others take. Use "
                                  "dtype bf16, or precision O0 with torch's ShardedGradScaler in the script")
    if get_leaf(data, "precision.fp8") != "off":
        refuse("precision.fp8", f"fp8 replaces linear layers whose parameters {engine} already sharded: set it off")
    algorithm = get_leaf(data, "comm.algorithm")
    if algorithm != "allreduce":
        refuse("comm.algorithm", f"{algorithm} synchronises through aiak's DDP communication hook, and {engine} "
                                 "synchronises the gradients itself: use allreduce (FSDP's own reduction)")
    for key, bad in DDP_HOOK_KEYS:
        value = get_leaf(data, f"comm.{key}")
        if (value != bad) if key == "compression" else (value is bad):
            refuse(f"comm.{key}", f"a setting of aiak's DDP communication hook, and {engine} reduces the gradients "
                                  "itself: leave it at its default")
    connections = get_leaf(data, "comm.connections")
    if isinstance(connections, int) and not isinstance(connections, bool) and connections > 1:
        refuse("comm.connections", f"a setting of aiak's DDP communication hook, and {engine} reduces the gradients "
                                   "itself: leave it at its default")
    if sharding == FSDP1:
        if get_leaf(data, "grad_accumulation") > 1:
            refuse("grad_accumulation", "FSDP1 keeps a micro-step from synchronising only inside its no_sync() "
                                        "context: shard with fully_shard (FSDP2), or accumulate in the script under "
                                        "no_sync() and set grad_accumulation: 1")
        if get_leaf(data, "optimizer.name") in ("lamb", "lars"):
            refuse("optimizer", "FSDP1 flattens the parameters, so per-tensor trust ratios would be the flat "
                                "parameter's: shard with fully_shard (FSDP2), whose parameters stay tensors")
    return out


def check_sharded(data: Dict[str, Any], sharding: str, name: str, count_items: Any = None) -> None:
    """Refuse a strategy named by the user (``name``) whose knobs cannot apply to a model sharded by ``sharding``:
    one `StrategyError` with every problem, naming the engine."""
    engine = ENGINE_NAMES[sharding]
    problems = [f"{path}: {why}" for path, why in refusals(data, sharding)]
    if count_items and sharding == FSDP1:
        problems.append("count_items: FSDP1's accumulation is the script's (no_sync()): shard with fully_shard (FSDP2) "
                        "to count items")
    given = "the strategy given" if name == "custom" else f"strategy {name!r}"
    if problems:
        raise StrategyError([f"{given}, on a model sharded by {engine}: {p}" for p in problems])


def what_auto_leaves_out(sharding: str) -> str:
    """The reason ``auto`` gives for each knob it leaves at its default on a sharded model."""
    return f"the model is sharded by {ENGINE_NAMES[sharding]}"

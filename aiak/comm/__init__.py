"""aiak.comm: communication under DDP, in three rooms.

- `aiak.comm.allreduce`: how gradients travel when every rank averages them (the hook's stages: flat,
  hierarchical, compressed, several connections, CPU-Reduce; topology, buckets, the comm autotuner);
- `aiak.comm.algorithms`: what is synchronised (``comm.algorithm``): the `CommAlgorithm` interface and
  its registry by name (allreduce, local SGD, decentralized SGD, PowerSGD);
- `aiak.comm.diagnostics`: watching communication go wrong (the stall watch, the deadlock guard).

[aiak.optimize][aiak.api.optimize] calls `wrap_distributed` (step 5); the other names are for users who assemble
the pieces themselves. Importing this package touches neither CUDA nor a process group.
"""
from aiak.comm.allreduce.autotune import CommChoice, StepTuner, cache_key, model_signature, read_choice, tune_comm
from aiak.comm.allreduce.compression import ErrorFeedback, dequantize_int8, quantize_int8
from aiak.comm.allreduce.hooks import CommState, average, comm_hook
from aiak.comm.allreduce.topology import HierarchicalGroups, Topology, build_groups, detect_topology
from aiak.comm.ddp import describe_comm, refuse_join, resolve_options, use_plain_state_dict_keys, wrap_distributed
from aiak.comm.diagnostics.deadlock import (CollectiveMismatchError, deadlock_guard, disable_deadlock_guard,
                                            enable_deadlock_guard)

__all__ = [
    "wrap_distributed", "describe_comm", "refuse_join", "resolve_options", "use_plain_state_dict_keys",
    "CommState", "comm_hook", "average",
    "Topology", "HierarchicalGroups", "detect_topology", "build_groups",
    "ErrorFeedback", "quantize_int8", "dequantize_int8",
    "CommChoice", "read_choice", "StepTuner", "tune_comm", "cache_key", "model_signature",
    "CollectiveMismatchError", "deadlock_guard", "enable_deadlock_guard", "disable_deadlock_guard",
]

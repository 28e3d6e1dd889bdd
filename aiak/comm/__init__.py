"""aiak.comm: communication under DDP (hierarchical allreduce, gradient compression, autotuner,
CPU affinity, deadlock guard).

``optimize()`` calls :func:`apply_cpu_affinity` (step 2) and :func:`wrap_distributed` (step 5); the
other names are for users who assemble the pieces themselves. Importing this package touches neither
CUDA nor a process group.
"""
from aiak.comm.affinity import apply_cpu_affinity
from aiak.comm.autotune import CommChoice, StepTuner, cache_key, model_signature, read_choice, tune_comm
from aiak.comm.compression import ErrorFeedback, dequantize_int8, quantize_int8
from aiak.comm.ddp import describe_comm, resolve_options, use_plain_state_dict_keys, wrap_distributed
from aiak.comm.deadlock import CollectiveMismatchError, deadlock_guard, disable_deadlock_guard, enable_deadlock_guard
from aiak.comm.hooks import CommState, average, comm_hook
from aiak.comm.topology import HierarchicalGroups, Topology, build_groups, detect_topology

__all__ = [
    "wrap_distributed", "describe_comm", "apply_cpu_affinity", "resolve_options", "use_plain_state_dict_keys",
    "CommState", "comm_hook", "average",
    "Topology", "HierarchicalGroups", "detect_topology", "build_groups",
    "ErrorFeedback", "quantize_int8", "dequantize_int8",
    "CommChoice", "read_choice", "StepTuner", "tune_comm", "cache_key", "model_signature",
    "CollectiveMismatchError", "deadlock_guard", "enable_deadlock_guard", "disable_deadlock_guard",
]

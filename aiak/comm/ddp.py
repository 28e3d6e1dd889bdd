"""``wrap_distributed``: DDP wrapping + the communication hook from the strategy's ``comm:`` section.

What ``aiak.optimize`` calls in its step 5 (distributed wrapping). Without an initialized process group
of more than one rank, the model is returned unchanged. Otherwise the model is wrapped in
`DistributedDataParallel` with ``bucket_cap_mb`` from the strategy, the
`aiak.comm.allreduce.hooks.comm_hook` is registered with the chosen algorithm (or the comm autotuner picks it,
see `aiak.comm.allreduce.autotune`), and ``state_dict()`` / ``load_state_dict()`` of the returned DDP object
use the user's own keys (no ``module.`` prefix; ``module.``-prefixed checkpoints still load).
Gradient-accumulation micro-steps are the caller's: toggle ``ddp.require_backward_grad_sync``.
"""
from __future__ import annotations

import atexit
import gc
import logging
from dataclasses import fields, replace
from typing import Any, Optional

import torch
import torch.distributed as dist

from aiak.comm.algorithms import REGISTRY, algorithm_class
from aiak.comm.allreduce import nccl_sockets
from aiak.comm.allreduce.autotune import (CommTuning, StepTuner, TuneInputs, cached_choice, gradient_bucket_sizes,
                                          tune_comm)
from aiak.comm.config import CommConfig, check_comm
from aiak.comm.allreduce.connections import connection_counts, connections_available, wide_groups
from aiak.comm.diagnostics.deadlock import enable_deadlock_guard
from aiak.comm.allreduce.hooks import CommState, comm_hook
from aiak.comm.script_ddp import mark_built_by_aiak
from aiak.comm.allreduce.topology import build_groups, detect_topology
from aiak.util.cache import TuneCache
from aiak.runtime.callers import DCP_STATE_DICT, called_from
from aiak.util.dist import is_distributed, on_rank0
from aiak.util.warn import warn

logger = logging.getLogger("aiak")
PREFIX = "module."


# -- state-dict keys without "module." ----------------------------------------------------------
def _strip_module_prefix(module, state_dict, prefix, local_metadata):
    if called_from(DCP_STATE_DICT, "_get_model_state_dict"):  # DCP's walk expects DDP's prefix and takes it off itself
        return state_dict
    inner = prefix + PREFIX
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # per-module version info, keyed like the modules
        for key in [k for k in metadata if k == inner[:-1] or k.startswith(inner)]:
            metadata[prefix[:-1] if key == inner[:-1] else prefix + key[len(inner):]] = metadata.pop(key)
    return state_dict


def _add_module_prefix(module, state_dict, prefix, *args):
    inner = prefix + PREFIX
    for key in list(state_dict.keys()):
        if key.startswith(prefix) and not key.startswith(inner):
            state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


def use_plain_state_dict_keys(ddp: torch.nn.Module) -> None:
    """Make ``ddp.state_dict()`` return the wrapped model's keys and ``load_state_dict`` accept them."""
    ddp._register_state_dict_hook(_strip_module_prefix)
    if hasattr(ddp, "register_load_state_dict_pre_hook"):  # torch >= 2.5: hook(module, state_dict, prefix, ...)
        ddp.register_load_state_dict_pre_hook(_add_module_prefix)
    else:
        ddp._register_load_state_dict_pre_hook(_add_module_prefix, with_module=True)


# -- the wrapper -------------------------------------------------------------------------------
def resolve_options(cfg: Optional[CommConfig] = None, **overrides: Any) -> CommConfig:
    """The settings ``wrap_distributed`` uses: explicit (non-None) keyword > field of ``cfg`` > default,
    validated like the YAML (one error naming ``comm.<key>`` and its valid choices)."""
    unknown = set(overrides) - {f.name for f in fields(CommConfig)}
    if unknown:
        raise TypeError(f"wrap_distributed got unknown option(s) {sorted(unknown)}; valid: "
                        f"{[f.name for f in fields(CommConfig)]}")
    opts = replace(cfg if cfg is not None else CommConfig(), **{k: v for k, v in overrides.items() if v is not None})
    check_comm(opts, "wrap_distributed")
    return opts


def _knobs_set(opts: CommConfig) -> bool:
    return opts.compression != "none" or opts.hierarchical is True or opts.autotune or opts.deadlock_guard \
        or opts.connections not in ("auto", 1) or opts.cpu_reduce is True


def _device_ids(model: torch.nn.Module, device) -> Optional[list]:
    if device is None:
        p = next(model.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        return [device.index if device.index is not None else torch.cuda.current_device()]
    return None


_collect_at_exit_registered = False


def _collect_before_exit() -> None:
    """Free unreachable DDP models and their communication state while the interpreter is still whole.

    Left to interpreter shutdown, the model, its DDP reducer and aiak's comm state (a cycle once a script's
    ``main()`` has returned) were destroyed in the middle of finalization, after ``destroy_process_group``:
    1 in about 12 two-rank gloo jobs then aborted after training had finished ("terminate called without an
    active exception", exit code -6; measured 2/30 runs, and 0/25 with a ``gc.collect()`` before exit)."""
    gc.collect()


def wrap_distributed(model: torch.nn.Module, cfg: Any = None, device=None, *, process_group=None,
                     **options: Any) -> torch.nn.Module:
    """Wrap ``model`` in DDP with the communication settings of ``cfg`` (a ``CommConfig``).

    ``options`` are the ``comm:`` keys the schema lacks yet (fields of `CommConfig`): ``perf_mode``
    (``comm`` | ``step``), ``tune_steps`` (timed runs or steps per candidate, default 3), ``tune_cache``
    (file; default ``$AIAK_TUNE_CACHE`` or ``~/.cache/aiak/tune.json``), ``tune_int8`` (let the tuner
    pick int8, default False: it changes numerics), ``deadlock_guard`` (default False), ``timeout_s`` (guard
    timeout, default 300), ``compress_intra`` (default False), ``int8_block`` (2048), ``pipeline_mb``
    (hierarchical pipeline chunk, default 2; 0 = whole buckets), ``stall_warn_s`` (default 60; 0 = off). An
    explicit option beats a ``cfg`` field.
    Collective: every rank must call it at the same point. Returns the model unchanged without a process
    group of more than one rank.
    """
    global _collect_at_exit_registered
    if not _collect_at_exit_registered:
        atexit.register(_collect_before_exit)
        _collect_at_exit_registered = True
    opts = resolve_options(cfg, **options)
    if not is_distributed(process_group):
        if _knobs_set(opts):
            logger.info("aiak.comm: comm settings given but no process group with more than one rank exists; "
                        "the model is not wrapped in DDP")
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(model, DDP):
        return _hook_existing(model, opts)

    topology = detect_topology(process_group)
    algorithm = algorithm_class(opts.algorithm).runs_here(opts, topology, process_group)
    groups = _node_groups(opts, topology, algorithm, process_group)
    hierarchical = groups is not None and opts.hierarchical is not False
    device_ids = _device_ids(model, device)
    host_inter = _host_inter_group(opts, topology, groups, bool(device_ids), process_group)
    counts = _connection_counts(opts, topology, process_group)
    wide = wide_groups(topology, process_group, counts, flat=not hierarchical or opts.autotune,
                       inter=groups is not None)
    state = CommState(process_group, groups, hierarchical=hierarchical, compression=opts.compression,
                      compress_intra=opts.compress_intra, int8_block=opts.int8_block, pipeline_mb=opts.pipeline_mb,
                      stall_warn_s=opts.stall_warn_s, wide=wide, connections=counts[0], host_inter=host_inter,
                      cpu_reduce=host_inter is not None and opts.cpu_reduce is True, local_size=topology.local_size)
    state.parameter_numbers.number(model)  # module order: a bucket's layout means the same in a resumed run
    bucket_mb, tuner = algorithm.bucket_mb(model, opts), None
    if opts.autotune:
        bucket_mb, tuner = _autotune(model, state, opts, topology, device_ids, process_group, counts)

    ddp = DDP(model, device_ids=device_ids, bucket_cap_mb=bucket_mb, process_group=process_group,
              find_unused_parameters=opts.find_unused_parameters)
    state.tuner = tuner
    synchronising = algorithm.from_settings(ddp, state, opts)
    hook = synchronising.bucket_hook(opts)
    if hook is not None:  # (None: DDP's own allreduce)
        ddp.register_comm_hook(*hook)
    # what the step controller calls at real steps and saves with the optimizer's state (None: nothing to call)
    ddp.aiak_comm_algorithm = synchronising if algorithm.steps_with_optimizer else None
    if algorithm.join_would_miss:
        _refuse_join(ddp, synchronising)
    ddp.aiak_comm_state = state
    use_plain_state_dict_keys(ddp)
    mark_built_by_aiak(ddp)  # the script's own DDP line, after the aiak line, returns this DDP
    if opts.deadlock_guard:
        enable_deadlock_guard(timeout_s=opts.timeout_s)
    logger.info("aiak.comm: DDP over %s, bucket %g MB, %s%s", topology.describe(), bucket_mb,
                "autotuning (step mode)" if tuner else describe_comm(ddp),
                ", deadlock guard on" if opts.deadlock_guard else "")
    return ddp


def _node_groups(opts: CommConfig, topology, algorithm, process_group):
    """The intra- and inter-node groups (`build_groups`) where the settings want
    them (``hierarchical`` or ``cpu_reduce`` true; ``auto``, the autotuner or an algorithm that averages inside
    nodes, where the topology has nodes of several ranks), else ``None``; a ``true`` that cannot apply says why.
    The one place the hierarchical route is made possible: the hook's state starts on it where ``hierarchical``
    is not false, and the comm autotuner may switch between it and flat (``CommState.set_route``).
    Collective: every rank builds the groups, in the same order."""
    forced = opts.hierarchical is True or opts.cpu_reduce is True
    if process_group is not None and process_group is not dist.group.WORLD:
        if forced:
            warn("aiak.comm: hierarchical allreduce (and CPU-Reduce, a form of it) is built on the default (world) "
                 "group; with a custom process_group it is off and allreduce is flat")
        return None
    wanted = opts.hierarchical == "auto" or opts.autotune or algorithm.wants_node_groups
    if not topology.hierarchical_useful:
        if forced:
            knob = "comm.hierarchical=true" if opts.hierarchical is True else "comm.cpu_reduce=true"
            warn(f"aiak.comm: {knob} needs >1 node with >1 rank each and equal nodes; "
                 f"topology is {topology.describe()}; using flat allreduce")
        return None
    return build_groups(topology) if forced or wanted else None


def _refuse_join(ddp, algorithm) -> None:
    """``ddp.join()`` (uneven inputs) raises at once, on every rank, instead of hanging: a rank that ran out of
    batches would have to shadow what ``algorithm`` sends at its peers' optimizer steps (local SGD's weight
    averages, decentralized SGD's exchanges), which Join's shadowing of DDP's gradient allreduce does not do."""
    joining = " or ".join(name for name, cls in REGISTRY.items() if not cls.join_would_miss)
    refuse_join(ddp, f"aiak.comm: DistributedDataParallel.join() (uneven inputs) does not run with comm.algorithm "
                     f"{algorithm.name}: the ranks that ran out of batches would miss the {algorithm.join_would_miss} "
                     "that the others make at their optimizer steps, and every rank would wait for them. Give every "
                     "rank the same number of batches (a DistributedSampler with drop_last=True, or stop all ranks "
                     f"at the shortest), or use algorithm {joining}, which Join supports")


def refuse_join(ddp, why: str) -> None:
    """``ddp.join()`` and ``Join([ddp])`` raise ``why`` at once, on every rank (each enters the context with its first
    batch), instead of leaving the ranks that still have batches waiting for a collective a joined rank does not
    make."""

    def refuse(*args, **kwargs):
        raise RuntimeError(why)
    ddp.join = refuse
    ddp.join_hook = refuse


def describe_comm(ddp) -> str:
    """What synchronises the ranks of a DDP that ``wrap_distributed`` returned: its comm algorithm, else the
    allreduce algorithm of its hook."""
    algorithm, state = getattr(ddp, "aiak_comm_algorithm", None), getattr(ddp, "aiak_comm_state", None)
    if algorithm is not None:
        return algorithm.describe_with_transport()
    return state.describe() if state is not None else "built-in allreduce"


def _hook_existing(ddp, opts: CommConfig):
    """A DistributedDataParallel the script built itself: its buckets stay as they are (bucket_mb cannot change
    now); aiak's communication hook is registered if the DDP has none yet and the settings need one."""
    if algorithm_class(opts.algorithm).needs_aiak_ddp:
        raise ValueError(f"aiak.comm: comm.algorithm {opts.algorithm} needs aiak to wrap the model in DDP, and the "
                         "model is already a DistributedDataParallel: call aiak.optimize on the bare model (aiak "
                         "wraps it itself under torchrun) and drop your DistributedDataParallel line, or keep it "
                         "after the aiak line, where it returns aiak's DDP. DDP arguments that change what it "
                         "computes are strategy keys there: comm.find_unused_parameters: true for parameters the "
                         "forward does not always use. Or use algorithm allreduce")
    if opts.autotune or opts.hierarchical is True or opts.connections not in ("auto", 1) or opts.cpu_reduce is True:
        warn("aiak.comm: the model is already a DistributedDataParallel: comm.autotune, comm.hierarchical, "
             "comm.connections and comm.cpu_reduce need the wrapping to be aiak's (call aiak.optimize before "
             "DistributedDataParallel); its allreduce is kept "
             f"{'with compression ' + opts.compression if opts.compression != 'none' else 'as is'}")
    if opts.compression == "none" and not opts.deadlock_guard:
        return ddp
    if getattr(ddp, "_comm_hooks", None):
        warn("aiak.comm: the model's DistributedDataParallel already has a communication hook; aiak leaves it as is "
             f"(comm.compression {opts.compression} is not applied)")
        return ddp
    state = CommState(ddp.process_group, None, compression=opts.compression, int8_block=opts.int8_block,
                      pipeline_mb=opts.pipeline_mb, stall_warn_s=opts.stall_warn_s)
    state.parameter_numbers.number(ddp.module)
    ddp.register_comm_hook(state, comm_hook)
    ddp.aiak_comm_state = state
    if opts.deadlock_guard:
        enable_deadlock_guard(timeout_s=opts.timeout_s)
    logger.info("aiak.comm: the script's DDP, %s", state.describe())
    return ddp


def _connection_counts(opts: CommConfig, topology, process_group):
    """`aiak.comm.allreduce.connections.connection_counts` for this run; a number given that cannot apply says
    why."""
    crosses = topology.num_nodes > 1
    available = connections_available(process_group)
    if opts.connections != "auto" and opts.connections > 1 and not (crosses and available):
        warn(f"aiak.comm: comm.connections: {opts.connections} applies to gloo groups that cross nodes; "
             + ("this run has one node" if not crosses else
                f"this run's backend is {dist.get_backend(process_group)}: for NCCL over sockets set "
                "NCCL_SOCKET_NTHREADS and NCCL_NSOCKS_PERTHREAD before the process group is created (aiak doctor "
                "checks them)") + "; one connection is used")
    return connection_counts(opts.connections, opts.autotune, crosses, available)


def _host_inter_group(opts: CommConfig, topology, groups, cuda_gradients: bool, process_group):
    """The gloo group CPU-Reduce crosses nodes on (this rank's inter-node ranks), where ``comm.cpu_reduce`` asks
    for it (true, or auto with the autotuner) and it applies: CUDA gradients on a non-gloo group with hierarchical
    groups. ``true`` where it cannot apply says why. Collective: every rank creates every group, in the same order."""
    wanted = opts.cpu_reduce is True or opts.cpu_reduce == "auto" and opts.autotune
    if not wanted or groups is None:
        return None   # no hierarchical groups: comm.cpu_reduce=true has been warned of with comm.hierarchical's reason
    if not cuda_gradients or dist.get_backend(process_group) == "gloo":
        if opts.cpu_reduce is True:
            warn("aiak.comm: comm.cpu_reduce=true applies to CUDA gradients on NCCL; this run "
                 + ("keeps its gradients on the CPU" if not cuda_gradients else "runs gloo")
                 + ", which reduces on the host already; the hierarchical algorithm runs as is")
        return None
    return build_groups(topology, backend="gloo").inter


def _autotune(model, state: CommState, opts: CommConfig, topology, device_ids, process_group, counts=(1,)):
    """Cache lookup (rank 0 reads, broadcasts; an entry this run's settings do not allow is tuned again), else
    comm-mode tuning now or a step-mode tuner.

    Returns ``(bucket_mb, tuner or None)`` and leaves ``state`` on the chosen (or cached) algorithm.
    """
    inputs = TuneInputs.of(opts, topology.world_size, topology.local_size, "cuda" if device_ids else "cpu",
                           groups=state.groups is not None, connections=counts, link=topology.link,
                           cpu_reduce=state.host_inter is not None)
    cache = TuneCache(opts.tune_cache)
    key = inputs.key(model)
    state.tuning = record = CommTuning(opts.perf_mode, cache=str(cache.path))
    if opts.connections == "auto" and nccl_sockets.measured_here(dist.get_backend(process_group), bool(device_ids),
                                                                  topology.num_nodes > 1):
        buckets = gradient_bucket_sizes(model, opts.bucket_mb)
        nccl_sockets.advise(buckets, cache=cache, record=record, rounds=opts.tune_steps, device_index=device_ids[0],
                            key=nccl_sockets.cache_key(topology.link, topology.world_size, topology.local_size,
                                                       buckets, torch.__version__))
    cached = cached_choice(cache, key, inputs, process_group)
    if cached is not None:
        record.cache_hit, record.chosen = True, cached.describe()
        logger.info("aiak.comm autotune: cache hit in %s for %s -> %s (tuning skipped)", cache.path, key,
                    cached.describe())
        state.set_route(*cached.route)
        return cached.bucket_mb, None

    def remember(choice, times=None):
        if on_rank0(process_group):
            cache.put_entry(key, choice.entry(perf_mode=opts.perf_mode))

    if opts.perf_mode == "comm":
        device = torch.device("cuda", device_ids[0]) if device_ids else None
        choice = tune_comm(model, state, inputs.bucket_mbs, inputs.int8, repeats=opts.tune_steps, device=device,
                           allow_hierarchical=inputs.hierarchical_allowed, connections=inputs.connections,
                           cpu_reduce=inputs.cpu_reduce, record=record)
        remember(choice)
        return choice.bucket_mb, None

    return opts.bucket_mb, StepTuner(inputs.candidates(), opts.tune_steps, opts.bucket_mb, remember, record)

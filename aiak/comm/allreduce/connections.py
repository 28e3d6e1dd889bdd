"""Several TCP connections per group that crosses nodes, so that one stream's rate cap does not cap the link.

One TCP stream often cannot fill a cloud link: providers cap each flow, and a single congestion window on a
long round trip stays small. ACSpeed measures 5-20% from several streams, Bagua-net (an NCCL TCP plugin with
several streams) +83% communication; NCCL's own socket transport opens one socket on one thread unless
``NCCL_SOCKET_NTHREADS`` / ``NCCL_NSOCKS_PERTHREAD`` say otherwise.

gloo opens one *context* (its own TCP connections to every peer) per device of a process group, and gives
each collective the context ``tag % devices`` (the tag counts the group's collectives): ``k`` collectives issued
together on a group of ``k`` devices travel on ``k`` different connections. torch builds a gloo group with one
device per entry of ``GLOO_SOCKET_IFNAME`` for the whole process; `group_with_connections` builds one
group with ``k`` devices, through a backend registered under `BACKEND` (the same ``ProcessGroupGloo``,
with ``k`` devices and ``2k`` worker threads, so the ``k`` collectives also run at once). The comm hook splits
each cross-node stage into ``k`` pieces issued together (`aiak.comm.allreduce.hooks`).

NCCL is configured by environment variables read when its communicator is created; ``aiak doctor`` checks them.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Sequence, Tuple

import torch.distributed as dist

BACKEND = "aiak_gloo_connections"
AUTO_CANDIDATES = (1, 4)   # comm.connections: auto -> the comm autotuner measures one connection against four


def _devices(k: int) -> list:
    """``k`` gloo devices: on the interfaces of ``GLOO_SOCKET_IFNAME`` in turn when it is set (as torch's own
    groups are), else the default device (the address the host name resolves to) ``k`` times."""
    interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
    gloo = dist.ProcessGroupGloo
    if interfaces:
        return [gloo.create_device(interface=interfaces[i % len(interfaces)]) for i in range(k)]
    return [gloo.create_default_device() for _ in range(k)]


def _create(opts, k) -> "dist.ProcessGroupGloo":
    """The backend's constructor (torch's extended API): a gloo process group with ``k`` devices."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = _devices(int(k))
    options._threads = 2 * int(k)     # torch's own rule: two worker threads per device
    options._timeout = opts.timeout
    group = dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, options)
    group.options.global_ranks_in_group = opts.global_ranks_in_group
    group.options.group_name = opts.group_id
    return group


def _register() -> None:
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


def group_with_connections(ranks: Sequence[int], k: int):
    """A gloo group of ``ranks`` whose collectives spread over ``k`` TCP connections per peer (see the module
    docstring). Collective over the whole world, like ``new_group``: every rank calls it, in the same order."""
    if k < 1:
        raise ValueError(f"connections must be >= 1, got {k}")
    _register()
    return dist.new_group(list(ranks), backend=BACKEND, pg_options=k)


def connections_available(group=None) -> bool:
    """Whether `group_with_connections` applies: the default group runs gloo (CPU tensors). On NCCL the
    number of sockets is NCCL's (``NCCL_SOCKET_NTHREADS`` x ``NCCL_NSOCKS_PERTHREAD``)."""
    return dist.get_backend(group) == "gloo"


def connection_counts(setting: Any, autotune: bool, crosses_nodes: bool, available: bool) -> Tuple[int, ...]:
    """The numbers of connections a run sets up, the one it starts with first: ``comm.connections`` N -> (N,);
    ``auto`` -> `AUTO_CANDIDATES` when the autotuner measures them, else (1,). (1,) where connections do
    not apply (no stage crosses nodes, or the backend is not gloo)."""
    if not (crosses_nodes and available):
        return (1,)
    if setting == "auto":
        return AUTO_CANDIDATES if autotune else (1,)
    return (int(setting),)


def wide_groups(topology, process_group, counts: Sequence[int], flat: bool, inter: bool) -> Dict[Tuple[str, int], Any]:
    """The groups `aiak.comm.allreduce.hooks.CommState` crosses nodes on with ``k`` > 1 connections, keyed
    ``("flat", k)`` (the ranks of ``process_group``) and ``("inter", k)`` (this rank's inter-node group: local
    rank ``i`` of every node). Collective: every rank creates every group, in the same order."""
    wide: Dict[Tuple[str, int], Any] = {}
    flat_ranks = tuple(dist.get_process_group_ranks(process_group) if process_group is not None
                       else range(topology.world_size))
    for k in (k for k in counts if k > 1):
        if flat:
            wide[("flat", k)] = _cached(("flat", id(dist.group.WORLD), flat_ranks, k),
                                        lambda: group_with_connections(flat_ranks, k))
        if inter:
            wide[("inter", k)] = _cached(("inter", id(dist.group.WORLD), topology.nodes, k),
                                         lambda: _inter_groups(topology, k))
    return wide


_GROUPS: Dict[Tuple, Any] = {}   # created once per layout and count, as aiak.comm.allreduce.topology.build_groups does


def _cached(key: Tuple, create) -> Any:
    if key not in _GROUPS:   # the same keys on every rank, in the same order: all create or none does
        _GROUPS[key] = create()
    return _GROUPS[key]


def _inter_groups(topology, k: int):
    """Every inter-node group (local rank ``i`` of every node) with ``k`` connections; this rank's."""
    mine = None
    for i in range(topology.local_size):
        group = group_with_connections([node[i] for node in topology.nodes], k)
        if topology.local_rank == i:
            mine = group
    return mine

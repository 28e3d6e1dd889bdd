"""Which ranks share a node, and the process groups that hierarchical allreduce runs on.

Nodes and local ranks come from the environment ``torchrun`` sets (``LOCAL_WORLD_SIZE`` and
``GROUP_RANK`` or ``NODE_RANK``); without it, host names are gathered once with ``all_gather_object``.
Following the two-level scheme of "hierarchical allreduce" (Swin training over 25 Gb/s TCP, 4 nodes x
8 GPUs, 85% faster), two kinds of groups are built:

* one *intra-node* group per node (ranks of one node: reduce-scatter / allgather over fast links),
* one *inter-node* group per local rank index (local rank ``i`` of every node: each carries one shard
  across the slow network, all local ranks in parallel).

``new_group`` is a collective over the whole world, so every rank creates every group in the same order
(intra groups by node, then inter groups by local index), whether or not it belongs to it.
Nodes of different sizes cannot be paired shard by shard: `build_groups` returns ``None`` and the
caller falls back to flat allreduce with a warning.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from aiak.util.dist import process_group_exists
from aiak.util.warn import warn


@dataclass(frozen=True)
class Topology:
    """Ranks grouped by node. ``nodes[n]`` lists the global ranks on node ``n``, in local-rank order."""

    rank: int
    world_size: int
    nodes: Tuple[Tuple[int, ...], ...]
    source: str  # "env" or "hostname": where the node assignment came from
    hosts: Tuple[str, ...] = ()  # the host name of each node's first rank

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def node_rank(self) -> int:
        return next(n for n, ranks in enumerate(self.nodes) if self.rank in ranks)

    @property
    def local_rank(self) -> int:
        return self.nodes[self.node_rank].index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.nodes[self.node_rank])

    @property
    def uniform(self) -> bool:
        """All nodes hold the same number of ranks (needed to pair shards across nodes)."""
        return len({len(ranks) for ranks in self.nodes}) == 1

    @property
    def hierarchical_useful(self) -> bool:
        """More than one node and more than one rank per node: the only case where two levels help."""
        return self.num_nodes > 1 and self.uniform and self.local_size > 1

    @property
    def link(self) -> str:
        """What names the network between the nodes, for a cache of measurements on it: the nodes' host names and
        the interfaces the run was told to use (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``)."""
        interfaces = [f"{v}={os.environ[v]}" for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if os.environ.get(v)]
        return ",".join(self.hosts) + "".join(f";{i}" for i in interfaces)

    def describe(self) -> str:
        sizes = sorted({len(r) for r in self.nodes})
        return (f"{self.world_size} ranks on {self.num_nodes} node(s) x {'/'.join(map(str, sizes))} "
                f"local (from {self.source})")


def _env_int(*names: str) -> Optional[int]:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                warn(f"aiak.comm: ignoring non-integer {name}={value!r}")
    return None


def detect_topology(group=None) -> Topology:
    """Node layout of the (initialized) default process group.

    Uses ``LOCAL_WORLD_SIZE`` + ``GROUP_RANK``/``NODE_RANK`` (+ ``LOCAL_RANK``) when every rank has them
    (one ``all_gather_object`` checks that), otherwise the host names gathered from every rank.
    """
    if not process_group_exists():
        return Topology(rank=0, world_size=1, nodes=((0,),), source="single process")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    local_size = _env_int("LOCAL_WORLD_SIZE")
    node = _env_int("GROUP_RANK", "NODE_RANK")
    local_rank = _env_int("LOCAL_RANK")
    mine = (node, local_rank, local_size, socket.gethostname())
    gathered: List = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    if all(g[0] is not None and g[1] is not None for g in gathered):
        keys = [(g[0], g[1]) for g in gathered]
        source = "env"
    else:
        hosts = list(dict.fromkeys(g[3] for g in gathered))  # first-seen order, identical on every rank
        keys, seen = [], {}
        for g in gathered:
            seen[g[3]] = seen.get(g[3], -1) + 1
            keys.append((hosts.index(g[3]), seen[g[3]]))
        source = "hostname"
    by_node: Dict[int, List[Tuple[int, int]]] = {}
    for r, (n, lr) in enumerate(keys):
        by_node.setdefault(n, []).append((lr, r))
    nodes = tuple(tuple(r for _, r in sorted(members)) for _, members in sorted(by_node.items()))
    return Topology(rank=rank, world_size=world, nodes=nodes, source=source,
                    hosts=tuple(gathered[ranks[0]][3] for ranks in nodes))


@dataclass
class HierarchicalGroups:
    """The groups this rank uses: its node's intra group and its local index's inter group."""

    topology: Topology
    intra: object
    inter: object
    intra_ranks: Tuple[int, ...]
    inter_ranks: Tuple[int, ...]


_GROUP_CACHE: Dict[Tuple, HierarchicalGroups] = {}


def build_groups(topology: Topology, backend: Optional[str] = None) -> Optional[HierarchicalGroups]:
    """Create (once per layout) the intra- and inter-node groups; ``None`` when nodes are uneven.

    Every rank must call this at the same point (it is collective); it is a no-op on a cache hit.
    """
    if not topology.uniform:
        sizes = [len(r) for r in topology.nodes]
        warn(f"aiak.comm: nodes hold different numbers of ranks {sizes}; hierarchical allreduce needs equal nodes, "
             "falling back to flat allreduce")
        return None
    key = (id(dist.group.WORLD), topology.nodes, backend)
    if key in _GROUP_CACHE:
        return _GROUP_CACHE[key]
    mine_intra = mine_inter = None
    intra_ranks = inter_ranks = ()
    for ranks in topology.nodes:  # same order on every rank
        g = dist.new_group(list(ranks), backend=backend)
        if topology.rank in ranks:
            mine_intra, intra_ranks = g, ranks
    for i in range(topology.local_size):
        ranks = tuple(node[i] for node in topology.nodes)
        g = dist.new_group(list(ranks), backend=backend)
        if topology.rank in ranks:
            mine_inter, inter_ranks = g, ranks
    groups = HierarchicalGroups(topology, mine_intra, mine_inter, intra_ranks, inter_ranks)
    _GROUP_CACHE[key] = groups
    return groups

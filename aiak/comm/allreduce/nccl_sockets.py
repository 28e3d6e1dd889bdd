"""NCCL's sockets per peer (``NCCL_SOCKET_NTHREADS`` x ``NCCL_NSOCKS_PERTHREAD``), measured by the comm autotuner in
fresh processes and recommended for the next launch.

NCCL's socket transport opens one socket on one thread per peer unless these say otherwise (it picks more by
itself only on AWS's and GCP's NICs), and one TCP stream often cannot fill a cloud link: ACSpeed measures 5-20%
from several streams, Bagua-net (an NCCL plugin with several) +83% communication. NCCL reads the two variables
once per process, at its first connection over the network (its parameters are cached at the first read), which
happens before aiak runs: so nothing inside the training process can vary or apply them. With ``comm.autotune``
and ``comm.connections: auto`` on an NCCL job across nodes whose environment leaves both unset, `advise`
times `CANDIDATES` in child processes (`aiak.comm.allreduce.env_trials.time_env_candidates`) on the model's
bucket sizes, keeps more sockets only when they are at least
`CONNECTIONS_MARGIN` faster, puts every figure in the decision record, caches the
pick per link and bucket sizes, and warns with what to export before the next launch. Set in the environment,
they are the user's choice: nothing is measured.
"""
from __future__ import annotations

import math
import os
from typing import Dict, Mapping, Optional, Sequence

from aiak.comm.allreduce.autotune import CONNECTIONS_MARGIN, CommTuning, decide
from aiak.comm.allreduce.env_trials import time_env_candidates
from aiak.util.cache import TuneCache
from aiak.util.dist import on_rank0, rank0_object
from aiak.util.warn import warn

VARIABLES = ("NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD")
CANDIDATES = ({}, {"NCCL_SOCKET_NTHREADS": "2", "NCCL_NSOCKS_PERTHREAD": "2"},
              {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"})   # as launched; 4 and 16 sockets per peer
PASS = "launch environment"   # the decision record's name for this pass


def label(env: Mapping[str, Optional[str]]) -> str:
    """``NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4``, or ``as launched`` for the empty candidate."""
    return " ".join(f"{name}={value}" for name, value in env.items()) or "as launched"


def measured_here(backend: str, cuda_gradients: bool, crosses_nodes: bool,
                  environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the comm autotuner measures NCCL's socket counts: CUDA gradients on NCCL across nodes, with neither
    variable set in the environment (set, they are the user's)."""
    return cuda_gradients and "nccl" in backend.lower() and crosses_nodes and not any(environ.get(v) for v in VARIABLES)


def cache_key(link: str, world_size: int, local_size: int, bucket_numels: Sequence[int], torch_version: str) -> str:
    return TuneCache.key("launch-env", link, {"world": world_size, "local": local_size, "torch": torch_version},
                         digest_of=list(bucket_numels))


def advise(bucket_numels: Sequence[int], *, cache: TuneCache, key: str, record: CommTuning, rounds: int = 3,
           device_index: Optional[int] = None, candidates: Sequence[Mapping[str, Optional[str]]] = CANDIDATES,
           backend: str = "nccl", timeout_s: float = 120.0) -> Dict[str, Optional[str]]:
    """The candidate environment to launch with (``{}``: as launched), from the cache or measured now, with its
    figures in ``record`` and, when it is not the launch's own, a warning saying what to export. Collective over
    the default group: every rank calls it at the same point and gets the same answer."""
    entry = rank0_object(lambda: cache.get_entry(key))
    if isinstance(entry, dict) and isinstance(entry.get("env"), dict):
        env, how = entry["env"], f"cached in {cache.path}"
    else:
        trials = time_env_candidates(candidates, bucket_numels, backend=backend, device_index=device_index,
                                     rounds=rounds, timeout_s=timeout_s)
        best = decide([t.median for t in trials], keep_first_within=CONNECTIONS_MARGIN)
        if not math.isfinite(trials[best].median):
            best = 0   # nothing measured: say nothing
        record.add(PASS, [label(t.env) for t in trials],
                   [(t.median, min(t.seconds), max(t.seconds)) if t.seconds else None for t in trials], best,
                   [t.error for t in trials])
        env = trials[best].env if math.isfinite(trials[best].median) else {}
        faster = trials[0].median / trials[best].median if env and math.isfinite(trials[0].median) else None
        how = f"measured {faster:.2f}x faster than as launched" if faster else "measured"
        if on_rank0():
            cache.put_entry(key, {"env": dict(env), "ms": [t.median * 1e3 for t in trials]})
    if env:
        record.advice = (f"{label(env)}: {how} on this model's buckets; the communication library reads these once "
                         "per process, before aiak runs: set them in the job's environment (before torchrun)")
        warn(f"aiak.comm: {record.advice}")
    return env

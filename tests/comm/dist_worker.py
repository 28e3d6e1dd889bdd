"""One rank of a multi-process comm test (launched by conftest.launch with torchrun's environment).

``python dist_worker.py <scenario> <outdir>``: runs the scenario and ``torch.save``s its result to
``<outdir>/rank<r>.pt``; the test process makes the assertions.
"""
from __future__ import annotations

import logging
import os
import sys
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from aiak.comm import CollectiveMismatchError, detect_topology, wrap_distributed
from aiak.comm.diagnostics.deadlock import deadlock_guard, disable_deadlock_guard
from aiak.strategy.schema import CommConfig

ALGORITHMS = [(h, c) for h in (False, True) for c in ("none", "fp16", "bf16", "int8")]


class LogRecorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(13, 31), nn.Tanh(), nn.Linear(31, 7))


def small_model(seed=0):
    """1.1 MB of odd-sized parameters: several 0.25 MB buckets after DDP's 1 MB first one; shards need padding."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(13, 511), nn.Tanh(), nn.Linear(511, 521), nn.Tanh(),
                         nn.Linear(521, 7, bias=False))  # buckets of 270399 (odd) and 7154 values


def rank_data(rank, n=8, step=0):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 13, generator=g), torch.randn(n, 7, generator=g)


def grads_of(ddp, step):
    ddp.zero_grad(set_to_none=True)
    x, y = rank_data(dist.get_rank(), step=step)
    nn.functional.mse_loss(ddp(x), y).backward()
    return [p.grad.detach().clone() for p in ddp.parameters()]


class CollectiveRecorder:
    """Records (op, group ranks, numel, dtype) of the collectives the hooks issue."""

    OPS = ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor", "all_gather_single",
           "all_gather_into_tensor", "all_to_all_single")

    def __init__(self):
        self.calls, self.groups, self._originals = [], [], {}

    def __enter__(self):
        for name in self.OPS:
            if hasattr(dist, name):
                original = self._originals[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, original))
        return self

    def _wrap(self, name, original):
        def recorded(*args, **kwargs):
            group = kwargs.get("group")
            ranks = (tuple(dist.get_process_group_ranks(group)) if group is not None
                     else tuple(range(dist.get_world_size())))
            position, keyword = (0, "tensor") if name == "all_reduce" else (1, "input")  # the input, as FSDP2
            tensor = args[position] if len(args) > position else kwargs[keyword]     # passes it too (by keyword)
            self.calls.append((name.split("_single")[0].replace("_tensor", "").replace("_into", ""), ranks,
                               tensor.numel(), str(tensor.dtype)))
            self.groups.append(group)
            return original(*args, **kwargs)
        return recorded

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)


def scenario_fp16_overflow(rank):
    """fp16 transport where aiak casts for the wire (flat, 4 connections, hierarchical across nodes, in the node with
    compress_intra, CPU-Reduce's host copies), 2 nodes x 2 ranks: a bucket whose values fit and one where rank 1 holds
    values past fp16's range; each against the same algorithm uncompressed, the collectives recorded. Then training
    through aiak.optimize with comm.compression fp16, an fp32 model whose gradients pass 65504 on rank 1."""
    import aiak
    from aiak.comm.allreduce.connections import wide_groups
    from aiak.comm.allreduce.hooks import CommState, average
    from aiak.comm.allreduce.topology import build_groups

    topology = detect_topology()
    groups = build_groups(topology)
    host = build_groups(topology, backend="gloo").inter
    wide = wide_groups(topology, None, (4,), flat=True, inter=True)
    variants = {"flat": {}, "flat_4_connections": {"connections": 4},
                "hierarchical": {"hierarchical": True}, "compress_intra": {"hierarchical": True, "compress_intra": True},
                "cpu_reduce": {"hierarchical": True, "host_inter": host, "cpu_reduce": True}}
    out = {}
    for name, kw in variants.items():
        for values in ("fit", "past"):
            g = torch.Generator().manual_seed(rank)
            x = torch.randn(100_003, generator=g) * 100
            if values == "past" and rank == 1:
                x[::1000] = 3e5  # /4 by average(): 75000 on the wire
            for c in ("none", "fp16"):
                state = CommState(None, groups, compression=c, wide=wide, pipeline_mb=0.1, stall_warn_s=0, **kw)
                y = x.clone()
                with CollectiveRecorder() as rec:
                    average(state, y).wait()
                out[(name, values, c)] = {"result": y, "calls": rec.calls}
    for compression in ("none", "fp16"):
        for hierarchical in (False, True):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(13, 7))  # linear: nothing saturates, the gradient grows with the input
            ddp, opt = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=1e-9), strategy={
                "comm": {"compression": compression, "hierarchical": hierarchical}})[:2]
            for step in range(4):
                x, y = rank_data(rank, step=step)
                scale = 1e4 if rank == 1 and step == 2 else 1.0  # gradients of ~1e7
                nn.functional.mse_loss(ddp(x * scale), y).backward()
                opt.step()
                opt.zero_grad()
            out[("training", compression, hierarchical)] = {k: v.detach().clone()
                                                            for k, v in ddp.module.state_dict().items()}
    return out


def scenario_equivalence(rank):
    out = {"topology": detect_topology().nodes}
    base = wrap_distributed(small_model(), CommConfig(hierarchical=False, bucket_mb=0.25))
    out["baseline_is_default_ddp"] = base._comm_hooks == [] if hasattr(base, "_comm_hooks") else None
    out["baseline"] = [grads_of(base, s) for s in range(2)]
    for h, c in ALGORITHMS:
        ddp = wrap_distributed(small_model(), CommConfig(hierarchical=h, compression=c, bucket_mb=0.25))
        grads = [grads_of(ddp, 0)]
        with CollectiveRecorder() as rec:
            grads.append(grads_of(ddp, 1))  # buckets rebuilt to 0.001 MB after the first iteration
        out[(h, c)] = {"grads": grads, "calls": rec.calls, "state": ddp.aiak_comm_state.describe()}
    # the hierarchical pipeline cut into ~11 chunks per 1 MB bucket
    for c in ("none", "int8"):
        ddp = wrap_distributed(small_model(), CommConfig(hierarchical=True, compression=c, bucket_mb=0.25),
                               pipeline_mb=0.1)
        grads = [grads_of(ddp, 0)]
        with CollectiveRecorder() as rec:
            grads.append(grads_of(ddp, 1))
        out[("pipelined", c)] = {"grads": grads, "calls": rec.calls}
    # accumulation: the lead's step controller toggles require_backward_grad_sync on micro-steps
    accum = {}
    for name, cfg in (("default", CommConfig(hierarchical=False)), ("hier", CommConfig(hierarchical=True))):
        ddp = wrap_distributed(small_model(), cfg)
        ddp.zero_grad()
        for micro in range(3):
            ddp.require_backward_grad_sync = micro == 2
            x, y = rank_data(rank, step=10 + micro)
            nn.functional.mse_loss(ddp(x), y).backward()
        accum[name] = [p.grad.clone() for p in ddp.parameters()]
    out["accum"] = accum
    # state_dict keys are the user's, and loading them round-trips
    ddp = wrap_distributed(small_model(), CommConfig(hierarchical=True))
    sd = ddp.state_dict()
    out["state_dict_keys"] = (list(sd.keys()), list(small_model().state_dict().keys()))
    other = wrap_distributed(small_model(seed=5), CommConfig(hierarchical=True))
    other.load_state_dict(sd)
    prefixed = {f"module.{k}": v for k, v in sd.items()}
    third = wrap_distributed(small_model(seed=6), CommConfig(hierarchical=True))
    third.load_state_dict(prefixed)
    out["state_dict_roundtrip"] = all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), sd.values())) \
        and all(torch.equal(a, b) for a, b in zip(third.state_dict().values(), sd.values()))
    return out


def teacher_problem(rank, n=64, dim=16):
    g = torch.Generator().manual_seed(7)
    w_true = torch.randn(dim, 1, generator=g)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, dim, generator=g) * torch.logspace(0, -2, dim)  # feature scales 1 .. 0.01
    return x, x @ w_true


def train(ddp, rank, steps=80, lr=0.2):
    x, y = teacher_problem(rank)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def scenario_training(rank):
    """Gradient equivalence of every algorithm, then int8 training against fp32 (one launch for both)."""
    out = scenario_equivalence(rank)

    def model():
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))

    for name, cfg in (("fp32", CommConfig(hierarchical=False)),
                                ("hier_int8", CommConfig(hierarchical=True, compression="int8")),
                                ("flat_int8", CommConfig(hierarchical=False, compression="int8"))):
        ddp = wrap_distributed(model(), cfg)
        losses = train(ddp, rank)
        out[name] = {"losses": losses, "weights": [p.detach().clone() for p in ddp.parameters()]}
    return out


def scenario_autotune(rank):
    rec = LogRecorder()
    logging.getLogger("aiak").addHandler(rec)
    logging.getLogger("aiak").setLevel(logging.INFO)
    out = {}
    ddp = wrap_distributed(tiny_model(), CommConfig(autotune=True, bucket_mb=0.001), tune_steps=1, tune_int8=True)
    grads_of(ddp, 0)
    out["comm"] = {"choice": ddp.aiak_comm_state.describe(), "bucket_mb": ddp.bucket_bytes_cap / 2**20}
    out["comm_record"] = ddp.aiak_comm_state.tuning.to_dict()
    ddp = wrap_distributed(tiny_model(), CommConfig(autotune=True, bucket_mb=0.001), tune_steps=1, perf_mode="step")
    state = ddp.aiak_comm_state
    steps = 0
    while state.tuner is not None and steps < 30:
        grads_of(ddp, steps)
        steps += 1
    tuned_at = steps
    out["step"] = {"choice": state.describe(), "tuned_at": tuned_at, "final_grads": grads_of(ddp, 99)}
    out["step_record"] = state.tuning.to_dict()
    out["logs"] = rec.messages
    out["cache"] = open(os.environ["AIAK_TUNE_CACHE"]).read() if rank == 0 else None
    return out


def scenario_deadlock(rank):
    out = {}
    # no false positives: guarded DDP steps (async chained collectives) give the unguarded gradients
    base = wrap_distributed(tiny_model(), CommConfig(hierarchical=False, bucket_mb=0.001))
    expected = grads_of(base, 0)
    guarded = wrap_distributed(tiny_model(), CommConfig(hierarchical=True, compression="fp16", bucket_mb=0.001),
                               deadlock_guard=True, timeout_s=20)
    out["guarded_grads"] = (grads_of(guarded, 0), expected)
    disable_deadlock_guard()
    node = int(os.environ["GROUP_RANK"])
    timeout = 4.0
    t = torch.ones(10)
    with deadlock_guard(timeout_s=timeout):  # node 0 reduces then broadcasts, node 1 the other way round
        start = time.monotonic()
        try:
            for op in ((dist.all_reduce, dist.broadcast) if node == 0 else (dist.broadcast, dist.all_reduce)):
                op(t) if op is dist.all_reduce else op(t, src=0)
            out["misordered"] = ("no error", time.monotonic() - start)
        except CollectiveMismatchError as e:
            out["misordered"] = (str(e), time.monotonic() - start)
    with deadlock_guard(timeout_s=timeout):  # rank 3 arrives after the timeout
        start = time.monotonic()
        try:
            if rank == 3:
                time.sleep(timeout + 2)
            dist.all_reduce(t)
            out["late"] = ("no error", time.monotonic() - start)
        except CollectiveMismatchError as e:
            out["late"] = (str(e), time.monotonic() - start)
    return out


def scenario_uneven(rank):
    out = {"topology": detect_topology()}
    base = wrap_distributed(tiny_model(), CommConfig(hierarchical=False, bucket_mb=0.001))
    expected = grads_of(base, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = wrap_distributed(tiny_model(), CommConfig(hierarchical=True, compression="fp16", bucket_mb=0.001))
    out["warnings"] = [str(w.message) for w in caught]
    out["state"] = ddp.aiak_comm_state.describe()
    out["grads"] = (grads_of(ddp, 0), expected)
    for name in ("GROUP_RANK", "NODE_RANK"):
        os.environ.pop(name, None)
    out["hostname_topology"] = detect_topology()
    return out


def scenario_optimize(rank):
    """The whole stack under torchrun: O2 bf16 (half compute copies of the fp32 parameters) + accumulation 2 +
    hierarchical fp16 DDP.

    Each rank starts from different weights (seeded by rank): optimize() must make every rank start from
    rank 0's exact fp32 weights and keep them identical. ("masters": the fp32 parameters the optimizer steps,
    which under O2 are the model's own.)"""
    import aiak

    model = tiny_model(seed=100 + rank)
    rank0_weights = {k: v.clone() for k, v in tiny_model(seed=100).state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    strategy = {"precision": {"level": "O2", "dtype": "bf16"}, "grad_accumulation": 2,
                "comm": {"hierarchical": True, "compression": "fp16", "bucket_mb": 0.001}}
    ddp, opt, _ = aiak.optimize(model, opt, strategy=strategy)
    out = {"start": {k: v.clone() for k, v in ddp.state_dict().items()}, "rank0_start": rank0_weights,
           "describe": aiak.last_decision().effect("comm"), "type": type(ddp).__name__}
    for step in range(6):
        x, y = rank_data(rank, step=step)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    out["end"] = {k: v.clone() for k, v in ddp.state_dict().items()}
    out["masters"] = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    return out


def scenario_prewrapped_o2(rank):
    """O2 bf16 on a model the script wrapped in DistributedDataParallel itself, against aiak's usual order
    (``aiak.optimize`` on the bare model, which builds the DDP), without and with ``grad_accumulation: 2``. Each
    rank starts from its own weights (seeded by rank): DDP's constructor makes every rank start from rank 0's."""
    import aiak
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for name, extra in (("o2", {}), ("o2_accum2", {"grad_accumulation": 2})):
        strategy = {"precision": {"level": "O2", "dtype": "bf16"}, **extra}
        runs = {}
        for order in ("script_ddp_first", "aiak_wraps"):
            model = tiny_model(seed=100 + rank)
            if order == "script_ddp_first":
                ddp = DDP(model)
                opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    returned, opt, _ = aiak.optimize(ddp, opt, strategy=strategy)
                state = getattr(returned, "aiak_comm_state", None)
                run = {"returned_is_script_ddp": returned is ddp, "module_is_script_model": returned.module is model,
                       "comm_hooks": len(getattr(returned, "_comm_hooks", [])),
                       "compression": getattr(state, "compression", None),
                       "describe": state.describe() if state is not None else None,
                       "warnings": [str(w.message) for w in caught]}
            else:
                opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
                returned, opt, _ = aiak.optimize(model, opt, strategy=strategy)
                run = {"type": type(returned).__name__, "describe": returned.aiak_comm_state.describe()}
            for step in range(8):
                x, y = rank_data(rank, step=step)
                nn.functional.mse_loss(returned(x), y).backward()
                opt.step()
                opt.zero_grad()
            run["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
            run["end"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            runs[order] = run
        out[name] = runs
    out["rank0_start"] = {k: v.clone() for k, v in tiny_model(seed=100).state_dict().items()}
    return out


def scenario_script_ddp_after_aiak(rank):
    """torchvision's order under torchrun: ``aiak.optimize(model, ...)`` first, then the script's own
    ``DistributedDataParallel(model, device_ids=...)`` line and ``model_without_ddp = model.module`` for its EMA;
    against the same script without aiak. Each rank starts from its own weights (seeded by rank)."""
    import copy

    import aiak
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.swa_utils import AveragedModel

    out = {}
    for name, strategy in (("plain", None), ("default", "default"), ("accum2", {"grad_accumulation": 2})):
        model = tiny_model(seed=100 + rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        user_model = model
        if strategy is not None:
            model, opt, _ = aiak.optimize(model, opt, strategy=strategy)
        aiak_ddp = model
        model = DDP(model, device_ids=None, broadcast_buffers=False)  # the script's line
        without_ddp = model.module
        ema = AveragedModel(without_ddp)
        run = {"is_aiaks": model is aiak_ddp, "module_is_user_model": without_ddp is user_model,
               "ddp_count": sum(isinstance(m, DDP) for m in model.modules()),
               "comm_hooks": len(getattr(model, "_comm_hooks", [])), "bucket_bytes": model.bucket_bytes_cap,
               "broadcast_buffers": model.broadcast_buffers, "ema_copied": ema.module is not without_ddp}
        steps = 8 if name == "accum2" else 4
        for step in range(steps):
            x, y = rank_data(rank, step=step)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        run["end"] = {k: v.detach().clone() for k, v in without_ddp.state_dict().items()}
        out[name] = run
    try:  # an argument aiak's DDP cannot take is one clear error
        DDP(aiak_ddp, find_unused_parameters=True)
        out["find_unused_error"] = None
    except ValueError as e:
        out["find_unused_error"] = str(e)
    copy.deepcopy(without_ddp)
    return out


NAN_STEP = 4  # the step at which rank 1 gets a NaN sample in nan_recovery


def nan_recovery(rank, comm, steps=16):
    """O2 fp16 + int8 through ``aiak.optimize`` (which builds the DDP); rank 1's batch has one NaN sample at
    step ``NAN_STEP``. Records what the loss scaler did at every step and the end state of every rank."""
    import aiak

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=10.0)  # on the loss x 1e-2 below
    strategy = {"precision": {"level": "O2", "dtype": "fp16"}, "comm": {"compression": "int8", **comm}}
    ddp, opt, _ = aiak.optimize(model, opt, strategy=strategy)
    scaler, state = opt._aiak_steps.scaler, ddp.aiak_comm_state
    x, y = teacher_problem(rank)
    out = {"describe": state.describe(), "losses": [], "scales": [], "skipped": [], "masters": {}}
    for step in range(steps):
        batch = x.clone()
        if rank == 1 and step == NAN_STEP:
            batch[0, 0] = float("nan")
        loss = nn.functional.mse_loss(ddp(batch), y) * 1e-2  # keeps fp16 gradients x 2**16 below overflow
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
        out["scales"].append(scaler.scale)
        out["skipped"].append(scaler.skipped_steps)
        if step in (NAN_STEP + 1, steps - 1):
            out["masters"][step] = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    out["weights"] = {k: v.clone() for k, v in ddp.state_dict().items()}
    out["residuals"] = state.feedback.residuals()
    return out


def scenario_int8_nan(rank):
    return nan_recovery(rank, {"hierarchical": False, "bucket_mb": 0.001})


def scenario_int8_nan_hierarchical(rank):
    return nan_recovery(rank, {"hierarchical": True, "bucket_mb": 0.001})


class SkewedNet(nn.Module):
    """A small CNN whose speed depends on the rank, deliberately: rank 3 is slow under bf16 autocast, rank 1
    refuses channels_last inputs (an error on one rank only)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        rank = dist.get_rank()
        if rank == 3 and torch.is_autocast_enabled("cpu"):
            time.sleep(0.15)
        if rank == 1 and x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
            raise RuntimeError("rank 1 refuses channels_last")
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def scenario_tune_skewed(rank):
    """4 ranks tune one strategy: the slowest rank's times and any rank's failure decide for everyone."""
    import aiak
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = SkewedNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    data = TensorDataset(torch.randn(64, 3, 12, 12, generator=g), torch.randint(0, 5, (64,), generator=g))
    loader = DataLoader(data, batch_size=8)
    strategy = {"extends": "default", "channels_last": True, "precision": {"level": "O1", "dtype": "bf16"},
                "loader": {"prefetch": 1}, "tune": {"candidates": 6, "steps": 3}}
    # 6: room for the bf16 candidate without channels_last after the fp16 one a CPU with native fp16 adds
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ddp, optimizer, loader = aiak.optimize(model, optimizer, loader, strategy=strategy)
    decision = aiak.last_decision().to_dict()
    for x, y in loader:
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"decision": decision, "weights": {k: v.clone() for k, v in ddp.state_dict().items()}}


def scenario_probe(rank):
    """The distribution probes and the rules that follow from them, as each rank finds them."""
    from aiak.strategy import select

    selection = select(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()))
    p = selection.probes
    return {"world_size": p.world_size, "local_size": p.local_size, "nodes": p.nodes, "backend": p.backend,
            "matched": selection.matched, "strategy": selection.strategy.to_dict(), "digest": selection.profiles_digest}


def scenario_stall(rank):
    """Rank 3 reaches step 2's backward 3 s late; with ``stall_warn_s: 1`` the waiting ranks say who they wait
    for, and the steps still finish; with 0 nothing is said. Hierarchical on 2 nodes x 2 ranks, so rank 2 waits
    for rank 3 in the node and ranks 0 and 1 wait across nodes."""
    out = {}
    for warn_s in (1.0, 0.0):
        ddp = wrap_distributed(small_model(), CommConfig(hierarchical=True, bucket_mb=0.25, stall_warn_s=warn_s))
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                x, y = rank_data(rank, step=step)
                loss = nn.functional.mse_loss(ddp(x), y)
                if step == 2 and rank == 3:
                    time.sleep(3.0)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        out[warn_s] = {"warnings": [str(w.message) for w in caught if "aiak.comm" in str(w.message)],
                       "params": [p.detach().clone() for p in ddp.parameters()]}
    return out


def scenario_stall_algorithms(rank):
    """Local SGD, PowerSGD and decentralized SGD (peers all, shift_one) with ``stall_warn_s: 1``: rank 3 reaches
    step 3's forward and backward 3 s late. PowerSGD's and decentralized SGD's collectives run in jobs of the comm
    worker of their own, which the watch did not cover: nobody was told."""
    import aiak

    out = {}
    for name, comm in (("local_sgd", {"algorithm": "local_sgd", "local_sgd": {"period": 2, "warmup_steps": 1}}),
                       ("powersgd", {"algorithm": "powersgd", "powersgd": {"warmup_steps": 2}}),
                       ("decentralized_all", {"algorithm": "decentralized", "decentralized": {"peers": "all"}}),
                       ("decentralized_shift", {"algorithm": "decentralized"})):
        model = small_model()
        ddp, optimizer, _ = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          strategy={"comm": {"stall_warn_s": 1.0, **comm}})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(5):
                if step == 3 and rank == 3:
                    time.sleep(3.0)
                x, y = rank_data(rank, step=step)
                nn.functional.mse_loss(ddp(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
        out[name] = [str(w.message) for w in caught if "has waited" in str(w.message)]
    return out


def scenario_connections(rank):
    """Integer-valued buckets averaged with 1 and with 4 connections per peer (2 nodes x 2 ranks): flat and
    hierarchical, uncompressed, fp16 and bf16 (exact for these integers), and int8; the collectives recorded."""
    from aiak.comm.allreduce.connections import wide_groups
    from aiak.comm.allreduce.hooks import CommState, average
    from aiak.comm.allreduce.topology import build_groups

    topology = detect_topology()
    groups = build_groups(topology)
    wide = wide_groups(topology, None, (4,), flat=True, inter=True)
    again = wide_groups(topology, None, (4,), flat=True, inter=True)  # a second DDP: the same groups, none new
    out = {"same_groups": all(again[key] is group for key, group in wide.items()) and len(again) == len(wide) == 2}
    for h in (False, True):
        for c in ("none", "fp16", "bf16", "int8"):
            for k in (1, 4):
                state = CommState(None, groups, hierarchical=h, compression=c, wide=wide, connections=k,
                                  pipeline_mb=0.1, stall_warn_s=0)
                g = torch.Generator().manual_seed(rank)
                x = torch.randint(-8, 9, (100_003,), generator=g).float() * 4  # /4 by average(): still integers
                with CollectiveRecorder() as rec:
                    average(state, x).wait()
                out[(h, c, k)] = {"result": x, "calls": rec.calls, "describe": state.describe()}
    return out


def scenario_cpu_reduce(rank):
    """Integer-valued buckets averaged with the hierarchical algorithm and with CPU-Reduce (its cross-node stage on
    host copies over a gloo group of its own), 2 nodes x 2 ranks, the collectives and their groups recorded; what
    wrap_distributed says of comm.cpu_reduce on a gloo job; the comm autotuner measuring CPU-Reduce candidates."""
    from aiak.comm.allreduce.autotune import CommTuning, tune_comm
    from aiak.comm.allreduce.hooks import CommState, average
    from aiak.comm.allreduce.topology import build_groups

    topology = detect_topology()
    groups = build_groups(topology)
    host = build_groups(topology, backend="gloo").inter
    out = {"host_is_its_own_group": host is not groups.inter}
    for c in ("none", "fp16", "bf16", "int8"):
        for cpu_reduce in (False, True):
            state = CommState(None, groups, hierarchical=True, compression=c, pipeline_mb=0.1, stall_warn_s=0,
                              host_inter=host, cpu_reduce=cpu_reduce)
            results = []
            with CollectiveRecorder() as rec:
                for step in range(2):   # int8: the second step adds the first one's residuals
                    g = torch.Generator().manual_seed(10 * rank + step)
                    x = torch.randint(-8, 9, (100_003,), generator=g).float() * 4  # /4 by average(): integers
                    average(state, x).wait()
                    results.append(x)
            out[(c, cpu_reduce)] = {"results": results, "calls": rec.calls, "describe": state.describe(),
                                    "on_host_group": [grp is host for grp in rec.groups]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = wrap_distributed(tiny_model(), CommConfig(cpu_reduce=True, bucket_mb=0.001))
    out["gloo_wrap"] = {"describe": ddp.aiak_comm_state.describe(), "warnings": [str(w.message) for w in caught]}
    state = CommState(None, groups, hierarchical=True, host_inter=host, stall_warn_s=0)
    record = CommTuning("comm")
    choice = tune_comm(tiny_model(), state, [0.001], allow_int8=False, repeats=1, cpu_reduce=True, record=record)
    out["tuned"] = {"record": record.to_dict(), "choice": choice.describe()}
    return out


def main(scenarios=None):
    """Run ``scenario_<argv[1]>`` of ``scenarios`` (a module's globals; default this module's) on this rank."""
    scenario, outdir = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        result = (scenarios or globals())[f"scenario_{scenario}"](rank)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
        dist.barrier()  # rank 0 hosts the store: keep it up until every rank is done
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

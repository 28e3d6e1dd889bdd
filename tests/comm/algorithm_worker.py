"""One rank of a ``comm.algorithm`` test (local SGD, decentralized SGD, PowerSGD), launched by conftest.launch.

``python algorithm_worker.py <scenario> <outdir>``: runs the scenario and ``torch.save``s its result to
``<outdir>/rank<r>.pt``; test_algorithms.py makes the assertions. Each scenario trains aiak's algorithm and an
independent reference on the same weights and batches: torch's own hooks and averagers, or a plain
``torch.distributed`` transcription of the arithmetic.
"""
from __future__ import annotations

import io
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def mlp(seed=0, bn=False):
    torch.manual_seed(seed)
    layers = [nn.Linear(12, 32)] + ([nn.BatchNorm1d(32)] if bn else []) + [nn.Tanh(), nn.Linear(32, 24), nn.Tanh(),
                                                                           nn.Linear(24, 5)]
    return nn.Sequential(*layers)


def batch(rank, step, n=8):
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(n, 12, generator=g), torch.randn(n, 5, generator=g)


def weights(model):
    module = model.module if isinstance(model, DDP) else model
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def optimized(model, opt, comm, **strategy):
    import aiak

    return aiak.optimize(model, opt, strategy={"comm": {"bucket_mb": 25, **comm}, **strategy})[:2]


def train(ddp, opt, rank, steps, start=0, accumulation=1, inject=None, record=None):
    """``steps`` real steps of MSE on this rank's batches; ``inject(step, x)`` may spoil an input."""
    for step in range(start, start + steps):
        for micro in range(accumulation):
            x, y = batch(rank, step * accumulation + micro)
            if inject is not None:
                x = inject(step, x)
            nn.functional.mse_loss(ddp(x), y).backward()
            if record is not None and micro == accumulation - 1:
                record.append([p.grad.detach().clone() for p in ddp.parameters()])
            opt.step()
            opt.zero_grad()
    return ddp


def intra_node_group():
    """This rank's node as a group (torchrun's LOCAL_WORLD_SIZE / GROUP_RANK); every rank creates every group."""
    world, local = dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    mine = None
    for node in range(world // local):
        g = dist.new_group(list(range(node * local, node * local + local)))
        if dist.get_rank() // local == node:
            mine = g
    return mine


# -- local SGD ---------------------------------------------------------------------------------------
def torch_local_sgd(rank, steps, warmup, period, bn=False, lr=0.05):
    """torch's post-local SGD: DDP + post_localSGD_hook (subgroup = this node) + PeriodicModelAverager."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    ddp = DDP(mlp(bn=bn), bucket_cap_mb=25)
    ddp.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=intra_node_group(),
                                             start_localSGD_iter=warmup), post_localSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    averager = PeriodicModelAverager(period=period, warmup_steps=warmup)
    buffers = []
    for step in range(steps):
        x, y = batch(rank, step)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        averager.average_parameters(ddp.parameters())  # before zero_grad: it averages the parameters with a .grad
        opt.zero_grad()
        buffers.append({k: v.clone() for k, v in ddp.module.named_buffers() if v.is_floating_point()})
    return weights(ddp), buffers


def aiak_local_sgd(rank, steps, warmup, period, bn=False, lr=0.05, **comm):
    model = mlp(bn=bn)
    ddp, opt = optimized(model, torch.optim.SGD(model.parameters(), lr=lr),
                         {"algorithm": "local_sgd", "local_sgd": {"period": period, "warmup_steps": warmup}, **comm})
    averager = ddp.aiak_comm_algorithm
    seen = []  # (step, every rank's floating buffers just before an average, after it)
    average = averager.average

    def spied():
        before = [b.detach().clone() for b in ddp.module.buffers() if b.is_floating_point()]
        gathered = [[torch.empty_like(b) for _ in range(dist.get_world_size())] for b in before]
        for b, out in zip(before, gathered):
            dist.all_gather(out, b)
        average()
        after = [b.detach().clone() for b in ddp.module.buffers() if b.is_floating_point()]
        seen.append((averager.steps - 1, gathered, after))

    averager.average = spied
    train(ddp, opt, rank, steps)
    return {"weights": weights(ddp), "averages": averager.averages, "seen": seen,
            "describe": ddp.aiak_comm_algorithm.describe(), "broadcast_buffers": ddp.broadcast_buffers}


def scenario_local_sgd(rank):
    out = {}
    # period 1 is allreduce: bit for bit a plain torch DDP
    model = mlp()
    ddp, opt = optimized(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                         {"algorithm": "local_sgd", "local_sgd": {"period": 1, "warmup_steps": 0},
                          "hierarchical": False})
    out["period1"] = weights(train(ddp, opt, rank, 6))
    out["period1_algorithm"] = getattr(ddp, "aiak_comm_algorithm", None)
    plain = DDP(mlp(), bucket_cap_mb=25)
    out["ddp"] = weights(train(plain, torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9), rank, 6))
    plain = DDP(mlp(), bucket_cap_mb=25)
    out["ddp20"] = weights(train(plain, torch.optim.SGD(plain.parameters(), lr=0.05), rank, 20))
    # plain SGD, 20 steps, against torch's post-local SGD
    out["torch"], _ = torch_local_sgd(rank, 20, warmup=3, period=4)
    out["aiak_flat"] = aiak_local_sgd(rank, 20, warmup=3, period=4, hierarchical=False)
    out["aiak_hierarchical"] = aiak_local_sgd(rank, 20, warmup=3, period=4, hierarchical=True)
    out["aiak_fp16"] = aiak_local_sgd(rank, 20, warmup=3, period=4, hierarchical=True, compression="fp16")
    # BatchNorm: aiak averages the running statistics, torch's averager leaves them per rank
    out["torch_bn"], out["torch_bn_buffers"] = torch_local_sgd(rank, 12, warmup=2, period=3, bn=True)
    out["aiak_bn"] = aiak_local_sgd(rank, 12, warmup=2, period=3, bn=True, hierarchical=False)
    return out


def scenario_local_sgd_large_buffers(rank):
    """BatchNorm on raw features of standard deviation 3000: its running variance climbs by ~1e6 between
    averages, past fp16's 65504."""
    out = {}
    for compression in ("fp16", "none"):
        model = mlp(bn=True)
        ddp, opt = optimized(model, torch.optim.SGD(model.parameters(), lr=1e-7),
                             {"algorithm": "local_sgd", "local_sgd": {"period": 3, "warmup_steps": 2},
                              "hierarchical": True, "compression": compression})
        for step in range(12):
            x, y = batch(rank, step)
            nn.functional.mse_loss(ddp(x * 3000.0), y).backward()
            opt.step()
            opt.zero_grad()
        out[compression] = {k: v.detach().clone() for k, v in ddp.module.named_buffers() if v.is_floating_point()}
    return out


def scenario_local_sgd_collectives(rank):
    """4 nodes x 1 rank: past the warm-up a step that does not average sends nothing."""
    from aiak.comm.allreduce import hooks

    calls = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    model = mlp()
    ddp, opt = optimized(model, torch.optim.SGD(model.parameters(), lr=0.05),
                         {"algorithm": "local_sgd", "local_sgd": {"period": 4, "warmup_steps": 2}})
    per_step = []
    dist.all_reduce = counting
    try:
        for step in range(10):
            before = len(calls)
            train(ddp, opt, rank, 1, start=step)
            per_step.append(len(calls) - before)
    finally:
        dist.all_reduce = original
    assert hooks.dist.all_reduce is original
    out = {"per_step": per_step, "numel": sum(p.numel() for p in ddp.parameters())}
    out["torch"], _ = torch_local_sgd(rank, 20, warmup=3, period=4)
    out["aiak"] = aiak_local_sgd(rank, 20, warmup=3, period=4)
    return out


# -- decentralized -----------------------------------------------------------------------------------
def transcribed_decentralized(rank, steps, peers, lr=0.05):
    """The arithmetic of decentralized SGD in plain torch.distributed: average the weights the forward used
    with the peers', then apply the own gradient (no DDP, no gradient allreduce)."""
    model = mlp()
    for p in model.parameters():
        dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    world, half = dist.get_world_size(), dist.get_world_size() // 2
    for step in range(steps):
        sent = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        x, y = batch(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
        if peers == "all":
            dist.all_reduce(sent)
            sent /= world
        else:
            peer = half + (rank + step) % half if rank < half else (rank - half - step) % half
            theirs = torch.empty_like(sent)
            reqs = [dist.isend(sent, peer), dist.irecv(theirs, peer)]
            for r in reqs:
                r.wait()
            sent = (sent + theirs) / 2
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(sent, model.parameters())
        opt.step()
        opt.zero_grad()
    return weights(model)


class Computing(nn.Module):
    """Stands for a forward that takes a while (0.1 s, the GIL released), so the exchange has room to run."""

    def forward(self, x):
        import time

        time.sleep(0.1)
        return x


def scenario_decentralized(rank):
    import time

    out = {}
    for peers in ("shift_one", "all"):
        model = mlp()
        ddp, opt = optimized(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                             {"algorithm": "decentralized", "decentralized": {"peers": peers}})
        out[peers] = {"aiak": weights(train(ddp, opt, rank, 10)), "reference": transcribed_decentralized(rank, 10, peers),
                      "exchanges": ddp.aiak_comm_algorithm.exchanges, "describe": ddp.aiak_comm_algorithm.describe()}
        # overlap: when each exchange began on the comm worker, when each backward finished
        model = nn.Sequential(Computing(), mlp())
        ddp, opt = optimized(model, torch.optim.SGD(model.parameters(), lr=0.05),
                             {"algorithm": "decentralized", "decentralized": {"peers": peers}})
        exchange, started, backward_done = ddp.aiak_comm_algorithm, [], []
        average = exchange._average

        def timed(x, peer):
            started.append(time.perf_counter())
            average(x, peer)

        exchange._average = timed
        model[1][0].weight.register_hook(lambda g: backward_done.append(time.perf_counter()))  # the last gradient
        train(ddp, opt, rank, 3)
        out[peers].update(started=started, backward_done=backward_done)
    return out


# -- PowerSGD ----------------------------------------------------------------------------------------
def torch_powersgd(rank, steps, rank_r, warmup, record, scaler=None, inject=None, calls=None, per_step=None):
    """DDP + torch's powerSGD_hook registered directly (optionally with a GradScaler); ``per_step`` gets the
    entries ``calls`` (:func:`counting_allreduces`) gained at each step."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    ddp = DDP(mlp(), bucket_cap_mb=25)
    ddp.register_comm_hook(ps.PowerSGDState(process_group=None, matrix_approximation_rank=rank_r,
                                            start_powerSGD_iter=warmup, use_error_feedback=True, warm_start=True,
                                            random_seed=0), ps.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(steps):
        x, y = batch(rank, step)
        if inject is not None:
            x = inject(step, x)
        loss = nn.functional.mse_loss(ddp(x), y)
        (scaler.scale(loss) if scaler else loss).backward()
        record.append([p.grad.detach().clone() for p in ddp.parameters()])
        if per_step is not None:
            per_step.append(list(calls))
            del calls[:]
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    return ddp


def counting_allreduces(calls):
    """``dist.all_reduce`` replaced by one that records the size of each call's group into ``calls``; returns
    the original, to put back."""
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(dist.get_world_size(kwargs.get("group")))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    return original


def scenario_powersgd(rank):
    out = {"aiak_grads": {}, "allreduces": {}, "describe": {}}
    # the gradients of torch's hook registered directly, summed hierarchically (2 nodes x 2: auto) and flat;
    # the allreduces of each compressed step (the size of each one's group)
    for topology, comm in (("hierarchical", {}), ("flat", {"hierarchical": False}), ("torch", None)):
        grads, calls, per_step = [], [], []
        original = counting_allreduces(calls)
        try:
            if comm is None:
                torch_powersgd(rank, 8, 2, 2, grads, calls=calls, per_step=per_step)
                out["torch_grads"] = grads
            else:
                model = mlp()
                ddp, opt = optimized(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                     {"algorithm": "powersgd", "powersgd": {"rank": 2, "warmup_steps": 2}, **comm})
                del calls[:]
                residuals = []  # the residual tensor (object) after each step
                for step in range(8):
                    train(ddp, opt, rank, 1, start=step, record=grads)
                    per_step.append(list(calls))
                    del calls[:]
                    residuals.append(ddp.aiak_comm_algorithm.torch_state.error_dict.get(0))
                out["aiak_grads"][topology] = grads
                out.setdefault("residual_reused", {})[topology] = \
                    [residuals[t + 2] is residuals[t] for t in range(2, 6)]
                out["describe"][topology] = ddp.aiak_comm_algorithm.describe()
        finally:
            dist.all_reduce = original
        out["allreduces"][topology] = per_step

    # one inf input on rank 1 at step 4, under fp16 loss scaling
    def inject(step, x):
        if step == 4 and rank == 1:
            x = x.clone()
            x[0, 0] = float("inf")
        return x

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on this CPU is emulated, and says so
        model = mlp()
        ddp, opt = optimized(model, torch.optim.SGD(model.parameters(), lr=0.05),
                             {"algorithm": "powersgd", "powersgd": {"rank": 2, "warmup_steps": 2}},
                             precision={"level": "O1", "dtype": "fp16"})
        import aiak

        stepped, grads = [], []
        for step in range(10):
            train(ddp, opt, rank, 1, start=step, inject=inject, record=grads)
            stepped.append(aiak.stepped(opt))
        out["guarded"] = {"stepped": stepped, "grads": grads, "weights": weights(ddp),
                          "skipped": ddp.aiak_comm_algorithm.skipped,
                          "residuals": ddp.aiak_comm_algorithm.residuals()}
        raw = []
        torch_powersgd(rank, 10, 2, 2, raw, scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 8), inject=inject)
        out["raw_grads"] = raw

    # many buckets at once: one bucket's three allreduces at a time, the same order on every rank
    torch.manual_seed(0)
    wide = nn.Sequential(*[nn.Linear(12 if i == 0 else 256, 256) for i in range(6)], nn.Linear(256, 5))
    wide_opt = torch.optim.SGD(wide.parameters(), lr=0.01)
    import aiak

    wide, wide_opt = aiak.optimize(wide, wide_opt, strategy={"comm": {
        "algorithm": "powersgd", "powersgd": {"rank": 4, "warmup_steps": 2, "bucket_mb": 0.3}}})[:2]
    out["buckets"] = []
    train(wide, wide_opt, rank, 6, record=out["buckets"])
    out["bucket_count"] = {"0.3": len(wide.aiak_comm_algorithm.buckets.layouts)}
    # bucket_mb auto: every gradient in one bucket (beside DDP's small first one), whatever comm.bucket_mb says
    torch.manual_seed(0)
    wide = nn.Sequential(*[nn.Linear(12 if i == 0 else 256, 256) for i in range(6)], nn.Linear(256, 5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wide, wide_opt = aiak.optimize(wide, torch.optim.SGD(wide.parameters(), lr=0.01), strategy={"comm": {
            "bucket_mb": 0.3, "algorithm": "powersgd", "powersgd": {"rank": 4, "warmup_steps": 2}}})[:2]
    out["bucket_warnings"] = [str(w.message) for w in caught]
    train(wide, wide_opt, rank, 4)
    out["bucket_count"]["auto"] = len(wide.aiak_comm_algorithm.buckets.layouts)

    # a checkpoint taken after 4 steps and loaded into fresh objects continues bit for bit
    out["checkpoint"] = resumed(rank, {"algorithm": "powersgd", "powersgd": {"rank": 2, "warmup_steps": 2}},
                                total=8, cut=4)
    return out


# -- resume, each algorithm under O2 and accumulation -------------------------------------------------
def resumed(rank, comm, total, cut, **strategy):
    """Straight through ``total`` real steps, against ``cut`` steps + a checkpoint loaded into a fresh model,
    optimizer and aiak.optimize + the rest; and the same with the comm algorithm's state left out of the
    checkpoint (what a resume without it would give)."""
    accumulation = strategy.get("grad_accumulation", 1)

    def fresh():
        model = mlp(bn=True)
        return optimized(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), comm, **strategy)

    ddp, opt = fresh()
    straight = weights(train(ddp, opt, rank, total, accumulation=accumulation))
    ddp, opt = fresh()
    train(ddp, opt, rank, cut, accumulation=accumulation)
    blob = io.BytesIO()
    torch.save({"model": ddp.state_dict(), "optimizer": opt.state_dict()}, blob)
    out = {"straight": straight}
    for name in ("resumed", "without_algorithm_state"):
        ddp, opt = fresh()
        saved = torch.load(io.BytesIO(blob.getvalue()))  # as torch.load does by default: weights only
        if name == "without_algorithm_state":
            saved["optimizer"]["aiak"].pop("comm_algorithm")
        else:
            out["extras"] = saved["optimizer"]["aiak"]
        ddp.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        out[name] = weights(train(ddp, opt, rank, total - cut, start=cut, accumulation=accumulation))
    return out


def scenario_resume(rank):
    strategy = {"precision": {"level": "O2", "dtype": "bf16"}, "grad_accumulation": 2}
    comms = {"local_sgd": {"algorithm": "local_sgd", "local_sgd": {"period": 2, "warmup_steps": 1}},
             "decentralized": {"algorithm": "decentralized"},
             "powersgd": {"algorithm": "powersgd", "powersgd": {"rank": 2, "warmup_steps": 2}}}
    return {name: resumed(rank, comm, total=7, cut=3, **strategy) for name, comm in comms.items()}



# -- resume in fresh processes --------------------------------------------------------------------------
class TwoDtypes(nn.Module):
    """The BatchNorm MLP with a float64 head: DDP buckets each dtype apart (two initial buckets)."""

    def __init__(self):
        super().__init__()
        self.body, self.head = mlp(bn=True)[:-1], nn.Linear(24, 5).double()

    def forward(self, x):
        return self.head(self.body(x).double()).float()


FRESH_RESUMES = {  # name: (comm, strategy, momentum)
    "int8": ({"compression": "int8", "hierarchical": False}, {"grad_accumulation": 2}, 0.0),
    "int8_momentum": ({"compression": "int8", "hierarchical": False}, {"grad_accumulation": 2}, 0.9),
    "int8_buckets": ({"compression": "int8", "hierarchical": False, "bucket_mb": 0.002}, {"grad_accumulation": 2}, 0.9),
    "int8_hierarchical": ({"compression": "int8", "hierarchical": True, "pipeline_mb": 0.001},
                          {"grad_accumulation": 2}, 0.9),
    "int8_o2": ({"compression": "int8", "hierarchical": False},
                {"precision": {"level": "O2", "dtype": "bf16"}, "grad_accumulation": 2}, 0.9),
    "int8_two_dtypes": ({"compression": "int8", "hierarchical": False, "bucket_mb": 0.002}, {"grad_accumulation": 2},
                        0.9),
    "powersgd": ({"algorithm": "powersgd", "powersgd": {"rank": 2, "warmup_steps": 2}}, {"grad_accumulation": 2}, 0.9),
}


def scenario_resume_fresh(rank):
    """Phase ``save`` (``AIAK_TEST_PHASE``): 6 real steps straight, and 3 steps then this rank's checkpoint written to
    ``AIAK_TEST_DIR``; phase ``load``, in new processes: the checkpoint loaded as ``torch.load`` does by default
    (weights only) into fresh objects, 3 more steps; the same without the comm hook's state, and with the checkpoint
    of the next rank (its residuals are another rank's)."""
    phase, folder = os.environ["AIAK_TEST_PHASE"], os.environ["AIAK_TEST_DIR"]
    out = {}
    for name, (comm, strategy, momentum) in FRESH_RESUMES.items():
        def fresh():
            model = TwoDtypes() if name == "int8_two_dtypes" else mlp(bn=True)
            return optimized(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum), comm,
                             **strategy)

        accumulation = strategy["grad_accumulation"]
        if phase == "save":
            ddp, opt = fresh()
            out[name] = {"straight": weights(train(ddp, opt, rank, 6, accumulation=accumulation))}
            ddp, opt = fresh()
            train(ddp, opt, rank, 3, accumulation=accumulation)
            torch.save({"model": ddp.state_dict(), "optimizer": opt.state_dict()},
                       os.path.join(folder, f"{name}-rank{rank}.pt"))
            continue
        out[name] = {}
        for how in ("resumed", "without_comm_state", "next_ranks_checkpoint"):
            ddp, opt = fresh()
            source = (rank + 1) % dist.get_world_size() if how == "next_ranks_checkpoint" else rank
            saved = torch.load(os.path.join(folder, f"{name}-rank{source}.pt"))
            extras = saved["optimizer"]["aiak"]
            if how == "without_comm_state":
                extras.pop("comm_algorithm" if name == "powersgd" else "comm_state", None)
            if how == "resumed":
                out[name]["extras"] = extras
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ddp.load_state_dict(saved["model"])
                opt.load_state_dict(saved["optimizer"])
            out[name][how] = weights(train(ddp, opt, rank, 3, start=3, accumulation=accumulation))
            out[name][how + "_warnings"] = [str(w.message) for w in caught]
    if phase == "load":  # the flat int8 checkpoint loaded by a hierarchical int8 run: residuals of another algorithm
        model = mlp(bn=True)
        ddp, opt = optimized(model, torch.optim.SGD(model.parameters(), lr=0.05), {"compression": "int8",
                             "hierarchical": True}, grad_accumulation=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.load_state_dict(torch.load(os.path.join(folder, f"int8-rank{rank}.pt"))["optimizer"])
        out["other_algorithm"] = {"warnings": [str(w.message) for w in caught],
                                  "residuals": len(ddp.aiak_comm_state.feedback)}
    return out


class WithUnused(nn.Module):
    """An MLP and a head its forward never uses (kept for later, as scripts do)."""

    def __init__(self):
        super().__init__()
        self.net, self.spare = mlp(), nn.Linear(5, 5)

    def forward(self, x):
        return self.net(x)


def scenario_unused_parameters(rank):
    """A parameter unused in forward, under every algorithm, with comm.find_unused_parameters: true."""
    out = {}
    for algorithm, extra in (("allreduce", {}), ("local_sgd", {"local_sgd": {"period": 2, "warmup_steps": 2}}),
                             ("decentralized", {"decentralized": {"peers": "all"}}),
                             ("powersgd", {"powersgd": {"warmup_steps": 2}})):
        model = WithUnused()
        try:
            ddp, opt = optimized(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                 {"algorithm": algorithm, "find_unused_parameters": True, **extra})
            train(ddp, opt, rank, 5)
            out[algorithm] = {"weights": weights(ddp), "find_unused": ddp.find_unused_parameters}
        except Exception as e:  # noqa: BLE001 - the test reports it
            out[algorithm] = {"error": f"{type(e).__name__}: {e}"}
    plain = DDP(WithUnused(), bucket_cap_mb=25, find_unused_parameters=True)
    out["plain"] = weights(train(plain, torch.optim.SGD(plain.parameters(), lr=0.05), rank, 5))
    model = WithUnused()   # a script's own DDP line after the aiak line, asking for the same: accepted
    ddp, _ = optimized(model, torch.optim.SGD(model.parameters(), lr=0.05),
                       {"algorithm": "local_sgd", "find_unused_parameters": True})
    out["script_line_returns_aiaks"] = DDP(ddp, find_unused_parameters=True) is ddp
    return out


def scenario_join(rank):
    """Uneven inputs under DDP's Join: rank 3 has 2 batches, the others 5."""
    from torch.distributed.algorithms.join import Join

    import aiak

    out = {}
    for algorithm, extra in (("allreduce", {}), ("powersgd", {"powersgd": {"warmup_steps": 2}}),
                             ("local_sgd", {"local_sgd": {"period": 2, "warmup_steps": 1}}),
                             ("decentralized", {"decentralized": {"peers": "all"}})):
        for how in ("ddp.join", "Join"):
            model = mlp()
            ddp, opt = optimized(model, torch.optim.SGD(model.parameters(), lr=0.05), {"algorithm": algorithm, **extra})
            try:
                with (ddp.join() if how == "ddp.join" else Join([ddp])):
                    train(ddp, opt, rank, 2 if rank == 3 else 5)
                out[(algorithm, how)] = "ran"
            except RuntimeError as e:
                out[(algorithm, how)] = str(e)
    for how in ("ddp.join", "Join"):  # counted items: their sum at each step is a collective Join does not shadow
        model = mlp()
        ddp, opt, _ = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.05), count_items=True,
                                    strategy={"comm": {"bucket_mb": 25}, "grad_accumulation": 2})
        try:
            with (ddp.join() if how == "ddp.join" else Join([ddp])):
                train(ddp, opt, rank, 2 if rank == 3 else 5, accumulation=2)
            out[("counted", how)] = "ran"
        except RuntimeError as e:
            out[("counted", how)] = str(e)
    return out


def scenario_refusals(rank):
    """3 ranks on one node: what cannot run here is refused, all or nothing; what makes no difference says so."""
    import aiak

    out = {}

    def attempt(name, comm, with_optimizer=True, model=None):
        model = model if model is not None else mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05) if with_optimizer else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                wrapped = aiak.optimize(model, opt, strategy={"comm": comm})[0]
                out[name] = {"type": type(wrapped).__name__, "describe": aiak.last_decision().effect("comm")}
            except Exception as e:  # noqa: BLE001 - the message is what the test reads
                out[name] = {"error": f"{type(e).__name__}: {e}", "model_type": type(model).__name__,
                             "patched": hasattr(opt, "_aiak_steps") if opt is not None else None}
        out[name]["warnings"] = [str(w.message) for w in caught]

    attempt("local_sgd_one_node", {"algorithm": "local_sgd"})
    attempt("shift_one_odd", {"algorithm": "decentralized"})
    attempt("all_odd", {"algorithm": "decentralized", "decentralized": {"peers": "all"}})
    attempt("no_optimizer", {"algorithm": "powersgd"}, with_optimizer=False)
    attempt("int8_no_optimizer", {"compression": "int8"}, with_optimizer=False)
    attempt("prewrapped", {"algorithm": "powersgd"}, model=DDP(mlp()))
    model = mlp()  # a second optimizer for a model that synchronises at the first one's steps
    ddp = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.05),
                        strategy={"comm": {"algorithm": "decentralized", "decentralized": {"peers": "all"}}})[0]
    try:
        aiak.optimize(ddp, torch.optim.SGD(model.parameters(), lr=0.05),
                      strategy={"comm": {"algorithm": "decentralized", "decentralized": {"peers": "all"}}})
        out["second_optimizer"] = "accepted"
    except ValueError as e:
        out["second_optimizer"] = str(e)
    return out


if __name__ == "__main__":
    import dist_worker  # beside this file: the launcher's one rank runner

    dist_worker.main(globals())

"""Hierarchical allreduce, gradient compression and several connections per peer over a link between simulated
nodes, under a named link condition.

Network namespaces play the nodes, joined through a router namespace under one of :mod:`netlab`'s profiles
(``rate``: 500 Mbit/s; ``latency``: 100 Mbit/s and a 20 ms round trip; ``lossy``: the same and 0.1% loss;
``per-flow``: 25 Mbit/s per TCP connection under 400 Mbit/s), calibrated first and printed above the tables;
``--nodes 2x2`` runs two gloo ranks in each of two namespaces (intra-node traffic stays on the namespace's
loopback, only inter-node traffic crosses the link), ``--nodes 4x1`` one rank in each of four (the reference setting: hierarchical allreduce made Swin
training 85% faster on 4 nodes x 8 GPUs over 25 Gb/s TCP; ByteGrad cuts traffic 4x).

Measured in one run, against flat allreduce (what DDP does by default):
  * allreduce of 16-64 MB: flat, hierarchical, hierarchical+fp16, hierarchical+int8 (+ flat+fp16/int8), and
    flat and hierarchical with 4 TCP connections per peer (``comm.connections: 4``) against 1;
  * one DDP training step of a ~25M-parameter MLP with each algorithm (``aiak.comm.wrap_distributed``);
  * scaling linearity = throughput on 4 ranks / (4 x throughput of one rank alone).
Goals (profile ``rate``, 2x2): hierarchical >= 1.4x flat (theory 1.5x with 2 local ranks), +fp16 >= 2.5x,
+int8 >= 4x. Profile ``per-flow``: 4 connections >= 2.5x one on the allreduce, >= 2x on the DDP step; profile
``rate``: 4 connections within noise of one.
After one warm-up round of every algorithm, the algorithms take turns round by round (drift hits them alike);
tables give the median and min-max of the slowest rank's time, and of the per-round ratio to flat.

``gpu_checks()`` (for benchmarks/gpu_check.py) checks the CUDA paths on one GPU instead; see its docstring.

Needs root (creates namespaces ``aiak<pid>n<i>`` and ``aiak<pid>r``, deleted afterwards, also on failure or
Ctrl-C). Traffic only goes to loopback and to the addresses of those namespaces (10.231.<i>.1/2).

    sudo python benchmarks/comm_netns.py --quick
    sudo python benchmarks/comm_netns.py --profile per-flow --nodes 2x2 --sizes-mb 16 --repeats 5
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from netlab import PROFILES, Lab, calibrate, describe_calibration, stop  # noqa: E402  (the rig, next to this)
ALGORITHMS = [("flat", False, "none", 1), ("hierarchical", True, "none", 1), ("hierarchical+fp16", True, "fp16", 1),
              ("hierarchical+int8", True, "int8", 1), ("flat+fp16", False, "fp16", 1), ("flat+int8", False, "int8", 1),
              ("hierarchical+fp16 intra too", True, "fp16", 1),  # compress_intra=True
              ("flat, 4 connections", False, "none", 4), ("hierarchical, 4 connections", True, "none", 4)]
STEP_ALGORITHMS = ("flat", "hierarchical", "hierarchical+fp16", "hierarchical+int8", "flat, 4 connections",
                   "hierarchical, 4 connections")
GOALS = {"hierarchical": 1.4, "hierarchical+fp16": 2.5, "hierarchical+int8": 4.0}   # profile rate, 2x2
CONNECTION_GOALS = {"per-flow": (2.5, 2.0)}      # 4 connections / 1: allreduce, DDP step
PROTOTYPE_16MB = {"flat": 0.39, "hierarchical": 0.33, "hierarchical+fp16": 0.19}


def launch(lab: Lab, local_size: int, args, out: Path) -> None:
    port = 29500 + os.getpid() % 1000
    procs = []
    world = lab.n * local_size
    for rank in range(world):
        node, local = divmod(rank, local_size)
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
               "LOCAL_WORLD_SIZE": str(local_size), "GROUP_RANK": str(node), "NODE_RANK": str(node),
               "MASTER_ADDR": lab.addr[0], "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": lab.dev[node],
               "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        cmd = ["ip", "netns", "exec", lab.ns[node], sys.executable, __file__, "--worker", str(out),
               "--sizes-mb", *map(str, args.sizes_mb), "--repeats", str(args.repeats),
               "--step-params-m", str(args.step_params_m), "--step-repeats", str(args.step_repeats),
               "--pipeline-mb", str(args.pipeline_mb)] + (["--skip-step"] if args.skip_step else [])
        procs.append(subprocess.Popen(cmd, env=env))
    deadline = time.monotonic() + args.timeout
    try:
        for p in procs:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            if rc != 0:
                raise RuntimeError(f"a rank exited with {rc}")
    finally:
        stop(procs)


# -- the ranks ----------------------------------------------------------------------------------
def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from aiak.comm import CommState, average, build_groups, detect_topology, wrap_distributed
    from aiak.comm.allreduce.connections import wide_groups
    from aiak.strategy.schema import CommConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    topology = detect_topology()
    groups = build_groups(topology) if topology.hierarchical_useful else None
    wide = wide_groups(topology, None, (4,), flat=True, inter=groups is not None)
    algorithms = [a for a in ALGORITHMS if groups is not None or not a[1]]
    result = {"allreduce": {}, "step": {}}

    def slowest(seconds):  # a collective is as slow as its slowest rank
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    for mb in args.sizes_mb:  # round 0 warms every algorithm up; then the algorithms take turns, round by round
        x = torch.randn(int(mb * 2**20) // 4)
        states = {name: CommState(None, groups, hierarchical=hier, compression=comp, pipeline_mb=args.pipeline_mb,
                                  compress_intra=name.endswith("intra too"), wide=wide, connections=k)
                  for name, hier, comp, k in algorithms}
        samples = {name: [] for name in states}
        for round_ in range(args.repeats + 1):
            for name, state in states.items():
                buf = x.clone()
                dist.barrier()
                start = time.perf_counter()
                if name == "flat":
                    dist.all_reduce(buf)  # DDP's default path
                else:
                    average(state, buf).wait()
                seconds = slowest(time.perf_counter() - start)
                if round_:
                    samples[name].append(seconds)
        result["allreduce"][str(mb)] = samples

    if args.skip_step:
        if rank == 0:
            Path(args.worker).write_text(json.dumps(result))
        dist.barrier()
        return dist.destroy_process_group()
    width = int((args.step_params_m * 1e6 / 3) ** 0.5)  # three width x width layers

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                             nn.Linear(width, width))

    batch = torch.randn(8, width)

    def time_step(net, opt):
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        net(batch).square().mean().backward()
        opt.step()
        return slowest(time.perf_counter() - start)

    params = sum(p.numel() for p in model().parameters())
    alone = None
    if rank == 0:  # one rank alone, no DDP, while the others wait
        net, opt = model(), None
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        times = []
        for i in range(args.step_repeats + 1):
            start = time.perf_counter()
            opt.zero_grad()
            net(batch).square().mean().backward()
            opt.step()
            if i:
                times.append(time.perf_counter() - start)
        alone = statistics.median(times)
    dist.barrier()
    nets = {name: wrap_distributed(model(), CommConfig(hierarchical=hier, compression=comp, bucket_mb=25,
                                                       connections=k), pipeline_mb=args.pipeline_mb)
            for name, hier, comp, k in algorithms if name in STEP_ALGORITHMS}
    opts = {name: torch.optim.SGD(net.parameters(), lr=1e-3) for name, net in nets.items()}
    result["step"] = {name: [] for name in nets}
    for round_ in range(args.step_repeats + 1):  # round 0 warms up; then the algorithms take turns
        for name, net in nets.items():
            seconds = time_step(net, opts[name])
            if round_:
                result["step"][name].append(seconds)
    # the comm autotuner with comm.connections: auto, fresh cache: what it picks on this link
    cache = Path(args.worker).with_name("tune.json")
    tuned = wrap_distributed(model(), CommConfig(autotune=True, bucket_mb=25, tune_steps=2, tune_cache=str(cache)),
                             pipeline_mb=args.pipeline_mb)
    result["autotune"] = tuned.aiak_comm_state.describe()
    if rank == 0:
        result.update(alone=alone, params=params, batch=batch.shape[0], world=dist.get_world_size())
        Path(args.worker).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# -- CUDA checks (called by benchmarks/gpu_check.py; touch CUDA only when called) -----------------------
# One GPU: a one-rank NCCL world. The multi-rank algorithms are checked by the gloo tests (tests/comm); what
# only CUDA shows is checked here: NCCL groups for the tuner, the hook's streams, and the codec's speed.
def _row(check: str, ok, metric: str, value) -> dict:
    return {"check": check, "ok": bool(ok), "metric": metric, "value": value}


def _guarded(name: str, rows_of, *args) -> list:
    """``rows_of(*args)``, or one failed row naming the exception: a broken check must not hide the others."""
    try:
        return rows_of(*args)
    except Exception as e:  # noqa: BLE001
        return [_row(f"comm: {name}", False, "crashed", f"{type(e).__name__}: {e}"[:300])]


def _int8_step(x, block: int = 2048):
    """Per value: one quantization step of its block, range / 255 (the error bound of the two int8 stages)."""
    rows = x.view(-1, block)
    return ((rows.amax(1) - rows.amin(1)) / 255).repeat_interleave(block)


def _bound(x, compression: str):
    """What ``average`` on one rank may change ``x`` by: a step per int8 block (two half-step roundings: the
    local and the shard quantization), or fp16 rounding."""
    from aiak.comm.allreduce.compression import pad_to_multiple

    if compression == "int8":
        padded, n = pad_to_multiple(x, 2048)
        return (_int8_step(padded) * 1.01 + 1e-6)[:n]
    return x.abs() * 2.0 ** -11 + 2.0 ** -24


def _gpu_sleep_cycles(seconds: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that keep the GPU busy about ``seconds`` (measured, synchronised)."""
    import torch

    probe = 10_000_000
    torch.cuda._sleep(probe)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(probe)
    torch.cuda.synchronize()
    return int(probe * seconds / (time.perf_counter() - start))


def _codec_rows(device) -> list:
    import torch

    from aiak.comm.allreduce.compression import dequantize_int8, quantize_int8

    x = torch.randn(4 * 2**20, device=device)  # 16 MB
    y = dequantize_int8(quantize_int8(x, 2048), x.numel(), 2048)
    excess = float(((y - x).abs() / (_int8_step(x) / 2 * 1.001 + 1e-6)).max())
    times = []
    for i in range(23):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dequantize_int8(quantize_int8(x, 2048), x.numel(), 2048)
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1e3
    return [_row("comm: int8 codec on cuda, error", excess <= 1, "max error / half a step (goal <= 1)",
                 round(excess, 3)),
            _row("comm: int8 codec on cuda, speed", ms <= 0.5,
                 "ms per 16 MB quantize+dequantize, median of 20 (goal <= 0.5 ms: 32 GB/s, 10x a 25 Gb/s link)",
                 f"{ms:.3f} (p10-p90 {statistics.quantiles(times, n=10)[0] * 1e3:.3f}-"
                 f"{statistics.quantiles(times, n=10)[-1] * 1e3:.3f})")]


def _pipeline_rows(device, groups, host_inter) -> list:
    """``average`` on a CUDA bucket whose producer stream is busy: the worker's comm stream must wait for the
    producer (else it reads the stale 7.0s) and the consumer for the comm stream (else it clones stale data).
    CPU-Reduce (``host_inter``: a gloo group) also copies each shard to pinned host memory and back: gloo must
    read the copy only once it is complete (else it sums uninitialized pinned memory), the allgather only after
    the copy back."""
    import torch

    from aiak.comm import CommState, average

    rows = []
    n = 4 * 2**20 + 12345  # 16 MB and some: the int8 and hierarchical paths pad
    source = torch.randn(n, device=device)
    busy = _gpu_sleep_cycles(0.05)
    for hierarchical, cpu_reduce in ((False, False), (True, False), (True, True)):
        for compression in ("int8", "fp16") + (("none",) if cpu_reduce else ()):
            state = CommState(groups=groups, hierarchical=hierarchical, compression=compression, pipeline_mb=1.0,
                              host_inter=host_inter, cpu_reduce=cpu_reduce)
            bucket = torch.full((n,), 7.0, device=device)
            producer = torch.cuda.Stream(device=device)
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.cuda.stream(producer):
                torch.cuda._sleep(busy)  # 50 ms of GPU work ahead of the write
                bucket.copy_(source)
                fut = average(state, bucket)  # the hook's event goes on the producer stream
            result = fut.wait().clone()  # default stream: ordered after the comm stream by the future
            host_ms = (time.perf_counter() - start) * 1e3
            torch.cuda.synchronize()
            excess = float(((result - source).abs() / _bound(source, compression)).max())
            algo = state.describe()
            rows.append(_row(f"comm: {algo} hook on cuda/nccl, bucket written behind 50 ms of GPU work",
                             excess <= 1, "max error / codec bound (goal <= 1; stale data reads >> 1)",
                             f"{excess:.3f} (host {host_ms:.1f} ms)"))
    # int8 NaN recovery on CUDA (the deferred finiteness flag): later buckets as if the NaN one never came
    hit, twin = CommState(compression="int8"), CommState(compression="int8")
    grads = [torch.randn(n, device=device) for _ in range(4)]
    bad = grads[1].clone()
    bad[3] = float("nan")
    same, nan_seen = True, False
    for step, g in enumerate(grads):
        if step == 1:
            nan_seen = not bool(torch.isfinite(average(hit, bad).wait()).all())
        same &= torch.equal(average(hit, g.clone()).wait(), average(twin, g.clone()).wait())
    finite = all(bool(torch.isfinite(r).all()) for r in hit.feedback.residuals().values())
    rows.append(_row("comm: int8 on cuda after a NaN bucket", nan_seen and same and finite,
                     "goal: NaN bucket non-finite, later buckets bit-equal to a twin's, residuals finite",
                     f"nan seen {nan_seen}, equal {same}, residuals finite {finite}"))
    return rows


def _socket_rows(device) -> list:
    """NCCL's socket-count candidates timed in fresh child processes (aiak.comm.allreduce.nccl_sockets), here on one GPU:
    each child joins its own one-rank NCCL group on this device, checks a sum, sees its variables and times the
    buckets. (One node has no sockets to tune: this checks the children, not a speed-up.)"""
    from aiak.comm.allreduce.env_trials import time_env_candidates
    from aiak.comm.allreduce.nccl_sockets import CANDIDATES, label

    saved = os.environ.get("MASTER_ADDR")
    os.environ["MASTER_ADDR"] = "127.0.0.1"   # where the children reach this process's store
    try:
        start = time.perf_counter()
        trials = time_env_candidates(CANDIDATES, [2**20, 4 * 2**20], backend="nccl", device_index=device.index,
                                     rounds=2, timeout_s=120)
        seconds = time.perf_counter() - start
    finally:
        if saved is None:
            os.environ.pop("MASTER_ADDR")
        else:
            os.environ["MASTER_ADDR"] = saved
    rows = []
    for t in trials:
        seen = all(t.env_seen.get(k) == v for k, v in t.env.items())
        rows.append(_row(f"comm: NCCL sockets candidate {label(t.env)} in child processes",
                         not t.error and len(t.seconds) == 2 and seen,
                         "goal: measured twice, variables seen, no error",
                         t.error[:200] or f"{t.median * 1e3:.2f} ms (of {seconds:.1f} s for all)"))
    return rows


def _autotune_rows(device) -> list:
    """The tuner's collectives on an NCCL group (no CPU backend): device choice, decide, cache, both modes."""
    import tempfile

    import torch
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from aiak.comm import CommChoice, CommState, StepTuner, cache_key, comm_hook, read_choice, tune_comm
    from aiak.comm.allreduce.autotune import algorithm_candidates, decide
    from aiak.util.cache import TuneCache
    from aiak.util.dist import rank0_object
    from aiak.measure.clock import StepClock
    from aiak.util.dist import group_device
    from aiak.comm.allreduce.compression import COMPRESSIONS

    rows = []
    where = group_device()
    rows.append(_row("comm.autotune: tuner device on an NCCL group", where == device, f"device (goal {device})",
                     str(where)))
    picked = decide([3.0, 1.0, 2.0])
    rows.append(_row("comm.autotune: decide() on NCCL", picked == 1, "fastest of [3, 1, 2] (goal index 1)", picked))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1000)).to(device)
    with tempfile.TemporaryDirectory() as tmp:
        cache = TuneCache(Path(tmp) / "tune.json")
        key = cache_key(model, 1, 1, "cuda", "comm")
        miss = rank0_object(lambda: read_choice(cache, key))
        choice = tune_comm(model, CommState(), [1.0, 5.0], allow_int8=True, repeats=2, device=device)
        cache.put_entry(key, choice.entry(perf_mode="comm"))
        hit = rank0_object(lambda: read_choice(cache, key))
    valid = isinstance(choice, CommChoice) and not choice.hierarchical and choice.compression in COMPRESSIONS \
        and choice.bucket_mb in (1.0, 5.0)
    rows.append(_row("comm.autotune: comm mode + cache on NCCL", valid and miss is None and hit == choice,
                     "goal: a valid decision, a cache miss before and a hit after", choice.describe()))

    state = CommState()
    tuner = state.tuner = StepTuner(algorithm_candidates(False, True), steps=2, bucket_mb=1.0)
    ddp = DDP(model, device_ids=[device.index], bucket_cap_mb=1)
    ddp.register_comm_hook(state, comm_hook)
    batch = torch.randn(64, 1024, device=device)
    for _ in range(30):
        if state.tuner is None:
            break
        ddp(batch).square().mean().backward()
    decided = state.tuner is None and tuner.choice is not None
    rows.append(_row("comm.autotune: step mode on NCCL (StepTuner in the DDP hook)",
                     decided and all(len(s) == 2 and min(s) > 0 for s in tuner.samples),
                     "goal: decided, 2 positive samples per candidate",
                     tuner.choice.describe() if decided else "not decided after 30 steps"))

    clock, busy = StepClock(device), _gpu_sleep_cycles(0.05)
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(busy)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    start = time.perf_counter()
    a = clock.mark()
    torch.cuda._sleep(busy)
    b = clock.mark()
    host = time.perf_counter() - start
    measured = clock.seconds(a, b)
    rows.append(_row("comm.autotune: StepClock on cuda times the stream, not the launch",
                     0.8 <= measured / wall <= 1.25 and host < 0.2 * wall,
                     "stream s / synchronised s (goal 0.8-1.25, host < 20%)",
                     f"{measured / wall:.3f} (stream {measured * 1e3:.1f} ms, host {host * 1e3:.2f} ms)"))
    return rows


def _ddp_rows(device) -> list:
    """DDP + aiak hook (one NCCL rank) against plain gradients, per compression."""
    import torch
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from aiak.comm import CommState, comm_hook

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1000)).to(device)

    plain = model()
    batch = torch.randn(64, 1024, device=device)
    plain(batch).square().mean().backward()
    expected = [p.grad.clone() for p in plain.parameters()]
    rows = []
    for compression, bound in {"none": 1e-6, "fp16": 2e-3, "bf16": 1.6e-2, "int8": 0.1}.items():
        ddp = DDP(model(), device_ids=[device.index], bucket_cap_mb=1)
        ddp.register_comm_hook(CommState(compression=compression), comm_hook)
        times = []
        for _ in range(4):
            ddp.zero_grad()
            torch.cuda.synchronize()
            start = time.perf_counter()
            ddp(batch).square().mean().backward()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        err = max(float((p.grad - e).abs().max() / e.abs().max()) for p, e in zip(ddp.parameters(), expected))
        rows.append(_row(f"comm: DDP + aiak hook ({compression}) on cuda/nccl, gradients", err <= bound,
                         f"max rel err vs plain (goal <= {bound:g}) | ms/step",
                         f"{err:.2e} | {statistics.median(times[1:]) * 1e3:.2f}"))
    return rows


def _algorithm_rows(device) -> list:
    """comm.algorithm's CUDA paths on one NCCL rank: decentralized SGD's exchange (issued from the forward on the
    comm worker's stream; with one rank the average is the weights themselves, so training equals plain SGD bit for
    bit only if the copy-back waited for the exchange), and PowerSGD against torch's hook registered directly."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    from torch.nn.parallel import DistributedDataParallel as DDP

    from aiak.comm import CommState, comm_hook
    from aiak.comm.algorithms.decentralized import Decentralized
    from aiak.comm.algorithms.powersgd import PowerSGD, powersgd_hook

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1000)).to(device)

    batches = [torch.randn(64, 1024, device=device) for _ in range(4)]
    ids = [device.index] if device.type == "cuda" else None  # (cpu: to try the rows without a GPU)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def train(net, after_backward=None, record=None):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        times = []
        for batch in batches:
            sync()
            start = time.perf_counter()
            net(batch).square().mean().backward()
            if record is not None:
                record.append([p.grad.clone() for p in net.parameters()])
            if after_backward is not None:
                after_backward()
            opt.step()
            opt.zero_grad()
            sync()
            times.append(time.perf_counter() - start)
        return [p.detach().clone() for p in net.parameters()], statistics.median(times[1:]) * 1e3

    expected, _ = train(model())
    ddp = DDP(model(), device_ids=ids)
    state = CommState()
    ddp.register_comm_hook(state, comm_hook)
    exchange = Decentralized(ddp, state, "all", dist.new_group([0]))
    got, ms = train(ddp, exchange.at_real_step)
    same = all(torch.equal(a, b) for a, b in zip(got, expected))
    rows = [_row("comm: decentralized SGD (peers all) on cuda/nccl, one rank", same,
                 "weights equal plain SGD's bit for bit | ms/step", f"{same} | {ms:.2f}")]
    theirs, mine = [], []
    # one bucket each: torch's hook with two buckets in flight can wait forever (each bucket's callback waits on
    # its next allreduce, from the threads that would run the other's; seen here, on one gloo rank)
    ddp = DDP(model(), device_ids=ids, bucket_cap_mb=64)
    ddp.register_comm_hook(ps.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                                            random_seed=0), ps.powerSGD_hook)
    train(ddp, record=theirs)
    ddp = DDP(model(), device_ids=ids, bucket_cap_mb=64)
    ddp.register_comm_hook(PowerSGD(ddp.module, CommState(), 4, 2), powersgd_hook)
    _, ms = train(ddp, record=mine)
    same = all(torch.equal(a, b) for x, y in zip(mine, theirs) for a, b in zip(x, y))
    rows.append(_row("comm: PowerSGD (rank 4) on cuda/nccl, one rank", same,
                     "gradients equal torch's hook's bit for bit | ms/step", f"{same} | {ms:.2f}"))
    return rows


def gpu_checks() -> list:
    """CUDA checks for benchmarks/gpu_check.py, on a one-rank NCCL world (FileStore in a temp dir): the int8
    codec, the hook pipeline's stream dependencies (flat, hierarchical and CPU-Reduce's host copies; int8, fp16 and
    none), int8 NaN recovery, the autotuner on NCCL, NCCL socket candidates timed in child processes, DDP + hook
    gradients, and the comm algorithms' CUDA paths. Each row states its goal."""
    import tempfile

    import torch
    import torch.distributed as dist

    from aiak.comm.allreduce.topology import HierarchicalGroups, Topology

    if not torch.cuda.is_available():
        return [_row("comm: CUDA paths", False, "skipped", "no CUDA device")]
    if dist.is_initialized():
        return [_row("comm: CUDA paths", False, "skipped", "a process group exists; run gpu_checks without one")]
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    rows = _guarded("int8 codec", _codec_rows, device)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        except Exception as e:  # noqa: BLE001
            return rows + [_row("comm: one-rank NCCL world", False, "crashed", repr(e)[:300])]
        try:
            groups = HierarchicalGroups(Topology(0, 1, ((0,),), "one GPU"), dist.new_group([0]), dist.new_group([0]),
                                        (0,), (0,))
            host_inter = dist.new_group([0], backend="gloo")   # CPU-Reduce's cross-node group
            rows += _guarded("hook pipeline", _pipeline_rows, device, groups, host_inter)
            rows += _guarded("autotune", _autotune_rows, device)
            rows += _guarded("NCCL sockets", _socket_rows, device)
            rows += _guarded("DDP hook", _ddp_rows, device)
            rows += _guarded("comm algorithms", _algorithm_rows, device)
        finally:
            dist.destroy_process_group()
    return rows


# -- report -------------------------------------------------------------------------------------
def _spread(values) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


def _ratios(flat, other) -> list:
    """flat / other, round by round (the rounds alternate the algorithms, so drift hits both alike)."""
    return [f / o for f, o in zip(flat, other)]


def report(result: dict, profile: str, layout: str) -> None:
    rounds = len(next(iter(next(iter(result['allreduce'].values())).values())))
    print(f"\nallreduce over {layout} simulated nodes x ranks, link '{profile}' (seconds of the slowest rank; "
          f"median and min-max over {rounds} rounds)")
    print(f"{'size':>7} {'algorithm':<28} {'median s':>8} {'min-max s':>13} {'vs flat':>8} {'min-max':>11} "
          f"{'goal':>11} {'prototype 16 MB':>16}")
    goals = GOALS if (profile, layout) == ("rate", "2x2") else {}
    for mb, row in result["allreduce"].items():
        flat = row["flat"]
        for name, times in row.items():
            ratios = _ratios(flat, times)
            ratio, goal = statistics.median(ratios), goals.get(name)
            verdict = "" if goal is None else (f">={goal:g}x " + ("ok" if ratio >= goal else "MISSED"))
            proto = f"{PROTOTYPE_16MB[name]:.2f} s" if float(mb) == 16 and name in PROTOTYPE_16MB and goals else ""
            print(f"{float(mb):>5g}MB {name:<28} {statistics.median(times):>8.3f} {_spread(times):>13} "
                  f"{ratio:>7.2f}x {min(ratios):>5.2f}-{max(ratios):<5.2f} {verdict:>11} {proto:>16}")
        _connections(row, profile, 0, f"{float(mb):g} MB allreduce")
    if not result["step"]:
        return
    step, alone = result["step"], result["alone"]
    print(f"\nDDP step, {result['params'] / 1e6:.1f}M-parameter MLP, batch {result['batch']} per rank, bucket 25 MB "
          f"(median and min-max over {len(step['flat'])} rounds)")
    print(f"{'algorithm':<28} {'s/step':>8} {'min-max':>13} {'vs flat':>8} {'min-max':>11} {'linearity':>10}")
    print(f"{'1 rank alone':<28} {alone:>8.3f} {'':>13} {'':>8} {'':>11} {'':>10}")
    world = result.get("world", 4)
    for name, times in step.items():
        ratios = _ratios(step["flat"], times)
        print(f"{name:<28} {statistics.median(times):>8.3f} {_spread(times):>13} {statistics.median(ratios):>7.2f}x "
              f"{min(ratios):>5.2f}-{max(ratios):<5.2f} {alone / statistics.median(times):>10.2f}")
    _connections(step, profile, 1, "DDP step")
    if "autotune" in result:
        print(f"comm autotuner (comm mode, comm.connections: auto, fresh cache) chose: {result['autotune']}")
    print(f"linearity = throughput on {world} ranks / ({world} x one rank) = t(1 rank) / t({world} ranks); "
          f"the {world} ranks share this machine's cores, so compute slows down too")


def _connections(row: dict, profile: str, which: int, what: str) -> None:
    """4 connections against 1, per round, for each algorithm measured both ways, with the profile's goal."""
    for base in ("flat", "hierarchical"):
        four = f"{base}, 4 connections"
        if base in row and four in row:
            ratios = _ratios(row[base], row[four])
            ratio = statistics.median(ratios)
            goal = CONNECTION_GOALS.get(profile, (None, None))[which]
            verdict = "" if goal is None else f"  goal >= {goal:g}x: " + ("ok" if ratio >= goal else "MISSED")
            if profile == "rate":
                verdict = "  goal: within noise of 1 (" + ("ok" if min(ratios) <= 1.0 <= max(ratios) or
                                                          abs(ratio - 1) <= 0.05 else "MISSED") + ")"
            print(f"  {what}, {base}: 4 connections / 1 = {ratio:.2f}x per round (min-max {min(ratios):.2f}-"
                  f"{max(ratios):.2f}){verdict}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[16, 64])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--step-params-m", type=float, default=25.0, help="parameters of the DDP step model, millions")
    p.add_argument("--step-repeats", type=int, default=3)
    p.add_argument("--pipeline-mb", type=float, default=2.0, help="hierarchical pipeline chunk (0 = whole buffer)")
    p.add_argument("--skip-step", action="store_true", help="allreduce table only")
    p.add_argument("--profile", default="rate", choices=sorted(PROFILES), help="the link condition (default rate)")
    p.add_argument("--nodes", default="2x2", choices=["2x2", "4x1"], help="nodes x ranks per node (default 2x2)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed")
    p.add_argument("--quick", action="store_true", help="16 MB only, 3 repeats, 2 step repeats")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.sizes_mb, args.repeats, args.step_repeats = [16], 3, 2
    if args.worker:
        return worker(args)
    if os.geteuid() != 0:
        sys.exit("comm_netns.py needs root (it creates network namespaces and shapes their links)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally/with below still cleans up
    nodes, local_size = map(int, args.nodes.split("x"))
    profile = PROFILES[args.profile]
    with Lab(profile, nodes, str(os.getpid() % 10000)) as lab, tempfile.TemporaryDirectory() as tmp:
        print(describe_calibration(args.profile, profile, calibrate(lab)), flush=True)
        out = Path(tmp) / "result.json"
        launch(lab, local_size, args, out)
        report(json.loads(out.read_text()), args.profile, args.nodes)


if __name__ == "__main__":
    main()

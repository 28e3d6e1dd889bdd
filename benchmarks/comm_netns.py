"""Hierarchical allreduce and gradient compression over a shaped link between two simulated nodes.

Two network namespaces play two nodes joined by a veth pair shaped with ``tc qdisc ... tbf rate 500mbit``;
two gloo ranks run in each namespace, so intra-node traffic stays on the namespace's loopback and only
inter-node traffic crosses the shaped link (the setting of the issue: hierarchical allreduce made Swin
training 85% faster on 4 nodes x 8 GPUs over 25 Gb/s TCP; ByteGrad cuts traffic 4x).

Measured in one run, against flat allreduce (what DDP does by default):
  * allreduce of 16-64 MB: flat, hierarchical, hierarchical+fp16, hierarchical+int8 (+ flat+fp16/int8);
  * one DDP training step of a ~25M-parameter MLP with each algorithm (``aiak.comm.wrap_distributed``);
  * scaling linearity = throughput on 4 ranks / (4 x throughput of one rank alone).
Goals: hierarchical >= 1.4x flat (theory 1.5x with 2 local ranks), +fp16 >= 2.5x, +int8 >= 4x.

Needs root (creates namespaces ``aiak<pid>n0/n1``, deleted afterwards, also on failure or Ctrl-C). Traffic
only goes to loopback and to the addresses of those namespaces (10.231.0.1/2).

    sudo python benchmarks/comm_netns.py --quick
    sudo python benchmarks/comm_netns.py --sizes-mb 16 64 --repeats 5 --step-params-m 25
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
ALGORITHMS = [("flat", False, "none"), ("hierarchical", True, "none"), ("hierarchical+fp16", True, "fp16"),
              ("hierarchical+int8", True, "int8"), ("flat+fp16", False, "fp16"), ("flat+int8", False, "int8"),
              ("hierarchical+fp16 intra too", True, "fp16")]  # compress_intra=True
GOALS = {"hierarchical": 1.4, "hierarchical+fp16": 2.5, "hierarchical+int8": 4.0}
PROTOTYPE_16MB = {"flat": 0.39, "hierarchical": 0.33, "hierarchical+fp16": 0.19}
ADDRS = ("10.231.0.1", "10.231.0.2")


# -- namespaces ---------------------------------------------------------------------------------
def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


class TwoNodes:
    """Two namespaces joined by a shaped veth pair; a context manager that always cleans up."""

    def __init__(self, rate: str, tag: str):
        self.rate = rate
        self.ns = (f"aiak{tag}n0", f"aiak{tag}n1")
        self.dev = (f"aiak{tag}v0", f"aiak{tag}v1")

    def __enter__(self):
        try:
            for ns in self.ns:
                sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for ns, dev, addr in zip(self.ns, self.dev, ADDRS):
                sh("ip", "link", "set", dev, "netns", ns)
                sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{addr}/24", "dev", dev)
                sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")
                sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                   "burst", "256kb", "latency", "100ms")
        except BaseException:
            self.cleanup()
            raise
        return self

    def cleanup(self):
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)  # takes the veth with it

    def __exit__(self, *exc):
        self.cleanup()


def launch(nodes: TwoNodes, args, out: Path) -> None:
    port = 29500 + os.getpid() % 1000
    procs = []
    for rank in range(4):
        node, local = divmod(rank, 2)
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": "2",
               "GROUP_RANK": str(node), "NODE_RANK": str(node), "MASTER_ADDR": ADDRS[0], "MASTER_PORT": str(port),
               "GLOO_SOCKET_IFNAME": nodes.dev[node], "OMP_NUM_THREADS": "1",
               "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        cmd = ["ip", "netns", "exec", nodes.ns[node], sys.executable, __file__, "--worker", str(out),
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
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


# -- the ranks ----------------------------------------------------------------------------------
def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from aiak.comm import CommState, average, build_groups, detect_topology, wrap_distributed
    from aiak.strategy.schema import CommConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = build_groups(detect_topology())
    result = {"allreduce": {}, "step": {}}

    def slowest(seconds):  # a collective is as slow as its slowest rank
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    for mb in args.sizes_mb:
        x = torch.randn(int(mb * 2**20) // 4)
        for name, hier, comp in ALGORITHMS:
            state = CommState(None, groups, hierarchical=hier, compression=comp, pipeline_mb=args.pipeline_mb,
                              compress_intra=name.endswith("intra too"))
            times = []
            for i in range(args.repeats + 1):
                buf = x.clone()
                dist.barrier()
                start = time.perf_counter()
                if name == "flat":
                    dist.all_reduce(buf)  # DDP's default path
                else:
                    average(state, buf).wait()
                if i:
                    times.append(slowest(time.perf_counter() - start))
            result["allreduce"].setdefault(str(mb), {})[name] = statistics.median(times)

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

    def time_steps(net):
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        times = []
        for i in range(args.step_repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            net(batch).square().mean().backward()
            opt.step()
            if i:
                times.append(slowest(time.perf_counter() - start))
        return statistics.median(times)

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
    for name, hier, comp in ALGORITHMS[:4]:
        ddp = wrap_distributed(model(), CommConfig(hierarchical=hier, compression=comp, bucket_mb=25),
                               pipeline_mb=args.pipeline_mb)
        result["step"][name] = time_steps(ddp)
    if rank == 0:
        result.update(alone=alone, params=params, batch=batch.shape[0])
        Path(args.worker).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# -- CUDA checks (called by benchmarks/gpu_check.py; touches CUDA only when called) -----------------------
def _codec_and_hook_checks(device, backend: str) -> list:
    """int8 codec on ``device`` vs its bound, and DDP + aiak hook (world size 1) vs plain gradients."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from aiak.comm import CommState, comm_hook
    from aiak.comm.compression import dequantize_int8, quantize_int8

    device = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    rows = []
    x = torch.randn(4 * 2**20, device=device)  # 16 MB
    packed = quantize_int8(x, 2048)
    y = dequantize_int8(packed, x.numel(), 2048)
    r = x.view(-1, 2048)
    bound = ((r.amax(1) - r.amin(1)) / 255 / 2 * 1.001 + 1e-6).repeat_interleave(2048)
    times = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        dequantize_int8(quantize_int8(x, 2048), x.numel(), 2048)
        sync()
        times.append(time.perf_counter() - start)
    rows.append({"check": f"comm: int8 codec on {device.type} within half a step",
                 "ok": bool(((y - x).abs() <= bound).all()),
                 "metric": "ms per 16 MB quantize+dequantize", "value": round(statistics.median(times) * 1e3, 3)})

    own_group = not dist.is_initialized()
    if own_group:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(0)
        plain = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1000)).to(device)
        batch = torch.randn(64, 1024, device=device)
        plain(batch).square().mean().backward()
        expected = [p.grad.clone() for p in plain.parameters()]
        bounds = {"none": 1e-6, "fp16": 2e-3, "bf16": 1.6e-2, "int8": 0.1}
        for compression, bound in bounds.items():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1000)).to(device)
            ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=1)
            ddp.register_comm_hook(CommState(compression=compression), comm_hook)
            times = []
            for i in range(4):
                ddp.zero_grad()
                sync()
                start = time.perf_counter()
                ddp(batch).square().mean().backward()
                sync()
                times.append(time.perf_counter() - start)
            err = max(float((p.grad - e).abs().max() / e.abs().max()) for p, e in zip(ddp.parameters(), expected))
            rows.append({"check": f"comm: DDP + aiak hook ({compression}) on {device.type}/{backend}, gradients",
                         "ok": err <= bound, "metric": "max rel err | ms/step", "value": f"{err:.2e} | "
                         f"{statistics.median(times[1:]) * 1e3:.2f}"})
    finally:
        if own_group:
            dist.destroy_process_group()
    return rows


def gpu_checks() -> list:
    """CUDA checks for benchmarks/gpu_check.py: int8 codec on the GPU, and the DDP hook over NCCL (1 rank:
    multi-rank NCCL needs one GPU per rank; the multi-rank algorithms are covered by the gloo tests)."""
    import torch

    if not torch.cuda.is_available():
        return [{"check": "comm: CUDA paths", "ok": False, "metric": "skipped", "value": "no CUDA device"}]
    try:
        return _codec_and_hook_checks("cuda:0", "nccl")
    except Exception as e:  # noqa: BLE001 - one failed row, not a crashed check script
        return [{"check": "comm: CUDA paths", "ok": False, "metric": "error", "value": repr(e)[:300]}]


# -- report -------------------------------------------------------------------------------------
def report(result: dict, rate: str) -> None:
    print(f"\nallreduce over 2 simulated nodes x 2 ranks, inter-node link {rate} (median seconds, slowest rank)")
    print(f"{'size':>7} {'algorithm':<28} {'seconds':>8} {'vs flat':>8} {'goal':>11} {'prototype 16 MB':>16}")
    for mb, row in result["allreduce"].items():
        flat = row["flat"]
        for name, seconds in row.items():
            goal = GOALS.get(name)
            verdict = "" if goal is None else (f">={goal:g}x " + ("ok" if flat / seconds >= goal else "MISSED"))
            proto = f"{PROTOTYPE_16MB[name]:.2f} s" if float(mb) == 16 and name in PROTOTYPE_16MB else ""
            print(f"{float(mb):>5g}MB {name:<28} {seconds:>8.3f} {flat / seconds:>7.2f}x {verdict:>11} {proto:>16}")
    if not result["step"]:
        return
    step, alone = result["step"], result["alone"]
    print(f"\nDDP step, {result['params'] / 1e6:.1f}M-parameter MLP, batch {result['batch']} per rank, bucket 25 MB")
    print(f"{'algorithm':<20} {'s/step':>8} {'vs flat':>8} {'linearity':>10}")
    print(f"{'1 rank alone':<20} {alone:>8.3f} {'':>8} {'':>10}")
    for name, seconds in step.items():
        print(f"{name:<20} {seconds:>8.3f} {step['flat'] / seconds:>7.2f}x {alone / seconds:>10.2f}")
    print("linearity = throughput on 4 ranks / (4 x one rank) = t(1 rank) / t(4 ranks); "
          "the 4 ranks share this machine's cores, so compute slows down too")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[16, 64])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--step-params-m", type=float, default=25.0, help="parameters of the DDP step model, millions")
    p.add_argument("--step-repeats", type=int, default=3)
    p.add_argument("--pipeline-mb", type=float, default=2.0, help="hierarchical pipeline chunk (0 = whole buffer)")
    p.add_argument("--skip-step", action="store_true", help="allreduce table only")
    p.add_argument("--rate", default="500mbit", help="tc tbf rate of the inter-node link")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed")
    p.add_argument("--quick", action="store_true", help="16 MB only, 3 repeats, 2 step repeats")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.sizes_mb, args.repeats, args.step_repeats = [16], 3, 2
    if args.worker:
        return worker(args)
    if os.geteuid() != 0:
        sys.exit("comm_netns.py needs root (it creates network namespaces and a shaped veth pair)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally/with below still cleans up
    with TwoNodes(args.rate, str(os.getpid() % 100000)) as nodes, tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        launch(nodes, args, out)
        report(json.loads(out.read_text()), args.rate)


if __name__ == "__main__":
    main()

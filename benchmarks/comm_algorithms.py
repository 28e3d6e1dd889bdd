"""Time to accuracy of aiak's communication algorithms (``comm.algorithm``) between simulated nodes, under a named
link condition.

Network namespaces play the nodes, joined through a router namespace under one of :mod:`netlab`'s profiles
(default ``latency``: 100 Mbit/s and a 20 ms round trip, as between cloud regions), calibrated first and printed
above the tables; ``--nodes 2x2`` runs two gloo ranks in each of two namespaces, ``--nodes 4x1`` one rank in each
of four (as benchmarks/comm_netns.py). ``--loopback`` runs the ranks on 127.0.0.1 instead (no root, no link
condition: a check that the benchmark works, not a measurement of a slow link).

The contenders, each through ``aiak.optimize(model, opt, strategy={"comm": ...})`` (aiak wraps the model in DDP):
  * ``DDP``: ``algorithm: allreduce``, ``hierarchical: false``, ``compression: none`` (DDP's own allreduce);
  * ``hierarchical+int8``: ``allreduce``, ``hierarchical: true``, ``compression: int8`` (on 4x1 there is no
    hierarchy: ``flat+int8``, named so in the tables);
  * ``local_sgd``: period 8, warm-up 10% of the max steps (``hierarchical: auto``), ``compression: fp16`` (the
    warm-up's gradients and then the change of the weights since the last average cross the link as fp16; int8,
    the synchronous contender's, is for gradients only);
  * ``decentralized``: ``peers: shift_one``;
  * ``powersgd``: rank 4, warm-up 10% of the max steps (at least 2), ``hierarchical: auto`` (its sums hierarchical
    on 2x2).
``DDP``, ``hierarchical+int8`` and ``powersgd`` are the synchronous contenders (every rank applies the same
averaged gradient every step); ``local_sgd`` and ``decentralized`` let the replicas drift apart between
averages.

Two workloads that converge in minutes on a few CPU cores, generated from seeds (no downloads):
  * ``mlp``: teacher-student regression. A fixed random teacher (16 -> 16 tanh -> 1, scaled to unit output
    variance, the same on every rank) labels Gaussian inputs, plus Gaussian label noise of variance 0.01: the
    held-out MSE cannot go below 0.01 (its floor). The student is a 16 -> 128 -> 128 -> 1 ReLU MLP; MSE loss.
  * ``cnn``: 10 classes of 16x16 images: each class a fixed random smooth pattern, shifted by up to 2 pixels and
    buried in Gaussian noise (std 2); a two-convolution CNN; cross-entropy.
Each rank draws its own batch of 32 every step (seeded by seed, rank and step: the same stream for every
contender); SGD with momentum 0.9. The held-out loss (a fixed set of 4096 / 1000 examples) is evaluated every
``eval_every`` (5) steps on **rank 0's model** (for ``local_sgd`` and ``decentralized``, whose replicas differ between
averages, that is rank 0's replica as it is at that step, not an average of the replicas), while the other ranks
wait; the evaluation and that wait are not timed. A run reaches the workload's target loss at the first
evaluation from which the held-out loss stays at or below it: that evaluation and the next two (:data:`HOLDS`;
those the run has, at its end). One dip below does not count: the cnn's held-out loss jumps between evaluations
5 steps apart (its SGD noise; DDP seed 0 read 0.125 at step 125 and 0.201 at step 145), so the first crossing
moved by tens of steps with the grid; the JSON keeps it (``first_at_target``). Steps and wall time to target (the
sum over the timed stretches between evaluations of the slowest rank's time) are those of that evaluation. The run
trains on to the max steps, so that every contender's final held-out loss is taken after the same number of steps
(``--stop-at-target`` stops once the target holds instead: quicker, but then every final loss is about the
target). A run whose held-out loss turns non-finite stops and is reported as diverged.

The targets (:data:`WORKLOADS`) were calibrated by running DDP alone (``--loopback --only DDP --seeds 3``; the
held-out curves are in the JSON, ``curve``; DDP's arithmetic is the same on loopback as on the rig): DDP reaches
them after about 2/3 of the max steps of 250 (mlp: 0.055, 5.5x the noise floor, at step 170, 150-180 over 3 seeds;
cnn: 0.125 at step 150, 120-170, on a grid of 10 steps), so a contender that needs up to ~1.4x DDP's steps still
shows a time. Steps to target are read on the grid of evaluations: every 5 steps, fine enough for the 1.1x of the
convergence rule (at ~170 steps, a grid of 10 goes from 1.06x straight to 1.12x).

Rounds: a warm-up run (12 steps) of every contender first, then for each seed every contender once, the
contenders' order rotated each round (drift hits all alike). Tables give the median and min-max over seeds, and
the ratio of wall time to target to DDP's and to the best synchronous contender's (per seed, then median and
min-max). Goals, each printed as ``goal ...: measured X -> met/NOT met`` (``n/a (... would be met/NOT met)``
where the run's setting is not the goal's):
  * convergence: every algorithm's final held-out loss, in every seed, lies within DDP's seed range (min-max),
    and its steps to target are at most 1.1x DDP's (medians); an algorithm that fails says which part failed;
  * local_sgd (period 8): wall time to target <= 0.6x hierarchical+int8's (2x2);
  * decentralized: faster to target than every synchronous contender (4x1, 20 ms round trip);
  * powersgd (rank 4) on a ~25M-parameter MLP (``--step-params-m``): median step time <= 0.5x that of
    hierarchical+int8 (at 100 Mbit/s). This row times single training steps (batch 8) of DDP, (hierarchical or
    flat)+int8 and powersgd in alternating rounds, after a warm-up past powersgd's 2 allreduce steps.
The machine is shared and noisy: nothing asserts on a timing; medians are printed with their min-max.

The workloads and the step-time row are separate launches of the ranks: a rank that dies in one (gloo aborts
the process on a collective mismatch) leaves the other's results, and rank 0 saves after every run, so a phase
that dies still reports what it measured. A step-time row that fails runs again without powersgd; the failure is
printed (``FAILED: ...``, and in the table and the goal line). (Seen here: on the 25M MLP, whose gradients fill
several DDP buckets, powersgd aborted in gloo, "Received data size doesn't match expected size"; the small
workloads' models fit one bucket and ran.)

Runtime on 2 CPU cores under ``latency``: about 16 min (2x2, with 6 rounds of the step-time row; 12 min without,
``--step-params-m 0``; the row alone, ``--workloads`` with no name, 4 min) and 18 min (4x1, without it);
``--quick --loopback`` under two minutes.

Needs root (creates namespaces ``aiak<pid>n<i>`` and ``aiak<pid>r``, deleted afterwards, also on failure or
Ctrl-C); traffic only goes to loopback and to the addresses of those namespaces (10.231.<i>.1/2). Every wait is
bounded: the ranks' collectives time out (``--collective-timeout``), and the ranks are killed after ``--timeout``.

    sudo python benchmarks/comm_algorithms.py --profile latency --nodes 4x1
    sudo python benchmarks/comm_algorithms.py --profile latency --nodes 2x2 --json algorithms.json
    python benchmarks/comm_algorithms.py --quick --loopback --nodes 2x2 --json out.json    # no root, about a minute
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from netlab import PROFILES, Lab, calibrate, describe_calibration, stop  # noqa: E402  (the rig, next to this)

# Per workload: the target held-out loss (calibrated on DDP, see the module), SGD's learning rate, max steps
# (full run; --quick uses quick_steps), steps between held-out evaluations.
WORKLOADS = {
    "mlp": {"target": 0.055, "floor": 0.01, "lr": 0.05, "max_steps": 250, "quick_steps": 200, "eval_every": 5,
            "about": "teacher-student MLP regression, MSE (floor = label noise variance 0.01)"},
    "cnn": {"target": 0.125, "floor": None, "lr": 0.02, "max_steps": 250, "quick_steps": 200, "eval_every": 5,
            "about": "CNN on synthetic 16x16 images of 10 classes, cross-entropy"},
}
BATCH = 32                 # per rank and step
WARM_RUN_STEPS = 12        # the warm-up run of every contender (its algorithm's warm-up: 2 steps)
SYNCHRONOUS = ("ddp", "int8", "powersgd")
HOLDS = 3                  # the target counts as reached where 3 evaluations in a row are at or below it
GOAL_STEPS = 1.1           # steps to target <= 1.1x DDP's
GOAL_LOCAL_SGD = 0.6       # local_sgd's wall time to target <= 0.6x hierarchical+int8's (2x2)
GOAL_POWERSGD = 0.5        # powersgd's step time on the 25M MLP <= 0.5x hierarchical+int8's


def contenders(layout: str, warmup: int) -> list:
    """(role, label, comm section) of every contender on ``layout``; ``warmup``: local SGD's and PowerSGD's."""
    hierarchical = layout == "2x2"
    return [
        ("ddp", "DDP", {"algorithm": "allreduce", "hierarchical": False, "compression": "none"}),
        ("int8", "hierarchical+int8" if hierarchical else "flat+int8 (4x1: no hierarchy)",
         {"algorithm": "allreduce", "hierarchical": hierarchical, "compression": "int8"}),
        ("local_sgd", "local_sgd", {"algorithm": "local_sgd", "compression": "fp16",
                                    "local_sgd": {"period": 8, "warmup_steps": warmup}}),
        ("decentralized", "decentralized",
         {"algorithm": "decentralized", "hierarchical": False, "decentralized": {"peers": "shift_one"}}),
        ("powersgd", "powersgd",
         {"algorithm": "powersgd", "powersgd": {"rank": 4, "warmup_steps": max(2, warmup)}}),
    ]


def _with_warmup(comm: dict, steps: int) -> dict:
    """``comm`` with its algorithm's warm-up (local SGD, PowerSGD) set to ``steps``."""
    comm = json.loads(json.dumps(comm))
    for key in ("local_sgd", "powersgd"):
        if key in comm:
            comm[key]["warmup_steps"] = steps
    return comm


# -- the workloads (torch imported only when used) ------------------------------------------------------------
def _generator(*key: int):
    import torch

    h = 0
    for k in key:
        h = (h * 1_000_003 + int(k)) % (2**61 - 1)
    return torch.Generator().manual_seed(h)


class MLPTask:
    """Teacher-student regression: y = teacher(x) + N(0, noise^2); the held-out MSE's floor is noise^2."""

    dim, teacher_width, width, noise, heldout_size = 16, 16, 128, 0.1, 4096

    def __init__(self):
        import torch

        g = _generator(1, 2, 3)
        self.w1 = torch.randn(self.dim, self.teacher_width, generator=g) / math.sqrt(self.dim)
        self.w2 = torch.randn(self.teacher_width, 1, generator=g) / math.sqrt(self.teacher_width)
        self.scale = 1.0
        self.scale = 1.0 / float(self.teacher(torch.randn(8192, self.dim, generator=g)).std())
        h = _generator(4, 5, 6)
        self.hx = torch.randn(self.heldout_size, self.dim, generator=h)
        self.hy = self.teacher(self.hx) + self.noise * torch.randn(self.heldout_size, 1, generator=h)

    def teacher(self, x):
        import torch

        return torch.tanh(x @ self.w1) @ self.w2 * self.scale

    def batch(self, seed: int, rank: int, step: int, n: int = BATCH):
        import torch

        g = _generator(7, seed, rank, step)
        x = torch.randn(n, self.dim, generator=g)
        return x, self.teacher(x) + self.noise * torch.randn(n, 1, generator=g)

    def model(self, seed: int):
        import torch
        import torch.nn as nn

        torch.manual_seed(1000 + seed)
        return nn.Sequential(nn.Linear(self.dim, self.width), nn.ReLU(), nn.Linear(self.width, self.width),
                             nn.ReLU(), nn.Linear(self.width, 1))

    def loss(self, out, y):
        import torch.nn.functional as F

        return F.mse_loss(out, y)

    def heldout(self, model) -> float:
        import torch

        with torch.no_grad():
            return float(self.loss(model(self.hx), self.hy))


class CNNTask:
    """10 classes: a fixed random smooth 16x16 pattern each, shifted by up to ``shift`` pixels, plus noise."""

    classes, size, noise, shift, heldout_size = 10, 16, 2.0, 2, 1000

    def __init__(self):
        import torch
        import torch.nn.functional as F

        g = _generator(11, 12, 13)
        t = torch.randn(self.classes, 1, self.size, self.size, generator=g)
        for _ in range(2):  # smooth: neighbouring pixels correlated, so a 3x3 convolution sees a shape
            t = F.avg_pool2d(F.pad(t, (1, 1, 1, 1), mode="circular"), 3, stride=1)
        t = t - t.mean(dim=(2, 3), keepdim=True)
        self.templates = t / t.std(dim=(2, 3), keepdim=True)
        self.hx, self.hy = self._draw(_generator(14, 15, 16), self.heldout_size)

    def _draw(self, g, n: int):
        import torch

        y = torch.randint(0, self.classes, (n,), generator=g)
        shifts = torch.randint(-self.shift, self.shift + 1, (n, 2), generator=g).tolist()
        x = torch.stack([torch.roll(self.templates[c], (a, b), dims=(1, 2)) for c, (a, b) in zip(y.tolist(), shifts)])
        return x + self.noise * torch.randn(x.shape, generator=g), y

    def batch(self, seed: int, rank: int, step: int, n: int = BATCH):
        return self._draw(_generator(17, seed, rank, step), n)

    def model(self, seed: int):
        import torch
        import torch.nn as nn

        torch.manual_seed(2000 + seed)
        return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(32 * 4 * 4, self.classes))

    def loss(self, out, y):
        import torch.nn.functional as F

        return F.cross_entropy(out, y)

    def heldout(self, model) -> float:
        import torch

        with torch.no_grad():
            return float(self.loss(model(self.hx), self.hy))


TASKS = {"mlp": MLPTask, "cnn": CNNTask}


# -- the launcher -------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(plan_file: Path, out: Path, layout: str, lab, timeout: float, port: int) -> None:
    """One process per rank (in its node's namespace, or on loopback when ``lab`` is None); waits for all of
    them, at most ``timeout`` seconds, and kills the rest as soon as one fails. The ranks' stderr is passed on;
    a failure raises with the failed rank's last words (an abort in gloo's C++ leaves no Python traceback)."""
    import collections
    import threading

    nodes, local_size = map(int, layout.split("x"))
    world = nodes * local_size
    procs, tails, readers = [], [], []
    for rank in range(world):
        node, local = divmod(rank, local_size)
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
               "LOCAL_WORLD_SIZE": str(local_size), "GROUP_RANK": str(node), "NODE_RANK": str(node),
               "MASTER_ADDR": lab.addr[0] if lab is not None else "127.0.0.1", "MASTER_PORT": str(port),
               "GLOO_SOCKET_IFNAME": lab.dev[node] if lab is not None else "lo",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        cmd = [sys.executable, __file__, "--worker", str(out), "--plan", str(plan_file)]
        if lab is not None:
            cmd = ["ip", "netns", "exec", lab.ns[node]] + cmd
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, errors="replace")
        tail: "collections.deque" = collections.deque(maxlen=60)

        def forward(stream=proc.stderr, tail=tail):
            for line in stream:
                tail.append(line.rstrip("\n"))
                sys.stderr.write(line)
                sys.stderr.flush()

        reader = threading.Thread(target=forward, daemon=True)
        reader.start()
        procs.append(proc)
        tails.append(tail)
        readers.append(reader)
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                readers[rank].join(timeout=5)
                raise RuntimeError(f"rank {rank} exited with {code}: {_last_words(tails[rank])}")
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the ranks did not finish within {timeout:.0f} s (--timeout)")
            time.sleep(0.2)
    finally:
        stop(procs)


def _last_words(tail) -> str:
    """The line of a failed rank's stderr that says what went wrong (an error, an abort), else its last line."""
    lines = [line.strip() for line in tail if line.strip() and not line.startswith("[W")]
    for line in reversed(lines):
        if "what():" in line or "Error" in line or "error" in line:
            return line[:400]
    return lines[-1][:400] if lines else "(nothing on stderr)"


# -- the ranks ----------------------------------------------------------------------------------------------------
def worker(out: str, plan: dict) -> None:
    """One rank of a phase: ``workloads`` (every workload, seed and contender) or ``step`` (the step-time row).
    Rank 0 rewrites ``out`` after every run or round, so a phase that dies leaves what it measured."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=plan["collective_timeout"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    started = time.perf_counter()
    result = {"world": world, "workloads": {}}

    def save(record=None):
        if rank == 0:
            written = result if record is None else record
            written["worker_s"] = time.perf_counter() - started
            Path(out).write_text(json.dumps(written))

    if plan["phase"] == "step":
        save(step_rows(plan, say, save))
    else:
        workloads(plan, say, result, save)
        save()
    dist.barrier()
    dist.destroy_process_group()


def workloads(plan: dict, say, result: dict, save) -> None:
    for name in plan["workloads"]:
        spec = plan["settings"][name]
        task = TASKS[name]()
        entries = [c for c in contenders(plan["nodes"], spec["algo_warmup"])
                   if not plan["only"] or c[1] in plan["only"] or c[0] in plan["only"]]
        record = result["workloads"][name] = {"target": spec["target"], "floor": spec["floor"],
                                              "max_steps": spec["max_steps"], "eval_every": spec["eval_every"],
                                              "roles": {label: role for role, label, _ in entries},
                                              "comm": {label: comm for _, label, comm in entries},
                                              "warmup": {}, "runs": {label: [] for _, label, _ in entries}}
        say(f"[{name}] warm-up: every contender {WARM_RUN_STEPS} steps")
        for role, label, comm in entries:
            run = train(task, _with_warmup(comm, 2), seed=10_000, steps=WARM_RUN_STEPS, eval_every=WARM_RUN_STEPS,
                        target=-math.inf, lr=spec["lr"], stop_at_target=False)
            record["warmup"][label] = run
            say(f"  {label}: {_run_line(run)}")
        for seed in range(plan["seeds"]):
            shift = seed % len(entries)
            order = entries[shift:] + entries[:shift]   # rotated each round: drift hits every contender alike
            say(f"[{name}] seed {seed}: " + ", ".join(label for _, label, _ in order))
            for role, label, comm in order:
                run = train(task, comm, seed=seed, steps=spec["max_steps"], eval_every=spec["eval_every"],
                            target=spec["target"], lr=spec["lr"], stop_at_target=plan["stop_at_target"])
                record["runs"][label].append(run)
                save()
                say(f"  {label}: {_run_line(run)}")


def _run_line(run: dict) -> str:
    if run.get("error"):
        return "ERROR " + run["error"].strip().splitlines()[-1]
    reached = (f"target at step {run['steps_to_target']} ({run['wall_to_target']:.2f} s)"
               if run["steps_to_target"] is not None else "target not reached")
    return (f"{reached}, held-out {run['final_loss']:.4f} after {run['steps']} steps, "
            f"{run['step_s'] * 1e3:.1f} ms/step" + (", DIVERGED" if run["diverged"] else "") +
            f" [{run['comm']}]")


def _optimize(model, opt, comm: dict):
    """``aiak.optimize`` with the strategy ``{"comm": comm}`` (buckets of 25 MB; powersgd's ``bucket_mb: auto``: one);
    its two-line headline (printed at every call) dropped, anything else it prints kept."""
    import contextlib
    import io

    import aiak

    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        ddp, opt, _ = aiak.optimize(model, opt, strategy={"comm": {"bucket_mb": 25, **comm}})
    for line in said.getvalue().splitlines():
        if not line.startswith(("aiak: applied strategy", "aiak: the reason for each knob")):
            print(line, file=sys.stderr, flush=True)
    return ddp, opt


def train(task, comm: dict, *, seed: int, steps: int, eval_every: int, target: float, lr: float,
          stop_at_target: bool) -> dict:
    """One run of ``comm`` from a fresh model and optimizer; every rank returns the same record."""
    import torch
    import torch.distributed as dist

    from aiak.comm import describe_comm

    rank = dist.get_rank()
    run = {"seed": seed, "steps_to_target": None, "wall_to_target": None, "final_loss": None, "steps": 0,
           "timed_s": 0.0, "step_s": None, "diverged": False, "curve": [], "comm": None, "error": None}
    try:
        model = task.model(seed)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        ddp, opt = _optimize(model, opt, comm)
        run["comm"] = describe_comm(ddp)
        held = task.heldout(ddp.module) if rank == 0 else 0.0
        run["curve"].append([0, held, 0.0])
        dist.barrier()
        timed, start = 0.0, time.perf_counter()
        for step in range(1, steps + 1):
            x, y = task.batch(seed, rank, step)
            task.loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
            if step % eval_every and step != steps:
                continue
            stretch = time.perf_counter() - start      # this rank's time since the last evaluation
            held = 0.0
            if rank == 0:                              # rank 0's replica, untimed; the others wait
                ddp.module.eval()
                held = task.heldout(ddp.module)
                ddp.module.train()
                held = held if math.isfinite(held) else math.inf
            both = torch.tensor([stretch, held], dtype=torch.float64)
            dist.all_reduce(both, op=dist.ReduceOp.MAX)  # the slowest rank's stretch; rank 0's loss (others 0)
            timed += float(both[0])
            held = float(both[1])
            run["curve"].append([step, held, timed])
            run["steps"], run["final_loss"] = step, held
            if held == math.inf:
                run["diverged"] = True
                break
            if stop_at_target and len(run["curve"]) > HOLDS and _at_or_below(run["curve"][-HOLDS:], target):
                break
            start = time.perf_counter()
        run["steps_to_target"], run["wall_to_target"] = reached_target(run["curve"][1:], target)
        run["first_at_target"] = next((s for s, h, _ in run["curve"][1:] if h <= target), None)
        run["timed_s"] = timed
        run["step_s"] = timed / max(1, run["steps"])
        del ddp, opt, model
    except Exception:  # noqa: BLE001  (reported in the table; a rank that cannot go on fails the barrier below)
        run["error"] = traceback.format_exc()
        print(f"rank {rank}: {run['error']}", file=sys.stderr, flush=True)
    gc.collect()
    dist.barrier()
    return run


def reached_target(curve: list, target: float) -> tuple:
    """(step, wall s) of the evaluation from which the held-out loss stays at or below ``target``: it and the next
    ``HOLDS - 1`` evaluations (those the run has, at its end); ``(None, None)`` if there is none. ``curve``:
    ``[step, held-out loss, wall s]`` per evaluation."""
    for i, (step, _, wall) in enumerate(curve):
        if _at_or_below(curve[i:i + HOLDS], target):
            return step, wall
    return None, None


def _at_or_below(evaluations: list, target: float) -> bool:
    return all(held <= target for _, held, _ in evaluations)


def step_rows(plan: dict, say, save) -> dict:
    """Single DDP training steps of a ~``step_params_m``M-parameter MLP (three width x width layers, batch 8):
    DDP, the int8 contender and PowerSGD rank 4 (``plan["step_roles"]``), alternating round by round after a
    warm-up."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from aiak.comm import describe_comm

    width = int((plan["step_params_m"] * 1e6 / 3) ** 0.5)
    rows = [(role, label, comm) for role, label, comm in contenders(plan["nodes"], 2)
            if role in plan["step_roles"]]
    nets, described = {}, {}
    for role, label, comm in rows:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                              nn.Linear(width, width))
        ddp, opt = _optimize(model, torch.optim.SGD(model.parameters(), lr=1e-3), comm)
        nets[label], described[label] = (ddp, opt), describe_comm(ddp)
    params = sum(p.numel() for p in nets[rows[0][1]][0].parameters())
    batch = torch.randn(8, width, generator=_generator(99, dist.get_rank()))

    def one_step(label) -> float:
        ddp, opt = nets[label]
        dist.barrier()
        start = time.perf_counter()
        ddp(batch).square().mean().backward()
        opt.step()
        opt.zero_grad()
        t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
        return float(t)

    say(f"[step] {params / 1e6:.1f}M-parameter MLP, " + ", ".join(label for _, label, _ in rows) +
        (": warm-up (powersgd: 2 allreduce steps, then 1 compressed)" if "powersgd" in plan["step_roles"] else
         ": warm-up"))
    record = {"params": params, "width": width, "batch": 8, "roles": {label: role for role, label, _ in rows},
              "comm": described, "warmup": {}, "samples": {label: [] for _, label, _ in rows}}
    for role, label, _ in rows:
        record["warmup"][label] = [one_step(label) for _ in range(3 if role == "powersgd" else 1)]
    save(record)
    for r in range(plan["step_rounds"]):
        shift = r % len(rows)
        for _, label, _ in rows[shift:] + rows[:shift]:
            record["samples"][label].append(one_step(label))
        save(record)
        say(f"  round {r}: " + ", ".join(f"{label} {record['samples'][label][-1]:.3f} s" for _, label, _ in rows))
    return record


# -- report -------------------------------------------------------------------------------------------------------
def _med(values) -> float:
    return statistics.median(values)


def _mm(values, fmt: str) -> str:
    return f"{min(values):{fmt}}-{max(values):{fmt}}" if values else "-"


def _cell(values, fmt: str, missing: int = 0) -> str:
    """median (min-max), with how many seeds have no value."""
    if not values:
        return "not reached" if missing else "-"
    text = f"{_med(values):{fmt}} ({_mm(values, fmt)})"
    return text + (f" +{missing} not reached" if missing else "")


def _by_role(record: dict) -> dict:
    return {role: label for label, role in record["roles"].items()}


def _per_seed_ratio(runs: list, base: list) -> list:
    """wall to target of ``runs`` / of ``base``, seed by seed (same round), where both reached the target."""
    bases = {b["seed"]: b["wall_to_target"] for b in base if b["wall_to_target"]}
    return [r["wall_to_target"] / bases[r["seed"]] for r in runs
            if r["wall_to_target"] is not None and bases.get(r["seed"])]


def _reached(runs: list) -> list:
    return [r for r in runs if r["steps_to_target"] is not None and not r["error"]]


def _best_synchronous(record: dict) -> str:
    """The synchronous contender with the lowest median wall time to target (all seeds reached), else None."""
    best, best_t = None, math.inf
    for label, role in record["roles"].items():
        runs = record["runs"][label]
        if role in SYNCHRONOUS and runs and len(_reached(runs)) == len(runs):
            t = _med([r["wall_to_target"] for r in runs])
            if t < best_t:
                best, best_t = label, t
    return best


def _goal(goals: list, text: str, measured: str, verdict: str) -> None:
    goals.append({"goal": text, "measured": measured, "verdict": verdict})


def report(result: dict) -> list:
    """Print the tables and goal lines; returns the goals."""
    goals = []
    layout, profile, loopback = result["nodes"], result["profile"], result["loopback"]
    rig = "loopback" if loopback else f"profile '{profile}'"
    print(f"\n{result['calibration']}")
    for name, record in result["workloads"].items():
        seeds = max((len(v) for v in record["runs"].values()), default=0)
        floor = f", loss floor {record['floor']:g}" if record["floor"] is not None else ""
        print(f"\n{name}: {WORKLOADS[name]['about']}; {layout} ranks, {rig}; target held-out loss "
              f"{record['target']:g}{floor}; max {record['max_steps']} steps, held-out loss of rank 0's model "
              f"every {record['eval_every']}; median (min-max) over {seeds} seed(s)")
        head = (f"{'contender':<30} {'steps to target':>22} {'wall s to target':>24} {'final held-out loss':>26} "
                f"{'vs DDP':>17} {'vs best sync':>17} {'ms/step':>8}")
        print(head)
        roles = _by_role(record)
        ddp_runs = record["runs"].get(roles.get("ddp"), [])
        best = _best_synchronous(record)
        for label, runs in record["runs"].items():
            errors = [r for r in runs if r["error"]]
            good = [r for r in runs if not r["error"]]
            reached = _reached(runs)
            missing = len(good) - len(reached)
            steps = [r["steps_to_target"] for r in reached]
            walls = [r["wall_to_target"] for r in reached]
            finals = [r["final_loss"] for r in good if r["final_loss"] is not None]
            vs_ddp = _per_seed_ratio(runs, ddp_runs)
            vs_best = _per_seed_ratio(runs, record["runs"][best]) if best else []
            ms = [r["step_s"] * 1e3 for r in good if r["step_s"] is not None]
            diverged = sum(r["diverged"] for r in good)
            ratio = (lambda v: f"{_med(v):.2f}x ({_mm(v, '.2f')})" if v else "-")
            print(f"{label:<30} {_cell(steps, '.0f', missing):>22} {_cell(walls, '.2f', missing):>24} "
                  f"{_cell(finals, '.4f'):>26} {ratio(vs_ddp):>17} {ratio(vs_best):>17} "
                  f"{(f'{_med(ms):.1f}' if ms else '-'):>8}"
                  + (f"  {len(errors)} run(s) FAILED: {errors[0]['error'].strip().splitlines()[-1]}" if errors else "")
                  + (f"  {diverged} run(s) DIVERGED" if diverged else ""))
        print(f"  best synchronous contender (lowest median wall time to target): {best or 'none reached the target'}")
        for label, comm in record["comm"].items():
            runs = record["runs"][label]
            described = next((r["comm"] for r in runs if r["comm"]), "")
            print(f"  {label}: comm {json.dumps(comm, separators=(',', ':'))} -> {described}")
        _workload_goals(goals, name, record, layout, profile, loopback)
    if result.get("step"):
        _step_table(goals, result["step"], profile, loopback, rig)
    elif result["plan"]["step_params_m"] > 0:
        _goal(goals, "powersgd (rank 4) step time on the ~25M MLP <= 0.5x the int8 contender's (100 Mbit/s)",
              "nothing (the step-time row failed, see FAILED below)", "NOT met")
    print()
    for failure in result.get("failures", []):
        print(f"FAILED: the {failure['phase']} phase: {failure['error']}")
    for g in goals:
        print(f"goal {g['goal']}: measured {g['measured']} -> {g['verdict']}")
    return goals


def _workload_goals(goals: list, name: str, record: dict, layout: str, profile: str, loopback: bool) -> None:
    roles = _by_role(record)
    ddp = record["runs"].get(roles.get("ddp"), [])
    ddp_finals = [r["final_loss"] for r in ddp if r["final_loss"] is not None and not r["error"]]
    ddp_steps = [r["steps_to_target"] for r in _reached(ddp)]
    for label, runs in record["runs"].items():
        if label == roles.get("ddp"):
            continue
        text = (f"convergence, {label} ({name}): final held-out loss within DDP's seed range and steps to target "
                f"<= {GOAL_STEPS:g}x DDP's")
        if not ddp_finals or not ddp_steps or len(ddp_steps) < len(ddp):
            _goal(goals, text, "DDP itself did not reach the target in every seed", "NOT met (no DDP reference)")
            continue
        good = [r for r in runs if not r["error"]]
        finals = [r["final_loss"] for r in good if r["final_loss"] is not None]
        reached = _reached(runs)
        lo, hi = min(ddp_finals), max(ddp_finals)
        problems = []
        if len(good) < len(runs):
            problems.append(f"{len(runs) - len(good)} run(s) failed")
        if any(r["diverged"] for r in good):
            problems.append("diverged")
        above, below = [f for f in finals if f > hi], [f for f in finals if f < lo]
        if above or not finals:
            problems.append(f"final loss above DDP's range in {len(above)} of {len(finals)} seed(s)")
        if below:
            problems.append(f"final loss below DDP's range (lower, outside it all the same) in {len(below)} of "
                            f"{len(finals)} seed(s)")
        if len(reached) < len(good):
            problems.append(f"target not reached in {len(good) - len(reached)} of {len(good)} seed(s)")
        steps = [r["steps_to_target"] for r in reached]
        step_ratio = _med(steps) / _med(ddp_steps) if steps else math.inf
        if step_ratio > GOAL_STEPS:
            problems.append(f"steps to target {step_ratio:.2f}x DDP's")
        measured = (f"final loss {_med(finals):.4f} ({_mm(finals, '.4f')}) vs DDP's {lo:.4f}-{hi:.4f}; "
                    if finals else "no final loss; ") + \
            (f"steps to target {_med(steps):.0f} vs DDP's {_med(ddp_steps):.0f} ({step_ratio:.2f}x)" if steps
             else "target not reached")
        if problems and len(ddp_finals) == 1:
            problems.append("one seed only: DDP's range is a single value")
        _goal(goals, text, measured, "met" if not problems else "NOT met: " + "; ".join(problems))

    def wall(role):
        label = roles.get(role)
        runs = record["runs"].get(label, [])
        reached = _reached(runs)
        if not runs or len(reached) < len(runs):
            return label, None
        return label, _med([r["wall_to_target"] for r in reached])

    # local SGD against hierarchical+int8 (2x2)
    (local, t_local), (int8, t_int8) = wall("local_sgd"), wall("int8")
    if local and int8:
        text = f"local_sgd (period 8) wall time to target <= {GOAL_LOCAL_SGD:g}x {int8}'s ({name}, 2x2)"
        if t_local is None or t_int8 is None:
            measured, verdict = (f"{'local_sgd' if t_local is None else int8} did not reach the target in every "
                                 "seed"), "NOT met"
        else:
            ratio = t_local / t_int8
            measured = f"{t_local:.2f} s vs {t_int8:.2f} s = {ratio:.2f}x"
            verdict = "met" if ratio <= GOAL_LOCAL_SGD else "NOT met"
        if layout != "2x2" or loopback:
            verdict = f"n/a on {layout}{', loopback' if loopback else ''} (the goal is for 2x2 on a slow link; " \
                      f"would be {verdict})"
        _goal(goals, text, measured, verdict)
    # decentralized against every synchronous contender (4x1, 20 ms)
    dec, t_dec = wall("decentralized")
    if dec:
        text = f"decentralized faster to target than every synchronous contender ({name}, 4x1, 20 ms round trip)"
        others = [wall(role) for role in SYNCHRONOUS if roles.get(role)]
        if t_dec is None:
            measured, verdict = "decentralized did not reach the target in every seed", "NOT met"
        else:
            parts = [f"{label} {t:.2f} s" if t is not None else f"{label} not reached" for label, t in others]
            measured = f"decentralized {t_dec:.2f} s vs " + ", ".join(parts)
            slower = [label for label, t in others if t is not None and t <= t_dec]
            verdict = "met" if not slower else "NOT met (not faster than " + ", ".join(slower) + ")"
        if layout != "4x1" or loopback or PROFILES[profile].rtt_ms != 20:
            verdict = f"n/a on {layout}, {'loopback' if loopback else profile} (the goal is for 4x1 at 20 ms; " \
                      f"would be {verdict})"
        _goal(goals, text, measured, verdict)


def _step_table(goals: list, step: dict, profile: str, loopback: bool, rig: str) -> None:
    samples = {label: times for label, times in step["samples"].items() if times}
    rounds = max((len(t) for t in samples.values()), default=0)
    labels = {role: label for label, role in step["roles"].items()}
    failed = step.get("failed", {})
    print(f"\nstep time, {step['params'] / 1e6:.1f}M-parameter MLP (3 layers of {step['width']}), batch "
          f"{step['batch']} per rank, buckets of 25 MB (powersgd: one), {rig} (seconds of the slowest rank; median "
          f"and min-max over {rounds} alternating rounds)")
    print(f"{'contender':<30} {'s/step':>8} {'min-max':>15} {'vs DDP':>8} {'vs int8':>8}   comm")
    ddp, int8 = samples.get(labels.get("ddp")), samples.get(labels.get("int8"))
    for label, times in samples.items():
        vs_ddp = f"{_med([d / t for d, t in zip(ddp, times)]):>7.2f}x" if ddp else f"{'-':>8}"
        vs_int8 = f"{_med([t / i for t, i in zip(times, int8)]):>7.2f}x" if int8 else f"{'-':>8}"
        print(f"{label:<30} {_med(times):>8.3f} {_mm(times, '.3f'):>15} {vs_ddp} {vs_int8}   {step['comm'][label]}")
    for label, error in failed.items():
        print(f"{label:<30} {'CRASHED':>8}   {error}")
    print("  vs DDP: DDP's time / this (speed-up); vs int8: this time / the int8 contender's, round by round")
    int8_label = labels.get("int8", "the int8 contender")
    text = (f"powersgd (rank 4) step time on the {step['params'] / 1e6:.0f}M MLP <= {GOAL_POWERSGD:g}x "
            f"{int8_label}'s (100 Mbit/s)")
    psgd = samples.get(labels.get("powersgd"))
    if "powersgd" in failed or not psgd or not int8:
        why = failed.get("powersgd", "no samples")
        _goal(goals, text, f"powersgd crashed on this model ({why})", "NOT met (aiak's powersgd did not run)")
        return
    ratios = [p / i for p, i in zip(psgd, int8)]
    ratio = _med(ratios)
    measured = f"{_med(psgd):.3f} s vs {_med(int8):.3f} s = {ratio:.2f}x per round (min-max {_mm(ratios, '.2f')})"
    verdict = "met" if ratio <= GOAL_POWERSGD else "NOT met"
    if loopback or PROFILES[profile].rate != "100mbit":
        verdict = f"n/a on {'loopback' if loopback else profile} (the goal is for 100 Mbit/s; would be {verdict})"
    elif step["params"] < 20e6:
        verdict = f"n/a: {step['params'] / 1e6:.1f}M parameters, not ~25M (would be {verdict})"
    _goal(goals, text, measured, verdict)


# -- main -----------------------------------------------------------------------------------------------------
def plan_of(args) -> dict:
    names = args.workloads
    settings = {}
    for name in names:
        w = WORKLOADS[name]
        steps = args.max_steps or (w["quick_steps"] if args.quick else w["max_steps"])
        settings[name] = {"target": w["target"], "floor": w["floor"], "lr": w["lr"], "max_steps": steps,
                          "eval_every": min(w["eval_every"], steps), "algo_warmup": max(2, round(0.1 * steps))}
    step_m = args.step_params_m if args.step_params_m is not None else (5.0 if args.quick else 25.0)
    return {"nodes": args.nodes, "workloads": names, "settings": settings,
            "seeds": args.seeds if args.seeds is not None else (1 if args.quick else 3),
            "only": args.only or [], "stop_at_target": args.stop_at_target, "step_params_m": step_m,
            "step_rounds": args.step_rounds if args.step_rounds is not None else (2 if args.quick else 3),
            "collective_timeout": args.collective_timeout}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="latency", choices=sorted(PROFILES),
                   help="the link condition (default latency: 100 Mbit/s, 20 ms round trip)")
    p.add_argument("--nodes", default="2x2", choices=["2x2", "4x1"], help="nodes x ranks per node (default 2x2)")
    p.add_argument("--loopback", action="store_true",
                   help="ranks on 127.0.0.1, no namespaces and no link condition (no root needed)")
    p.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS),
                   help="the time-to-accuracy workloads (default: all; none: only the step-time row)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per contender (default 3; --quick 1)")
    p.add_argument("--max-steps", type=int, default=None, help="override every workload's max steps")
    p.add_argument("--only", nargs="+", default=None, metavar="CONTENDER",
                   help="only these contenders (labels or roles: ddp int8 local_sgd decentralized powersgd)")
    p.add_argument("--stop-at-target", action="store_true", help="stop a run at the target instead of max steps")
    p.add_argument("--step-params-m", type=float, default=None,
                   help="parameters of the step-time MLP, millions (default 25; --quick 5; 0 = skip that row)")
    p.add_argument("--step-rounds", type=int, default=None, help="rounds of the step-time row (default 3; --quick 2)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds before the ranks are killed (default 3600; --quick 900)")
    p.add_argument("--collective-timeout", type=float, default=300.0, help="seconds a collective may wait")
    p.add_argument("--quick", action="store_true",
                   help="1 seed, 200 steps per workload, a 5M step-time model, 2 rounds (about a minute on loopback)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results there")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker, json.loads(Path(args.plan).read_text()))
    plan = plan_of(args)
    timeout = args.timeout or (900.0 if args.quick else 3600.0)
    profile = PROFILES[args.profile]
    nodes = int(args.nodes.split("x")[0])
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if args.loopback:
            calibration, line = None, "loopback (127.0.0.1), no link condition: ranks share this machine's cores"
            print(line, flush=True)
            result = run_phases(plan, Path(tmp), None, timeout)
        else:
            if os.geteuid() != 0:
                sys.exit("comm_algorithms.py needs root (network namespaces); or run it with --loopback")
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the with below still cleans up
            with Lab(profile, nodes, str(os.getpid() % 10000)) as lab:
                calibration = calibrate(lab)
                line = describe_calibration(args.profile, profile, calibration)
                print(line, flush=True)
                result = run_phases(plan, Path(tmp), lab, timeout)
    result.update(calibration=line, calibration_measured=calibration, profile=args.profile, nodes=args.nodes,
                  loopback=args.loopback, plan=plan, wall_s=None)
    result["goals"] = report(result)
    result["wall_s"] = time.perf_counter() - started
    print(f"\n(the whole benchmark took {result['wall_s']:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def run_phases(plan: dict, tmp: Path, lab, timeout: float) -> dict:
    """The workloads, then the step-time row, each a launch of its own (a rank that dies in one, gloo aborting
    the process, does not take the other's results along). If the step-time row fails with powersgd in it, it
    runs again without powersgd, so DDP's and the int8 contender's rows still come back, and the failure is
    reported."""
    deadline = time.monotonic() + timeout
    result = {"workloads": {}, "step": None, "failures": []}
    base_port = 29500 + os.getpid() % 1000 if lab is not None else None

    def phase(n: int, **changes):
        name = changes.get("phase")
        plan_file, out = tmp / f"plan{n}.json", tmp / f"result{n}.json"
        plan_file.write_text(json.dumps({**plan, **changes}))
        port = base_port + 10 * n if base_port is not None else _free_port()
        error = None
        try:
            launch(plan_file, out, plan["nodes"], lab, max(1.0, deadline - time.monotonic()), port)
        except RuntimeError as e:
            error = str(e)
            roles = changes.get("step_roles")
            result["failures"].append({"phase": name + (f" ({', '.join(roles)})" if roles else ""), "error": error})
            print(f"FAILED: the {name} phase: {error}", file=sys.stderr, flush=True)
        return (json.loads(out.read_text()) if out.exists() else None), error

    if plan["workloads"]:
        done, _ = phase(0, phase="workloads")
        result["workloads"] = (done or {}).get("workloads", {})
        result["world"] = (done or {}).get("world")
    if plan["step_params_m"] > 0:
        roles = ["ddp", "int8", "powersgd"]
        step, error = phase(1, phase="step", step_roles=roles)
        if error is not None:
            partial = step
            step, again = phase(2, phase="step", step_roles=["ddp", "int8"])
            if step is not None:
                step["failed"] = {"powersgd": error if again is None else f"{error} (and without powersgd: {again})"}
                step["failed_partial"] = partial
        result["step"] = step
    return result


if __name__ == "__main__":
    main()

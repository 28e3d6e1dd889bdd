"""Per-rank memory and step time of aiak's DDP against aiak's FSDP2 (``comm.engine: fsdp2``), at 2 and 4 ranks.

    python benchmarks/fsdp_memory.py [--worlds 2,4] [--layers 4] [--width 256] [--rounds 8] [--device cpu|cuda]

Each world size is one ``torchrun`` launch (gloo on a CPU, NCCL on GPUs: one per rank). Every rank builds the same
Hugging Face GPT-2 twice (``--layers`` blocks of ``--width``, vocabulary 8192, AdamW) and passes each through
``aiak.optimize``: one with ``comm.engine: ddp``, one with ``fsdp2``. Both train on the same batches (4 sequences of
64 tokens per rank).

Memory is measured, not estimated: after a step and a backward, the bytes of the storages behind each rank's
parameters, their gradients and the optimizer's state (each storage once; FSDP2's shards with their padding), on
the rank that holds the most. The goal: FSDP2's within 10% of 1/N of DDP's. DDP's own gradient buckets (another
gradient-sized copy unless ``gradient_as_bucket_view``) are not counted in DDP's figure, so the comparison favours
DDP. Step time: the two alternate in rounds after a warm-up (``aiak.measure.rounds.alternate``: the slowest rank's
time, the order rotated each round), with the median and p10-p90 of each and the per-round ratio's median and
interval. Nothing asserts on a time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]


def _model(layers: int, width: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), vocab_size=8192,
                                      n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0))


def _storage_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors``, each storage once (a DTensor's local shard's)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _training_state(model, optimizer) -> dict:
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"params": _storage_bytes(params), "grads": _storage_bytes(p.grad for p in params),
            "state": _storage_bytes(state)}


def worker(args) -> None:
    """One rank: both engines through aiak.optimize, their memory, then their steps in alternating rounds."""
    import aiak
    from aiak.measure.rounds import Contender, Spread, alternate, speedup

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 8192, (4, 64), generator=g).to(device) for _ in range(4)]
    engines, out = {}, {"world": world}
    for engine in ("ddp", "fsdp2"):
        model = _model(args.layers, args.width).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt, _ = aiak.optimize(model, opt, strategy={"tune": False, "comm": {"engine": engine}})
        for ids in batches[:2]:  # a step (the optimizer's state made), then a backward: everything held
            model(input_ids=ids, labels=ids).loss.backward()
            if ids is batches[0]:
                opt.step()
                opt.zero_grad()
        held = _training_state(model, opt)
        opt.zero_grad()
        most = [None] * world
        dist.all_gather_object(most, held)
        out[engine] = max(most, key=lambda h: sum(h.values()))
        engines[engine] = (model, opt)
    out["params"] = sum(p.numel() for p in _model(args.layers, args.width).parameters())

    def step_of(model, opt):
        turn = iter(range(10 ** 9))

        def step():
            ids = batches[next(turn) % len(batches)]
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step

    contenders = [Contender(name, step_of(*engines[name]), device) for name in ("ddp", "fsdp2")]
    alternate(contenders, warmup=args.warmup, rounds=args.rounds, steps_per_round=args.steps)
    ddp, fsdp2 = contenders
    out["time"] = {c.name: vars(c.timing()) for c in contenders}
    ratio = speedup(ddp.round_seconds, fsdp2.round_seconds)
    out["ratio"] = {"median": ratio.median, "low": ratio.low, "high": ratio.high, "rounds": ratio.rounds}
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def _launch(world: int, args) -> dict:
    out = Path(tempfile.mkdtemp()) / "result.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               str(Path(__file__).resolve()), "--worker", "--out", str(out), "--layers", str(args.layers),
               "--width", str(args.width), "--rounds", str(args.rounds), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--device", args.device]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run(command, check=True, env=env, timeout=args.timeout)
    return json.loads(out.read_text())


def _mb(n: int) -> str:
    return f"{n / 2 ** 20:8.2f}"


def report(results) -> None:
    print("\nPer-rank training state (the rank holding the most), MiB; goal: FSDP2 within 10% of DDP / N")
    print(f"{'ranks':>5} {'engine':>6} {'params':>8} {'grads':>8} {'state':>8} {'total':>8}   vs DDP/N   goal")
    for r in results:
        world, ddp = r["world"], sum(r["ddp"].values())
        for engine in ("ddp", "fsdp2"):
            h = r[engine]
            total = sum(h.values())
            share = f"{total / (ddp / world):7.3f}x" if engine == "fsdp2" else "      -"
            goal = "" if engine == "ddp" else ("met" if total / (ddp / world) <= 1.10 else "NOT met")
            print(f"{world:5d} {engine:>6} {_mb(h['params'])} {_mb(h['grads'])} {_mb(h['state'])} {_mb(total)}"
                  f"   {share}   {goal}")
    print("\nStep time, ms: median (p10-p90) of the slowest rank; ratio = DDP / FSDP2 per round (median, interval)")
    for r in results:
        t = {k: v for k, v in r["time"].items()}
        ratio = r["ratio"]
        print(f"{r['world']:5d} ranks: DDP {t['ddp']['median'] * 1e3:.1f} ({t['ddp']['p10'] * 1e3:.1f}-"
              f"{t['ddp']['p90'] * 1e3:.1f})  FSDP2 {t['fsdp2']['median'] * 1e3:.1f} ({t['fsdp2']['p10'] * 1e3:.1f}-"
              f"{t['fsdp2']['p90'] * 1e3:.1f})  DDP/FSDP2 {ratio['median']:.2f}x ({ratio['low']:.2f}-"
              f"{ratio['high']:.2f}, {ratio['rounds']} rounds)")


def gpu_checks() -> list:
    """``gpu_check.py --only fsdp``: the memory goal and the step time on 2 GPUs (NCCL needs one GPU per rank)."""
    count = torch.cuda.device_count()
    if count < 2:
        return [{"check": "fsdp: FSDP2 vs DDP on GPUs", "ok": True, "metric": "not measured",
                 "value": f"needs 2 GPUs (NCCL takes one per rank); this machine has {count}"}]
    args = argparse.Namespace(layers=12, width=768, rounds=8, steps=2, warmup=3, device="cuda", timeout=600.0)
    r = _launch(2, args)
    ddp, fsdp2 = sum(r["ddp"].values()), sum(r["fsdp2"].values())
    ratio = r["ratio"]
    return [{"check": "fsdp: per-rank training state, 2 GPUs", "ok": fsdp2 <= 1.10 * ddp / 2,
             "metric": "FSDP2 / (DDP / 2) (goal <= 1.10)", "value": f"{fsdp2 / (ddp / 2):.3f}"},
            {"check": "fsdp: step time, 2 GPUs", "ok": ratio["median"] >= 1 / 1.25,
             "metric": "DDP / FSDP2 per round (goal >= 0.8)",
             "value": f"{ratio['median']:.2f}x ({ratio['low']:.2f}-{ratio['high']:.2f})"}]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2, help="steps per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    results = [_launch(int(w), args) for w in args.worlds.split(",")]
    print(f"GPT-2, {args.layers} blocks of width {args.width}, vocabulary 8192: "
          f"{results[0]['params'] / 1e6:.1f}M parameters, AdamW, {args.device}")
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The language-model head without its logits: peak memory and time, fused against plain, on this machine.

    python benchmarks/linear_cross_entropy.py [--sizes 50257x1024x4096,128256x2048x4096] [--dtypes fp32,bf16]
                                              [--what head,step] [--rounds 5] [--checkpointing] [--quick]
                                              [--json FILE]

A size is ``vocab x hidden x tokens``. Two measurements for each size and dtype:

* ``head``: the loss alone, forward and backward, ``aiak.ops.linear_cross_entropy`` with each implementation
  (``plain`` = ``F.cross_entropy(F.linear(h, W).float(), y)``, the unfused head; ``chunked``; ``torch``, fp32).
* ``step``: a whole training step (torch's fused AdamW, the Hugging Face Trainer's default) of a one-layer Llama
  with that vocabulary and hidden size (Llama 3.2 1B's shapes at 128256 x 2048: tied embeddings, 32 heads, 8 KV
  heads, MLP 4 x hidden), unfused against ``fused_ops: [linear_cross_entropy]`` through ``aiak.optimize``. With
  ``--checkpointing``, both sides run Hugging Face's activation checkpointing, as a large vocabulary is usually
  trained: the decoder layers' activations are recomputed in the backward instead of kept, so what remains of the
  step's peak is the head's (the logits, or the fused head's slice) and the weights' gradients.

Peak memory: each contender runs in a process of its own; after one warm-up step (the optimizer's state exists),
one more step is measured by `aiak.measure.memory.PeakMemory` (the process's resident high-water mark, reset
before the step, above what was resident then): what the step adds to the model, its gradients and its optimizer
state. Time: the contenders share one process, warm up,
then run in alternating rounds (``aiak.measure.rounds.alternate``; the order rotates each round); each
contender's step time is the median over rounds with its p10-p90 spread, and the ratio to plain is the median of
the per-round ratios with its confidence interval (`aiak.measure.rounds.speedup`).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from typing import Callable, Dict, List, Tuple

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HEADS = ("plain", "chunked", "torch")


def _parse_size(text: str) -> Tuple[int, int, int]:
    vocab, hidden, tokens = (int(x) for x in text.lower().split("x"))
    return vocab, hidden, tokens


CHUNK_MIB = None          # --chunk-mib: the chunked head's slice budget (None: the op's default)
CHECKPOINTING = False     # --checkpointing: Hugging Face's activation checkpointing in the step, on both sides
DEVICE = "cpu"            # gpu_checks: "cuda"


def _head_step(implementation: str, vocab: int, hidden: int, tokens: int, dtype) -> Callable[[], float]:
    from aiak.ops import linear_cross_entropy
    from aiak.ops.linear_cross_entropy import chunk_tokens_for

    chunk = (chunk_tokens_for(vocab, CHUNK_MIB * 2 ** 20, min_tokens=16) if CHUNK_MIB and implementation == "chunked"
             else None)

    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(DEVICE, dtype).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), generator=g)
    y[::10] = -100
    y = y.to(DEVICE)

    def step() -> float:
        loss = linear_cross_entropy(h, w, y, implementation=implementation, chunk_tokens=chunk)
        loss.backward()
        h.grad = w.grad = None
        return float(loss)
    return step


def _llama(vocab: int, hidden: int):
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                                      num_hidden_layers=1, num_attention_heads=max(1, hidden // 64),
                                      num_key_value_heads=max(1, hidden // 256), tie_word_embeddings=True,
                                      max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _train_step(contender: str, vocab: int, hidden: int, tokens: int, dtype) -> Callable[[], float]:
    import warnings

    import aiak

    model = _llama(vocab, hidden).train().to(DEVICE)
    if CHECKPOINTING:  # each decoder layer recomputed in the backward, its activations not kept (use_cache off)
        model.config.use_cache = False
        if hasattr(model, "activation_checkpointing_enable"):   # the name since transformers 5.x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # torch's fused AdamW, the Hugging Face Trainer's default optimizer (adamw_torch_fused): the foreach and
    # per-tensor ones make temporaries of the largest parameter's size in their step (the embedding's, 1 GiB at
    # 128256 x 2048), the same with the knob and without, which would hide what the head saves.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    strategy = {"tune": False, "fused_ops": ["linear_cross_entropy"] if contender == "fused" else []}
    if dtype != torch.float32:
        strategy["precision"] = {"level": "O2", "dtype": "bf16"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, _ = aiak.optimize(model, optimizer, strategy=strategy)
    length = min(tokens, 2048)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (tokens // length, length), generator=g).to(DEVICE)

    def step(peaks=None) -> float:
        from aiak.measure.memory import PeakMemory

        with PeakMemory(DEVICE) as forward_backward:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if peaks is not None:
            peaks["forward_backward"] = forward_backward.bytes
        return float(loss)
    return step


def _make(what: str, contender: str, size, dtype) -> Callable[[], float]:
    return (_head_step if what == "head" else _train_step)(contender, *size, dtype)


def peak_in_this_process(what: str, contender: str, size, dtype, chunk_mib=None, checkpointing=False) -> dict:
    """Bytes one step adds at its peak to what was resident before it (after a warm-up step): ``{"step": ...}``,
    and for a train step also ``"forward_backward"``, its peak before the optimizer's step."""
    global CHUNK_MIB, CHECKPOINTING
    CHUNK_MIB, CHECKPOINTING = chunk_mib, checkpointing
    from aiak.measure.memory import PeakMemory

    step = _make(what, contender, size, dtype)
    step()
    phases = {}
    with PeakMemory() as peak:
        step(phases) if what == "step" else step()
    return {"step": peak.bytes, **phases}


def peak_in_a_fresh_process(what: str, contender: str, size, dtype_name: str) -> dict:
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); import linear_cross_entropy as b, torch; "
            f"print(json.dumps(b.peak_in_this_process({what!r}, {contender!r}, {tuple(size)!r}, b.DTYPES[{dtype_name!r}], "
            f"{CHUNK_MIB!r}, {CHECKPOINTING!r})))")
    # glibc serves allocations under its mmap threshold (which grows to 32 MiB as large blocks are freed) from a
    # heap that keeps freed memory resident, where a second step reuses it unseen: a fixed 64 KiB threshold makes
    # every tensor an mmap that goes back to the kernel on free, so the high-water mark follows the tensors.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return json.loads(out.stdout.strip().splitlines()[-1])


def timed(what: str, contenders: List[str], size, dtype, rounds: int) -> Dict[str, dict]:
    from aiak.measure.rounds import Contender, Spread, alternate, speedup

    sides = [Contender(name, _make(what, name, size, dtype)) for name in contenders]
    alternate(sides, warmup=1, rounds=rounds, steps_per_round=1, slow_factor=float("inf"), across_ranks=False)
    base = sides[0]
    out = {}
    for c in sides:
        ratio = speedup(c.round_seconds, base.round_seconds)       # candidate time / plain time
        out[c.name] = {"seconds": Spread.of(c.round_seconds).__dict__, "time_ratio": ratio.median,
                       "time_ratio_interval": [ratio.low, ratio.high], "rounds": ratio.rounds}
    return out


def gpu_checks() -> list:
    """``gpu_check.py --only lce``: on one GPU, at 128256 x 2048 x 8192 in bf16 (Llama 3's vocabulary), the correctness
    of each implementation against fp64, then the head's peak memory (the allocator's, above its start) and time
    against plain, and the whole one-layer step's, each against its goal (head memory <= 1/8 of plain's, step
    time <= 1.05x plain's)."""
    from aiak.measure.memory import PeakMemory
    from aiak.measure.rounds import Contender, alternate, speedup
    from aiak.ops import linear_cross_entropy

    global DEVICE
    DEVICE = "cuda"
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(512, 256, device="cuda", generator=g, requires_grad=True)
    w = (torch.randn(32000, 256, device="cuda", generator=g) * 0.05).requires_grad_()
    y = torch.randint(0, 32000, (512,), device="cuda", generator=g)
    y[::9] = -100
    reference = torch.autograd.grad(linear_cross_entropy(h.double(), w.double(), y, implementation="plain"), [h, w])
    for implementation in ("chunked", "torch"):
        for dtype in (torch.float32, torch.bfloat16):
            if implementation == "torch" and dtype != torch.float32:
                continue
            hd, wd = h.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_()
            ours = torch.autograd.grad(linear_cross_entropy(hd, wd, y, implementation=implementation), [hd, wd])
            plain = torch.autograd.grad(linear_cross_entropy(hd, wd, y, implementation="plain"), [hd, wd])
            error = max(float((a.double() - r).abs().max()) for a, r in zip(ours, reference))
            bound = max(2 * float((p.double() - r).abs().max()) + torch.finfo(dtype).eps * float(r.abs().max())
                        for p, r in zip(plain, reference))
            rows.append({"check": f"lce: {implementation} {str(dtype)[6:]} gradients vs fp64", "ok": error <= bound,
                         "metric": "max error (goal <= 2x plain's + 1 ulp)", "value": f"{error:.2e} <= {bound:.2e}"})
    size = (128256, 2048, 8192)
    for what, contender in (("head", "chunked"), ("step", "fused")):
        peaks = {}
        for c in ("plain", contender):
            step = _make(what, c, size, torch.bfloat16)
            step()
            torch.cuda.synchronize()
            with PeakMemory("cuda") as peak:
                step()
                torch.cuda.synchronize()
            peaks[c] = peak.bytes
            del step
            torch.cuda.empty_cache()
        sides = [Contender(c, _make(what, c, size, torch.bfloat16), device=torch.device("cuda"))
                 for c in ("plain", contender)]
        alternate(sides, warmup=2, rounds=8, steps_per_round=2, slow_factor=float("inf"), across_ranks=False)
        ratio = speedup(sides[1].round_seconds, sides[0].round_seconds)
        if what == "head":
            rows.append({"check": "lce: head peak memory, 128k x 2048 x 8192 bf16", "ok": peaks[contender] * 8 <=
                         peaks["plain"], "metric": "fused / plain (goal <= 0.125)",
                         "value": f"{peaks[contender] / peaks['plain']:.3f} ({_mib(peaks[contender])} of "
                                  f"{_mib(peaks['plain'])})"})
        rows.append({"check": f"lce: {what} time, 128k x 2048 x 8192 bf16", "ok": what == "head" or
                     ratio.median <= 1.05, "metric": "fused / plain" + (" (goal <= 1.05)" if what == "step" else ""),
                     "value": f"{ratio.median:.2f}x ({ratio.low:.2f}-{ratio.high:.2f})"})
        if what == "step":
            rows.append({"check": "lce: step peak memory, 128k x 2048 x 8192 bf16", "ok": peaks[contender] <
                         peaks["plain"], "metric": "fused / plain (goal < 1)",
                         "value": f"{peaks[contender] / peaks['plain']:.3f}"})
    return rows


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:,.0f} MiB"


def main(argv=None) -> List[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="50257x1024x4096,128256x2048x4096")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--what", default="head,step")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk-mib", type=int, help="the chunked head's slice of fp32 logits, in MiB (default: "
                                                      "the op's own)")
    parser.add_argument("--checkpointing", action="store_true",
                        help="the step with Hugging Face's activation checkpointing, plain and fused alike")
    parser.add_argument("--quick", action="store_true", help="one small size, two rounds, 8 MiB slices (the test "
                                                             "suite's run)")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)
    global CHUNK_MIB, CHECKPOINTING
    CHECKPOINTING = args.checkpointing
    if args.quick:
        args.sizes, args.rounds, args.chunk_mib = "16384x64x1024", 2, 8
    CHUNK_MIB = args.chunk_mib
    import logging
    logging.getLogger("aiak").setLevel(logging.WARNING)       # not the summary of each contender's optimize()
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.rounds} alternating rounds"
          + (", the step with activation checkpointing" if args.checkpointing else ""))
    print(f"{'what':5} {'size (V x H x N)':22} {'dtype':5} {'contender':8} {'peak above start':>17} "
          f"{'vs plain':>9} {'step (p10-p90)':>22} {'time vs plain (CI)':>24}")
    rows = []
    for what in args.what.split(","):
        for size_text in args.sizes.split(","):
            size = _parse_size(size_text)
            for dtype_name in args.dtypes.split(","):
                dtype = DTYPES[dtype_name]
                contenders = (["plain", "chunked"] + (["torch"] if dtype == torch.float32 and hasattr(
                    torch.nn, "LinearCrossEntropyOptions") else [])) if what == "head" else ["plain", "fused"]
                peaks = {c: peak_in_a_fresh_process(what, c, size, dtype_name) for c in contenders}
                times = timed(what, contenders, size, dtype, args.rounds)
                for c in contenders:
                    t = times[c]
                    s = t["seconds"]
                    low, high = t["time_ratio_interval"]
                    peak, base = peaks[c]["step"], peaks[contenders[0]]["step"]
                    row = {"what": what, "size": size_text, "dtype": dtype_name, "contender": c, "peak_bytes": peak,
                           "memory_ratio": peak / base, **t}
                    fb = peaks[c].get("forward_backward")
                    if fb is not None:
                        row["forward_backward_bytes"] = fb
                        row["forward_backward_ratio"] = fb / peaks[contenders[0]]["forward_backward"]
                    rows.append(row)
                    extra = (f"   forward+backward {_mib(fb)}, {row['forward_backward_ratio']:.2f}x"
                             if fb is not None else "")
                    print(f"{what:5} {size_text:22} {dtype_name:5} {c:8} {_mib(peak):>17} "
                          f"{row['memory_ratio']:>8.2f}x {s['median'] * 1e3:>8.0f} ms ({s['p10'] * 1e3:.0f}-"
                          f"{s['p90'] * 1e3:.0f}) {t['time_ratio']:>8.2f}x ({low:.2f}-{high:.2f}x){extra}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()

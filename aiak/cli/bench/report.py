"""What ``aiak bench`` prints: per-contender statistics, the table and the plot."""
from __future__ import annotations

import statistics
from typing import List

from aiak.cli.bench.runs import Entry, Memory, World


# ------------------------------------------------------------------------------------------ the report

def contender_stats(e: Entry, baseline: Entry, batch: int, world: World, memory: Memory) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from aiak.measure.rounds import Spread, speedup

    out = {"ddp": e.loop is not None and isinstance(e.loop.model, DDP),
           "step_ms": None, "samples_per_s": None, "peak_mem_mb": None, "mem_kind": memory.kind,
           "setup_s": e.setup_s, "final_loss": None, "speedup": None, "speedup_interval": None,
           "verdict": None, "stopped": None, "failed": e.failed, "linearity": None,
           "single_worker_samples_per_s": None}
    if e.decision is not None:
        out["decision"] = e.decision
    if e.failed:
        out["verdict"] = "failed"
        return out
    c = e.contender
    step = Spread.of(c.step_seconds).scaled(1e3)
    out.update(step_ms={"median": step.median, "p10": step.p10, "p90": step.p90}, final_loss=c.loss,
               samples_per_s=batch * world.size / (step.median / 1e3), stopped=c.stopped)
    if e.name in memory.peak:
        out["peak_mem_mb"] = memory.peak[e.name] / 2 ** 20
    if e is not baseline:
        if c.stopped:
            out.update(verdict="stopped", speedup=baseline.contender.step_seconds[0] / c.step_seconds[0])
        else:
            ratio = speedup(baseline.contender.round_seconds, c.round_seconds)
            out.update(speedup=ratio.median, speedup_interval=ratio.to_dict(), verdict=ratio.verdict,
                       describe=ratio.describe())
    if e.solo is not None and e.solo.step_seconds and not e.solo_loop.failure:
        solo = statistics.median(e.solo.step_seconds)
        out["single_worker_samples_per_s"] = batch / solo
        out["linearity"] = solo / (step.median / 1e3)
    return out


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def render_table(report: dict, entries: List[Entry]) -> str:
    distributed = report["world_size"] > 1
    memory = "peak CUDA MB" if report["mem_kind"] == "cuda" else "peak RSS MB"
    rows = [("contender", "step ms", "p10-p90 ms", "samples/s", memory, "setup s", "speedup",
             "final loss") + (("linearity",) if distributed else ())]
    notes = []
    for e in entries:
        r = report["baseline"] if e.name == "baseline" else report["strategies"][e.name]
        step = r["step_ms"] or {}
        if e.name == "baseline":
            versus = "(ref)"
        elif r["failed"]:
            versus = "failed"
        elif r["stopped"]:
            versus = f"stopped ({r['speedup']:.2f}x)"
        else:
            versus = f"{r['speedup']:.2f}x" + ("" if r["verdict"] in ("faster", "slower") else " ~")
        spread = f"{step['p10']:.1f}-{step['p90']:.1f}" if step else "-"
        rows.append((e.name, _fmt(step.get("median"), ".1f"), spread, _fmt(r["samples_per_s"], ".1f"),
                     _fmt(r["peak_mem_mb"], ".0f"), f"{r['setup_s']:.2f}", versus, _fmt(r["final_loss"], ".4f"))
                    + ((_fmt(r["linearity"], ".2f"),) if distributed else ()))
        if e.name == "baseline":
            continue
        if r["failed"]:
            notes.append(f"  {e.name}: {r['failed']}")
        elif r["stopped"]:
            notes.append(f"  {e.name}: {r['stopped']}")
        else:
            notes.append(f"  {e.name}: {r['describe']}")
        changed = (r.get("decision") or {}).get("changed") or {}
        changed = {k: v for k, v in changed.items() if not k.startswith("tune")}
        if changed:
            notes.append("    applied: " + ", ".join(f"{k}={v}" for k, v in changed.items()))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  " + "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                              for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    legend = ("  speedup: baseline step / contender step, median of the per-round ratios; '~' = within noise or too "
              "few rounds (see below)")
    if distributed:
        legend += ("\n  linearity: multi-worker throughput / single-worker throughput / workers (single worker: rank "
                   "0 alone, unwrapped)")
    return "\n".join(lines + [legend, ""] + notes)


def draw_plot(path: str, entries: List[Entry], warmup: int, title: str) -> None:
    """Step time (ms) against each contender's own step index, warm-up included and shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5), dpi=100)
    highest, lowest = 0.0, float("inf")
    for e in entries:
        if e.failed:
            continue
        ms = [s * 1e3 for s in e.contender.warmup_seconds + e.contender.step_seconds]
        label = e.name + (" (stopped)" if e.contender.stopped else "")
        ax.plot(range(1, len(ms) + 1), ms, marker="o", markersize=3, linewidth=1.2, label=label)
        highest, lowest = max(highest, max(ms)), min(lowest, min(ms))
    if warmup:
        ax.axvspan(0.5, warmup + 0.5, color="0.9", zorder=0, label="warm-up (not timed)")
    if lowest > 0 and highest / lowest > 20:
        ax.set_yscale("log")
    ax.set_xlabel("step (each contender's own; the contenders alternate in rounds)")
    ax.set_ylabel("step time (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)



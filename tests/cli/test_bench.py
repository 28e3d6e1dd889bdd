"""``aiak bench`` run as a user runs it (``python -m aiak.cli bench``), on real models, strategies and ranks.

No timing is asserted: the figures' structure is, and what must hold whatever the machine's speed (the verdict
follows from the interval; plain PyTorch under another name ends at the baseline's loss exactly; a strategy
measured ~27x slower is stopped).
"""
import json
import math
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VERDICTS = {"faster", "slower", "within noise", "too few rounds"}
CONTENDER_KEYS = {"step_ms", "samples_per_s", "peak_mem_mb", "mem_kind", "setup_s", "final_loss", "speedup",
                  "speedup_interval", "verdict", "stopped", "linearity"}
TINY = ("--steps", "2", "--rounds", "2", "--warmup", "1")


def run(*argv, timeout=240, prefix=("-m", "aiak.cli", "bench")):
    out = subprocess.run([sys.executable, *prefix, *argv], capture_output=True, text=True, timeout=timeout,
                         cwd=REPO)
    return out.returncode, out.stdout, out.stderr


def bench_json(*argv, timeout=240):
    """Runs bench with ``--json``; the report is the last line of stdout, and stdout holds nothing else."""
    code, out, err = run(*argv, "--json", "--no-progress", timeout=timeout)
    assert code == 0 and "Traceback" not in err, err[-3000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out[-3000:]
    return json.loads(lines[-1]), err


def verdict_of(interval):
    """The verdict that Speedup's interval allows (aiak.measure.rounds's rule, restated)."""
    if interval["rounds"] < 6:
        return "too few rounds"
    if interval["low"] > 1.0:
        return "faster"
    if interval["high"] < 1.0:
        return "slower"
    return "within noise"


def test_json_has_every_key_and_each_verdict_follows_from_its_interval():
    report, err = bench_json("--model", "demo", "--batch-size", "16", "--steps", "6", "--rounds", "6", "--warmup",
                             "1", "--strategy", "default", "--strategy", "auto")
    assert {"model", "device", "batch_size", "world_size", "steps", "warmup", "rounds", "baseline", "strategies",
            "speedup"} <= set(report)
    assert (report["model"], report["device"], report["batch_size"], report["world_size"]) == ("demo", "cpu", 16, 1)
    assert (report["steps"], report["warmup"], report["rounds"]) == (6, 1, 6)
    assert list(report["strategies"]) == ["default", "auto"]
    for name, r in [("baseline", report["baseline"]), *report["strategies"].items()]:
        assert CONTENDER_KEYS <= set(r), name
        step = r["step_ms"]
        assert 0 < step["p10"] <= step["median"] <= step["p90"], name
        assert r["samples_per_s"] == pytest.approx(16 / (step["median"] / 1e3), rel=1e-9)
        assert r["mem_kind"] == "rss" and r["peak_mem_mb"] > 0 and r["setup_s"] >= 0
        assert r["stopped"] is None and r["linearity"] is None and math.isfinite(r["final_loss"])
    for name, r in report["strategies"].items():
        interval = r["speedup_interval"]
        assert isinstance(r["speedup"], float) and r["speedup"] == interval["median"] > 0
        assert interval["low"] <= interval["median"] <= interval["high"] and interval["rounds"] == 6
        assert r["verdict"] in VERDICTS and r["verdict"] == interval["verdict"] == verdict_of(interval), name
    assert report["speedup"] == report["strategies"]["default"]["speedup"]   # the first strategy's
    # same weights, same batches, same random stream: plain PyTorch under the name "default" ends where it does
    assert report["strategies"]["default"]["final_loss"] == report["baseline"]["final_loss"]
    assert report["strategies"]["auto"]["decision"]["strategy"]                # what auto chose is recorded
    # with --json the table goes to stderr: one row per contender
    assert [row[0] for row in table_rows(err)] == ["baseline", "default", "auto"], err


def table_rows(text):
    """The cells of the table's rows: from the header to the legend."""
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:3] == ["contender", "step", "ms"])
    rows = []
    for line in lines[head + 1:]:
        if line.strip().startswith("speedup:"):
            return rows
        rows.append(line.split())
    raise AssertionError(f"no legend after the table:\n{text}")


def test_default_reads_within_noise():
    """Plain PyTorch against itself over 16 rounds is never a speedup: the 99.6% interval of the per-round ratio
    holds 1.00x, or the median is within the noise floor (CI once read "1.01x faster (99.6% CI 1.00-1.02x)")."""
    # A stretch of the machine 20x slower once made every step `default` ran slow (345-356 ms, where the baseline's
    # fastest had taken 15 ms), and the 10x rule stopped it: that is the load's doing, so it is measured again once.
    for _ in range(2):
        code, out, _ = run("--model", "demo", "--batch-size", "8", "--steps", "16", "--rounds", "16", "--warmup", "2",
                           "--strategy", "default", "--no-progress")
        assert code == 0
        line = next(line for line in out.splitlines() if line.strip().startswith("default:"))
        if "stopped after" not in line:
            break
    # within noise, or on a loaded machine no verdict at all (aiak.measure.rounds.Speedup.too_noisy): never a ratio
    assert ("within noise" in line or "no verdict: the machine was too busy" in line) and "16 rounds" in line, out
    low, high = (float(v) for v in re.search(r"(?:CI|span) ([\d.]+)-([\d.]+)x", line).groups())
    assert low <= 1.0 <= high or "never called a speedup" in line, line


@pytest.mark.slow
@pytest.mark.parametrize("spec, shape, batch", [
    ("timm:resnet18", "3,32,32", "4"),
    ("torchvision:shufflenet_v2_x0_5", "3,32,32", "4"),
    ("hf:distilbert", "16", "2"),          # text: dropout in training, so the equal losses need the random streams
], ids=["timm", "torchvision", "hf-text"])
def test_model_specs_run_through_bench(spec, shape, batch):
    report, _ = bench_json("--model", spec, "--input-shape", shape, "--batch-size", batch, *TINY,
                           "--strategy", "default")
    assert report["model"] == spec and report["description"].startswith(spec)
    base, default = report["baseline"], report["strategies"]["default"]
    assert base["step_ms"]["median"] > 0 and default["step_ms"]["median"] > 0
    assert math.isfinite(base["final_loss"]) and default["final_loss"] == base["final_loss"]


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """One demo run with --trace and --plot."""
    where = tmp_path_factory.mktemp("bench-trace")
    report, err = bench_json("--model", "demo", "--batch-size", "8", *TINY, "--strategy", "default",
                             "--trace", str(where / "traces"), "--plot", str(where / "steps.png"))
    return report, where


def test_trace_files_load_and_hold_the_steps_ops(traced):
    report, where = traced
    assert sorted(p.name for p in (where / "traces").iterdir()) == ["baseline.json", "default.json"]
    for name in ("baseline", "default"):
        events = json.loads((where / "traces" / f"{name}.json").read_text())["traceEvents"]
        names = [e.get("name", "") for e in events]
        assert "aten::convolution" in names and "aten::convolution_backward" in names, name   # forward, backward
        assert any(n.startswith("Optimizer.step#SGD.step") for n in names), name               # the optimizer step
        assert sum(n.startswith(f"aiak.cli.bench {name} step ") for n in names) == 3, name          # 3 steps traced
    assert report["traces"]["default"].endswith("default.json")


def test_plot_is_a_png_of_sensible_size(traced):
    _, where = traced
    data = (where / "steps.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 200 and height > 200


SLOW_IN_HALF = '''
import time

import torch
from torch import nn


class SlowInHalf(nn.Module):
    """A model whose forward takes a second longer once its weights are half precision: a real model that is
    slow under one strategy (as fp16 on a CPU is, ~27x, though how much depends on the machine's load)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(8, 10))

    def forward(self, x):
        if self.body[0].weight.dtype != torch.float32:
            time.sleep(1.0)
        return self.body(x)


def build():
    return SlowInHalf(), (3, 16, 16)
'''


@pytest.mark.slow
def test_a_strategy_ten_times_slower_is_stopped_and_reported(tmp_path):
    (tmp_path / "model.py").write_text(SLOW_IN_HALF)
    profile = tmp_path / "bf16.yaml"
    profile.write_text("extends: default\nprecision: {level: O2, dtype: bf16}\n")
    report, err = bench_json("--model", f"{tmp_path / 'model.py'}:build", "--batch-size", "4",
                             "--steps", "6", "--rounds", "3", "--warmup", "1", "--strategy", "default",
                             "--strategy", str(profile))
    slow = report["strategies"][str(profile)]
    assert slow["stopped"].startswith("stopped after its first 3 timed steps")
    assert "10x the baseline" in slow["stopped"]
    # the rule compared fastest steps (10x); the speedup reported is the medians' ratio, which a loaded machine moves:
    # the fresh-clone CI of 56a01b5 read 0.112, the baseline's median steps slowed by the tests beside it
    assert slow["verdict"] == "stopped" and slow["speedup"] < 0.5 and slow["speedup_interval"] is None
    assert report["strategies"]["default"]["stopped"] is None
    assert report["strategies"]["default"]["final_loss"] == report["baseline"]["final_loss"]
    assert f"{profile}: stopped after its first 3 timed steps" in err           # in the table's notes too


FIXED_ANCHOR = '''
import torch
from torch import nn


class FixedAnchor(nn.Module):
    """Blends its input with a plain tensor attribute (neither a parameter nor a buffer) by torch.lerp, which wants both
    in one dtype: O2's bf16 input beside the fp32 attribute fails in the step (autocast does not cast lerp)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(8, 10))
        self.anchor = torch.randn(3, 16, 16)

    def forward(self, x):
        return self.body(torch.lerp(x, self.anchor, 0.5))


def build():
    return FixedAnchor(), (3, 16, 16)
'''


def test_a_strategy_failing_in_its_step_is_reported_and_the_others_go_on(tmp_path):
    (tmp_path / "model.py").write_text(FIXED_ANCHOR)
    (tmp_path / "bf16.yaml").write_text("extends: default\nprecision: {level: O2, dtype: bf16}\n")
    code, out, err = run("--model", f"{tmp_path / 'model.py'}:build", "--batch-size", "4", *TINY,
                         "--strategy", str(tmp_path / "bf16.yaml"), "--strategy", "default", "--json",
                         "--no-progress")
    assert code == 1 and "Traceback" not in err, err[-3000:]
    report = json.loads(out.splitlines()[-1])
    failed = report["strategies"][str(tmp_path / "bf16.yaml")]
    assert failed["verdict"] == "failed" and failed["step_ms"] is None
    assert failed["failed"].startswith("failed in its step 1: RuntimeError") and "dtype" in failed["failed"]
    default = report["strategies"]["default"]
    assert default["failed"] is None and default["step_ms"]["median"] > 0 and default["verdict"] in VERDICTS


BLOCK_MATPLOTLIB = ("import sys; sys.modules['matplotlib'] = None; from aiak.cli import main; "
                    "sys.exit(main(['bench', '--plot', 'steps.png']))")


@pytest.mark.parametrize("argv, names", [
    (("--steps", "0"), "argument --steps: must be a whole number >= 1"),
    (("--rounds", "0"), "argument --rounds: must be a whole number >= 1"),
    (("--steps", "3", "--rounds", "5"), "argument --steps: must be at least --rounds (5)"),
    (("--batch-size", "-1"), "argument --batch-size: must be a whole number >= 1"),
    (("--warmup", "-1"), "argument --warmup: must be a whole number >= 0"),
    (("--input-shape", "3,x"), "argument --input-shape: bad input shape '3,x'"),
    (("--model", "nope"), "unknown model spec 'nope'"),
    (("--strategy", "nope"), "argument --strategy 'nope': strategy: unknown profile 'nope'"),
    (("--strategy", "default", "--strategy", "default"), "argument --strategy: 'default' is given twice"),
    (("--device", "cuda"), "argument --device: 'cuda': CUDA is not available here"),
    (("--trace", "{file}/traces"), "argument --trace: cannot write traces to"),
    (("--plot", "steps.txt"), "argument --plot: 'steps.txt' has no image suffix"),
    (None, '--plot needs matplotlib: pip install "aiak[plot]"'),
], ids=["steps", "rounds", "steps<rounds", "batch", "warmup", "shape", "model", "strategy", "twice", "device",
        "trace-dir", "plot-suffix", "no-matplotlib"])
def test_bad_arguments_are_one_line_and_exit_2(argv, names, tmp_path):
    if argv is None:
        code, out, err = run(prefix=("-c", BLOCK_MATPLOTLIB))
    else:
        (tmp_path / "file").write_text("")
        code, out, err = run(*(a.format(file=tmp_path / "file") for a in argv))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("aiak") and names in lines[0], err
    assert "Traceback" not in err and out == ""


def test_a_default_adapts_to_the_value_given_and_only_two_given_values_conflict():
    """``--steps 6`` alone once failed ("must be at least --rounds (20)"): the rounds default now follows the steps,
    the steps default the rounds; two values the user gave that conflict are still one error line."""
    report, _ = bench_json("--model", "demo", "--batch-size", "8", "--steps", "6", "--warmup", "1",
                           "--strategy", "default")
    assert (report["steps"], report["rounds"]) == (6, 6)
    report, _ = bench_json("--model", "demo", "--batch-size", "8", "--rounds", "7", "--warmup", "1",
                           "--strategy", "default")
    assert report["rounds"] == 7 and report["steps"] == 7 * (40 // 7)  # the default 40, cut into 7 rounds of 5
    code, _, err = run("--steps", "3", "--rounds", "5")
    assert code == 2 and "must be at least --rounds (5)" in err


def test_help_describes_every_option_with_its_default():
    code, out, _ = run("--help")
    assert code == 0
    text = " ".join(out.split())
    for option in ("--model", "--strategy", "--batch-size", "--input-shape", "--steps", "--warmup", "--rounds",
                   "--device", "--json", "--trace", "--plot", "--no-progress"):
        assert option in text
    for default in ("(default: demo)", "(default: auto)", "(default: 40, or --rounds", "(default: 5)",
                    "(default: 20, or --steps",
                    "(default: 64 for demo, 32 otherwise)"):
        assert default in text, default


@pytest.mark.slow
def test_torchrun_reports_linearity_from_rank_0_only():
    code, out, err = run("--standalone", "--nproc-per-node", "2", "-m", "aiak.cli", "bench", "--model", "demo",
                         "--batch-size", "8", "--steps", "6", "--rounds", "6", "--warmup", "1",
                         "--strategy", "default", "--strategy", "large_batch", "--json", "--no-progress",
                         prefix=("-m", "torch.distributed.run"), timeout=240)
    assert code == 0 and "Traceback" not in err, err[-3000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out                                  # rank 0's JSON, and nothing from rank 1
    assert sum(line.split()[:3] == ["contender", "step", "ms"] for line in err.splitlines()) == 1, err  # one table
    assert [row[0] for row in table_rows(err)] == ["baseline", "default", "large_batch"]
    report = json.loads(lines[0])
    assert report["world_size"] == 2
    for name, r in [("baseline", report["baseline"]), *report["strategies"].items()]:
        assert r["ddp"] is True, name                            # the baseline too: a fair plain-PyTorch DDP
        assert isinstance(r["linearity"], float) and r["linearity"] > 0, name
        assert r["linearity"] == pytest.approx(r["samples_per_s"] / r["single_worker_samples_per_s"] / 2)
        assert r["samples_per_s"] == pytest.approx(8 * 2 / (r["step_ms"]["median"] / 1e3))
    assert report["strategies"]["default"]["final_loss"] == report["baseline"]["final_loss"]

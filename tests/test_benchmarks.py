"""Benchmarks stay runnable: every script imports, and the quick ones run end to end on CPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_imports_without_running(name):
    code = f"import sys; sys.path.insert(0, 'benchmarks'); import {name}; assert callable({name}.main)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_gpu_check_without_cuda_says_so_and_passes():
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "no CUDA device here" in out.stdout


def test_overhead_quick_reports_the_ratio():
    out = subprocess.run([sys.executable, "benchmarks/overhead.py", "--quick"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "default / plain =" in out.stdout


def test_fused_step_times_each_optimizer_as_built_and_fused(tmp_path):
    """benchmarks/fused_step.py on its two small sets, three rounds: a row per set and optimizer, both sides timed
    (the script asserts that aiak turned the fused step on)."""
    report = tmp_path / "fused.json"
    out = subprocess.run([sys.executable, "benchmarks/fused_step.py", "--sets", "small,mlp", "--rounds", "3",
                          "--warmup", "1", "--json", str(report)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = json.loads(report.read_text())
    assert [(r["set"], r["optimizer"]) for r in rows] == [(s, o) for s in ("small", "mlp")
                                                          for o in ("SGD(momentum)", "AdamW", "Adam", "Adagrad")]
    assert all(r["default_ms"][0] > 0 and r["fused_ms"][0] > 0 for r in rows)


def test_separate_processes_times_each_side_in_processes_of_its_own(tmp_path):
    """benchmarks/separate_processes.py, one round of three steps: on the demo model plain against malloc_retain
    (the retained side asserts that the knob applied, and paged in fewer pages a step), on the MLP plain against
    auto (its optimize() and trials inside the whole run timed)."""
    for sides, model in (("plain,retain", "demo"), ("plain,auto", "mlp")):
        report = tmp_path / f"{model}.json"
        out = subprocess.run([sys.executable, "benchmarks/separate_processes.py", "--sides", sides, "--models", model,
                              "--rounds", "1", "--warmup", "2", "--steps", "3", "--json", str(report)], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        (row,) = json.loads(report.read_text())
        first, second = sides.split(",")
        assert row["model"] == model and len(row["ratios"]) == len(row["run_ratios"]) == 1
        assert all(row[f"{side}_{k}"] > 0 for side in (first, second) for k in ("ms", "run_s"))
        if second == "retain":   # fewer pages a step wherever plain paged at all (glibc's adapting thresholds
            # keep a whole step in some runs: a fresh clone's CI read 0 and 0)
            assert row["retain_faults"] < row["plain_faults"] or row["plain_faults"] == 0, row


def test_fused_steps_gpu_rows_run_on_cpu():
    """The rows gpu_check.py's optim section adds for the fused step, on the CPU: both optimizers equal torch's
    default within the goal, and each has its timing row."""
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import json, fused_step; "
            "print(json.dumps(fused_step.gpu_checks('cpu')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["check"].split(" (")[0] for r in rows] == [
        "optim: SGD(momentum) fused step vs torch's default", "optim: SGD(momentum) default step / fused step",
        "optim: AdamW fused step vs torch's default", "optim: AdamW default step / fused step"]
    assert rows[0]["ok"] and rows[2]["ok"]


def test_root_scaling_times_both_factors():
    """benchmarks/root_scaling.py, one round on the small MLP: a row for fp16's factor and one for counted items (it
    once broke when the graph walk grew a third result, with no test to say so)."""
    out = subprocess.run([sys.executable, "benchmarks/root_scaling.py", "--models", "mlp", "--rounds", "1",
                          "--repeats", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mlp fp16" in out.stdout and "mlp items" in out.stdout


def test_precision_cpu_one_round_of_fp8_against_bf16():
    """benchmarks/precision_cpu.py, where the emulation warnings' costs come from: one round on the MLP (its CPU
    line once imported names that had moved, with no test to say so)."""
    out = subprocess.run([sys.executable, "benchmarks/precision_cpu.py", "--models", "mlp", "--candidates",
                          "O2 bf16,fp8 rowwise", "--baseline", "O2 bf16", "--rounds", "1", "--warmup", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line[len("mlp"):].strip() for line in out.stdout.splitlines() if line.startswith("mlp ")]
    assert [r.split("  ")[0] for r in rows] == ["fp32", "O2 bf16", "fp8 rowwise"], out.stdout
    assert rows[1].split()[-1] == "1.00x"  # the baseline against itself


def test_pointwise_conv_times_every_1x1_layer_and_each_step_variant():
    """benchmarks/pointwise_conv.py on timm's ResNet-18 (three 1x1 shortcut convolutions), one round: a row for each
    layer and their sum, and a step row for each layout and precision with and without the matrix multiplies."""
    from aiak.util.machine.cpu import has_native_bf16_cpu

    out = subprocess.run([sys.executable, "benchmarks/pointwise_conv.py", "--model", "resnet18", "--size", "32",
                          "--batch", "4", "--rounds", "2", "--warmup", "0"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "3 such layers" in out.stdout
    layers = out.stdout.split("== layers")[1].split("== steps")[0].splitlines()[2:]
    assert len([line for line in layers if line.strip()]) == 4 and layers[3].split()[0] == "sum", out.stdout
    steps = [line.strip().split("  ")[0] for line in out.stdout.split("== steps")[1].splitlines()[2:] if line.strip()]
    variants = ["fp32", "fp32 +1x1mm", "fp32 +cl", "fp32 +cl +1x1mm"]
    assert steps == variants + ([v.replace("fp32", "O1 bf16") for v in variants] if has_native_bf16_cpu() else []), \
        out.stdout


def test_fp8_loss_rows_run_here_under_emulation():
    """benchmarks/fp8.py on the CPU: the loss rows of gpu_check's fp8 section, at a small width (torchao emulates
    fp8 here; the timed rows need CUDA and are not taken)."""
    out = subprocess.run([sys.executable, "benchmarks/fp8.py", "--widths", "32", "--steps", "20"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    rows = [line.strip().split(": vs bf16")[0] for line in out.stdout.splitlines() if line.startswith("  ")]
    assert rows == ["ok  fp8: width 32 tensorwise loss after 20 steps", "ok  fp8: width 32 rowwise loss after 20 steps"], \
        out.stdout + out.stderr[-2000:]
    assert out.returncode == 0 and "fp8 tensor cores: no (emulated)" in out.stdout


def test_auto_quick_sweeps_the_space_and_charges_auto_its_tuning(tmp_path):
    report = tmp_path / "auto.json"
    out = subprocess.run([sys.executable, "benchmarks/auto.py", "--quick", "--loss-perturbations", "1", "--json",
                          str(report)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    results = {r["model"]: r for r in json.loads(report.read_text())["results"]}
    assert set(results) == {"demo", "mlp"}
    # exhaustive without compile: each precision x channels_last on/off (DemoNet has convolutions; the MLP none);
    # fp16 joins the precisions only on a CPU that computes it natively (AVX512-FP16 / AMX-FP16)
    from aiak.strategy.probes import probe

    precisions = ["fp32", "O1 bf16", "O2 bf16"] + (["O1 fp16", "O2 fp16"] if probe().fp16_native else [])
    oracle = {m: sorted(row["label"] for row in r["rows"] if row["label"] not in ("plain", "auto", "auto effective"))
              for m, r in results.items()}
    assert oracle["demo"] == sorted(precisions + [p + " +cl" for p in precisions])
    assert oracle["mlp"] == sorted(precisions)
    for r in results.values():
        rows = {row["label"]: row for row in r["rows"]}
        assert "cache hit" not in r["auto_note"] and r["auto_tuning_s"] > 0  # a fresh cache: the trials ran
        assert r["auto_optimize_s"] >= r["auto_tuning_s"]
        # the effective step carries optimize()'s time (and any warm-up excess) over 200 steps
        extra = rows["auto effective"]["median_ms"] - rows["auto"]["median_ms"]
        assert extra >= r["auto_optimize_s"] / 200 * 1e3 * (1 - 1e-6)
        assert {g["goal"] for g in r["goals"]} >= {"auto effective / oracle best", "auto effective / plain",
                                                   "final loss"}
        # the loss tolerance widens to plain's own spread: a plain run from weights moved by a rounding-sized step
        (moved,) = r["plain_perturbed_diffs"]
        assert moved != 0.0   # the weights did move
        assert r["loss_tolerance"] == max(0.05 * r["losses"]["plain"], 0.02, abs(moved))
    assert "demo: auto effective / plain" in {g["goal"] for g in results["demo"]["goals"]}
    assert out.stdout.count("goal >= ") >= 5 and "oracle best" in out.stdout


def test_o2_compute_quick_compares_old_and_new_o2(tmp_path):
    import re

    report = tmp_path / "o2.json"
    out = subprocess.run([sys.executable, "benchmarks/o2_compute.py", "--quick", "--json", str(report)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("same training: yes") == 2
    for model in ("demo", "mlp"):  # a table row per model: old ms, new ms, peak MB, new vs old ratio + verdict
        # a ratio with its verdict, or on a loaded machine no ratio at all (aiak.measure.rounds.Speedup.too_noisy)
        assert re.search(rf"^{model} .*(\d+\.\d\dx(, within noise| faster| slower| \()|no verdict: the machine was "
                         rf"too busy to tell)", out.stdout, re.M), out.stdout
    results = {r["model"]: r for r in json.loads(report.read_text())["results"]}
    assert set(results) == {"demo", "mlp"}
    for r in results.values():
        assert r["speedup"]["rounds"] >= 6 and r["max_dw"] <= 2e-3
        assert set(r["memory"]) == {"old", "new"}


def test_comm_algorithms_quick_trains_every_algorithm_and_times_the_step_row(tmp_path):
    """The time-to-accuracy benchmark on loopback ranks (no root): every contender trains through its own
    ``comm.algorithm`` (the description each DDP gives of itself), learns, and reports; the goals are judged
    n/a off the slow link they are set for."""
    report = tmp_path / "algorithms.json"
    out = subprocess.run([sys.executable, "benchmarks/comm_algorithms.py", "--quick", "--loopback", "--workloads",
                          "mlp", "--step-params-m", "1", "--json", str(report)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(report.read_text())
    runs = result["workloads"]["mlp"]["runs"]
    described = {label: r[0]["comm"] for label, r in runs.items()}
    assert described["DDP"] == "flat" and described["hierarchical+int8"] == "hierarchical+int8"
    assert described["local_sgd"] == \
        "local SGD: period 8, warm-up 20 steps, hierarchical+fp16 in warm-up and averages"
    assert described["decentralized"] == "decentralized SGD: peers shift_one"
    assert described["powersgd"] == "PowerSGD: rank 4, warm-up 20 steps, hierarchical sums"
    for label, (run,) in runs.items():
        assert run["error"] is None and not run["diverged"] and run["steps"] == 200, label
        assert run["final_loss"] < 0.2 * run["curve"][0][1], label  # trained: the held-out loss fell 5x
    ddp_run = runs["DDP"][0]
    assert ddp_run["steps_to_target"] is not None and ddp_run["first_at_target"] <= ddp_run["steps_to_target"]
    held = [h for step, h, _ in ddp_run["curve"] if step >= ddp_run["steps_to_target"]][:3]
    assert len(held) == 3 and max(held) <= result["workloads"]["mlp"]["target"]  # the target holds from there
    step = result["step"]
    assert set(step["samples"]) == {"DDP", "hierarchical+int8", "powersgd"}
    assert all(len(s) == 2 and min(s) > 0 for s in step["samples"].values())
    goals = {g["goal"]: g["verdict"] for g in result["goals"]}
    assert sum(g.startswith("convergence, ") for g in goals) == 4
    assert [step for step, *_ in runs["DDP"][0]["curve"][:3]] == [0, 5, 10]  # evaluated every 5 steps
    ddp_final = runs["DDP"][0]["final_loss"]
    for label, (run,) in runs.items():  # one seed: DDP's range is its one final loss
        if label != "DDP":
            verdict = goals[f"convergence, {label} (mlp): final held-out loss within DDP's seed range and steps to "
                            "target <= 1.1x DDP's"]
            assert ("final loss above DDP's range" in verdict) == (run["final_loss"] > ddp_final), verdict
            assert ("final loss below DDP's range" in verdict) == (run["final_loss"] < ddp_final), verdict
    assert all("n/a" in v for g, v in goals.items() if not g.startswith("convergence, "))


def test_comm_algorithms_target_counts_where_it_holds_not_at_a_dip():
    """Steps to target: the first evaluation from which 3 in a row are at or below the target; a streak the run's
    end cuts short counts."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from comm_algorithms import reached_target

    dip = [[5, 0.2, 1.0], [10, 0.1, 2.0], [15, 0.3, 3.0], [20, 0.1, 4.0], [25, 0.11, 5.0], [30, 0.1, 6.0]]
    assert reached_target(dip, 0.12) == (20, 4.0)        # not 10: it came back above at 15
    assert reached_target(dip[:5], 0.12) == (20, 4.0)    # two evaluations left at the end: they hold
    assert reached_target(dip[:3], 0.12) == (None, None)
    assert reached_target(dip, 0.05) == (None, None)


def test_gpu_checks_comm_algorithm_rows_run_on_cpu():
    """benchmarks/gpu_check.py's rows for the comm algorithms, on a one-rank gloo world on CPU (the same code
    the GPU runs, on another device): each row runs and holds its check (one rank: the sums change nothing, so
    aiak's PowerSGD gives torch's hook's gradients bit for bit)."""
    code = ("import json, sys, tempfile, torch, torch.distributed as dist; sys.path.insert(0, 'benchmarks'); "
            "import comm_netns\n"
            "with tempfile.TemporaryDirectory() as tmp:\n"
            "    dist.init_process_group('gloo', init_method=f'file://{tmp}/store', rank=0, world_size=1)\n"
            "    rows = comm_netns._algorithm_rows(torch.device('cpu'))\n"
            "    dist.destroy_process_group()\n"
            "print(json.dumps({r['check']: r['ok'] for r in rows}))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert rows == {"comm: decentralized SGD (peers all) on cuda/nccl, one rank": True,
                    "comm: PowerSGD (rank 4) on cuda/nccl, one rank": True}


def test_compiled_precision_counts_graphs_and_times_the_four_sides():
    """benchmarks/compiled_precision.py on the MLP with the aot_eager backend, two rounds: the graph line (aiak no more
    than plain) and a row per side."""
    out = subprocess.run([sys.executable, "benchmarks/compiled_precision.py", "--models", "mlp", "--rounds", "2",
                          "--steps", "8", "--warmup", "2", "--backend", "aot_eager"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "graphs (breaks) plain 1 (0), aiak 1 (0)" in out.stdout, out.stdout
    for side in ("plain compiled", "aiak compiled", "aiak eager", "plain eager"):
        assert f"   {side} " in out.stdout, out.stdout
    assert "| mlp | 1 / 1 |" in out.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_memory_measures_a_rank_holding_half_the_training_state():
    """benchmarks/fsdp_memory.py on 2 gloo ranks (a small GPT-2, one round): each rank's parameters, gradients and
    AdamW state under aiak's FSDP2 are measured within 10% of half of DDP's (the goal line says met)."""
    out = subprocess.run([sys.executable, "benchmarks/fsdp_memory.py", "--worlds", "2", "--layers", "1", "--width",
                          "64", "--rounds", "1", "--steps", "1", "--warmup", "0"], cwd=ROOT, capture_output=True,
                         text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    row = next(line for line in out.stdout.splitlines() if line.split()[:2] == ["2", "fsdp2"])
    assert row.endswith("met") and not row.endswith("NOT met")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_linear_cross_entropy_measures_less_peak_memory_for_the_fused_head(tmp_path):
    """benchmarks/linear_cross_entropy.py --quick (16384 x 64 x 1024, two rounds, 8 MiB slices): every contender of
    the head and of the whole step has a row with its peak and its time ratio, and the chunked head's peak is under
    half of plain's (plain holds its 64 MiB of logits about three times over)."""
    report = tmp_path / "lce.json"
    out = subprocess.run([sys.executable, "benchmarks/linear_cross_entropy.py", "--quick", "--dtypes", "fp32",
                          "--json", str(report)], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {(r["what"], r["contender"]): r for r in json.loads(report.read_text())}
    assert {("head", "plain"), ("head", "chunked"), ("step", "plain"), ("step", "fused")} <= set(rows)
    assert rows["head", "chunked"]["peak_bytes"] < 0.5 * rows["head", "plain"]["peak_bytes"]
    assert all(r["time_ratio"] > 0 and r["rounds"] == 2 for r in rows.values())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_linear_cross_entropy_steps_with_activation_checkpointing(tmp_path):
    """--checkpointing: the whole step of both contenders with Hugging Face's activation checkpointing, said in the
    header; the fused step's peak stays under plain's."""
    report = tmp_path / "lce.json"
    out = subprocess.run([sys.executable, "benchmarks/linear_cross_entropy.py", "--quick", "--dtypes", "fp32",
                          "--what", "step", "--checkpointing", "--json", str(report)],
                         cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "the step with activation checkpointing" in out.stdout
    rows = {r["contender"]: r for r in json.loads(report.read_text())}
    assert set(rows) == {"plain", "fused"} and rows["fused"]["peak_bytes"] < rows["plain"]["peak_bytes"]

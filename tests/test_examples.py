"""The examples run as a user would start them (``--smoke``: CPU-small) and do what each one is for.

Every Python example ends with one before/after line (plain PyTorch vs aiak, alternated in rounds); it must parse,
with positive throughputs and finite held-out losses. Then each example's own point: train_cnn's checkpoint loads
into a fresh torchvision model (strict) and holds trained weights, train_swin's window attention is really fused,
train_transformer's balanced batches pad far less than plain shuffling, and multinode.sh's local mode runs 4 ranks
as 2 nodes whose weights end identical, leaving no network namespace behind.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aiak

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
BEFORE_AFTER = re.compile(
    r"^before/after: plain (?P<plain>[\d.]+) samples/s, aiak (?P<aiak>[\d.]+) samples/s: "
    r"(?P<speedup>\d+\.\d\dx(?: faster| slower|, within noise) \(\d+\.\d% CI \d+\.\d\d-\d+\.\d\dx, \d+ rounds"
    r"(?:; closer than \d+% to 1\.00x is never called a speedup)?\)"
    # a machine too busy for the rounds to agree gets no ratio (aiak.measure.rounds.Speedup.too_noisy)
    r"|no verdict: the machine was too busy to tell \(the rounds' ratios span \d+\.\d\d-\d+\.\d\dx, \d+\.\d% CI "
    r"over \d+ rounds, so their median \d+\.\d\dx means nothing\); run it again on an idle machine); "
    r"held-out loss plain (?P<plain_loss>\S+), aiak (?P<aiak_loss>\S+)$", re.MULTILINE)


def run_example(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, \
        f"{script} {' '.join(args)} exited {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def before_after(stdout: str) -> dict:
    """The before/after line, parsed: it is the last line, throughputs > 0, both losses finite."""
    match = BEFORE_AFTER.search(stdout)
    assert match, f"no parseable before/after line in:\n{stdout[-2000:]}"
    assert stdout.rstrip().endswith(match.group(0)), "the before/after line is not the last one"
    found = {k: (float(v) if k != "speedup" else v) for k, v in match.groupdict().items()}
    assert found["plain"] > 0 and found["aiak"] > 0, found
    assert math.isfinite(found["plain_loss"]) and math.isfinite(found["aiak_loss"]), found
    return found


def test_train_cnn_smoke_compares_and_saves_a_checkpoint_plain_torchvision_loads(tmp_path):
    import torchvision

    checkpoint = tmp_path / "cnn.pt"
    out = run_example("train_cnn.py", "--smoke", "--checkpoint", str(checkpoint))
    before_after(out.stdout)
    # the strategy applied: LARS, 2 accumulated micro-batches, O2 bf16 where this CPU computes bf16 (else fp32,
    # as the script says), prefetching
    emulated = "precision: fp32, since bf16 is emulated" in out.stdout
    effects = ["optimizer          Lars", "optimizer steps every 2 step() calls", "PrefetchLoader"]
    for effect in effects + ([] if emulated else ["O2 bf16: half compute copies of the fp32 parameters"]):
        assert effect in out.stderr, f"{effect!r} not in aiak's decision table:\n{out.stderr[-3000:]}"
    assert ("O2" not in out.stderr) == emulated

    saved = torch.load(checkpoint, weights_only=False)["model"]
    assert {t.dtype for t in saved.values() if t.is_floating_point()} == {torch.float32}
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(saved, strict=True)
    torch.manual_seed(0)  # the example's seed: the weights it started from
    initial = torchvision.models.resnet18(num_classes=10).state_dict()
    changed = [k for k, v in initial.items() if v.is_floating_point() and not torch.equal(v, saved[k])]
    assert "conv1.weight" in changed and "fc.weight" in changed, "the checkpoint holds untrained weights"


def test_train_cnn_runs_a_user_profile_without_the_comparison(tmp_path):
    import torchvision

    checkpoint = tmp_path / "cnn.pt"
    profile = "examples/my_profile.yaml"
    if aiak.amp.emulation_warning("bf16", torch.device("cpu")) is not None:  # O2 bf16 would be emulated here:
        profile = tmp_path / "my_profile.yaml"  # the same profile at fp32, so the run stays CPU-small
        profile.write_text((EXAMPLES / "my_profile.yaml").read_text().replace(
            "precision: {level: O2, dtype: bf16}", "precision: {level: O0}"))
        assert "level: O0" in profile.read_text()
    out = run_example("train_cnn.py", "--smoke", "--no-compare", "--strategy", str(profile),
                      "--checkpoint", str(checkpoint))
    assert "aiak.optimize: strategy 'my_profile'" in out.stderr
    assert "optimizer          Lamb" in out.stderr  # large_batch's LAMB, inherited by my_profile.yaml
    assert "step 0: loss" in out.stdout and "before/after" not in out.stdout
    torchvision.models.resnet18(num_classes=10).load_state_dict(torch.load(checkpoint)["model"], strict=True)


def test_train_swin_smoke_fuses_every_window_attention(tmp_path):
    out = run_example("train_swin.py", "--smoke", "--checkpoint", str(tmp_path / "swin.pt"))
    before_after(out.stdout)
    fused = re.search(r"^fused window attention: (\d+) of (\d+) window-attention modules fused$", out.stdout, re.M)
    assert fused and int(fused.group(1)) == int(fused.group(2)) > 0, out.stdout[-2000:]
    assert f"window_attention: {fused.group(1)} module(s) replaced" in out.stderr  # aiak's own summary agrees
    emulated = "precision: fp32, since bf16 is emulated" in out.stdout  # this CPU has no bf16 instructions
    assert ("O2 bf16" in out.stderr) != emulated


def test_train_transformer_smoke_balanced_batches_pad_less(tmp_path):
    out = run_example("train_transformer.py", "--smoke", "--checkpoint", str(tmp_path / "transformer.pt"))
    before_after(out.stdout)
    padding = re.search(r"^padded tokens \(rank 0\): plain (\d+)%, aiak (\d+)% of all token slots$", out.stdout, re.M)
    assert padding, out.stdout[-2000:]
    plain, balanced = int(padding.group(1)), int(padding.group(2))
    assert plain >= 40 and balanced <= plain / 4, f"plain batches {plain}% padding, balanced {balanced}%"
    assert "optimizer  Lamb" in out.stderr and "length-balanced batches" in out.stderr


def _netns_usable() -> str:
    """Why multinode.sh --local cannot run here ("" when it can)."""
    if os.geteuid() != 0:
        return "multinode.sh --local needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "multinode.sh --local needs iproute2's ip"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return "" if probe.returncode == 0 else f"ip netns is unavailable: {probe.stderr.strip()}"


@pytest.mark.slow
@pytest.mark.skipif(bool(_netns_usable()), reason=_netns_usable() or "-")
def test_multinode_local_runs_4_ranks_on_2_nodes_that_end_with_identical_weights(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "LOCAL_TIMEOUT": "200", "TORCHRUN": f"{sys.executable} -m torch.distributed.run"}
    command = ["bash", str(EXAMPLES / "multinode.sh"), "--local", "--smoke", "--checkpoint", str(tmp_path / "mn.pt")]
    proc = subprocess.Popen(command, cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    namespaces = [f"aiakm{proc.pid}n0", f"aiakm{proc.pid}n1"]   # the script names them after its own pid
    try:
        try:
            stdout, stderr = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)   # its trap ends the ranks and deletes the namespaces
            stdout, stderr = proc.communicate(timeout=60)
            pytest.fail(f"multinode.sh --local ran past 240 s\n{stdout[-3000:]}\n{stderr[-3000:]}")
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        assert not any(ns in left for ns in namespaces), f"namespaces left behind: {left}"
    finally:
        for ns in namespaces:  # only if the script failed to; a no-op otherwise
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    assert f"nodes {namespaces[0]} (10.231.13.1) and {namespaces[1]} (10.231.13.2)" in stdout, stdout[-2000:]
    assert proc.returncode == 0, f"{stdout[-3000:]}\n{stderr[-3000:]}"

    digests = dict(re.findall(r"^rank (\d) ([0-9a-f]{64})$", stdout, re.M))
    assert sorted(digests) == ["0", "1", "2", "3"], stdout[-2000:]
    assert len(set(digests.values())) == 1, f"the ranks' weights differ: {digests}"
    assert re.search(r"aiak.comm: DDP over 4 ranks on 2 node\(s\) x 2 local .*hierarchical\+fp16", stdout), \
        stdout[-2000:]
    before_after(stdout.split("\nrank 0 ")[0])  # rank 0's line, printed before the checksums

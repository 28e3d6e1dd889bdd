"""Emulated precision warns once, with its measured cost and the alternative; the hardware probes read the
real machine and never touch CUDA."""
import os
import subprocess
import sys
import warnings

import pytest
import torch

import aiak
from aiak.amp import emulation
from aiak.util import warn
from aiak.cli.demo import DemoNet
from aiak.strategy import probes


def _first_flags_line():
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return set(value.split())
    return set()


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="needs Linux /proc/cpuinfo")
def test_cpu_features_are_the_flags_of_the_real_proc_cpuinfo():
    real = _first_flags_line()
    got = probes.cpu_features()
    assert got and got <= real
    assert got == real  # the whole first flags line, nothing invented, nothing dropped
    assert probes.cpu_features() is got  # cached: /proc/cpuinfo is read once


def test_probes_never_touch_cuda():
    code = ("import torch, aiak.amp, aiak.strategy.probes as p; p.cpu_features(); "
            "assert p.cuda_capability('cpu') is None and p.cuda_capability(torch.device('cpu')) is None; "
            "assert not torch.cuda.is_initialized(), 'CUDA was initialized'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def _optimize(precision):
    torch.manual_seed(0)
    model = DemoNet(width=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return aiak.optimize(model, optimizer, strategy={"precision": precision})


def _emulation_warnings(caught, what):
    return [w for w in caught if what in str(w.message)]


def test_fp16_on_cpu_warns_once_per_process_with_the_cost_and_the_alternative(monkeypatch):
    monkeypatch.setattr(warn, "_warned", set())  # as in a fresh process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _optimize({"level": "O2", "dtype": "fp16"})
        _optimize({"level": "O2", "dtype": "fp16"})
        _optimize({"level": "O1", "dtype": "fp16"})
    found = _emulation_warnings(caught, "fp16 on CPU is emulated")
    assert len(found) == 1, [str(w.message) for w in caught]
    message = str(found[0].message)
    assert "slower than fp32" in message and "benchmarks/precision_cpu.py" in message
    if probes.has_native_bf16_cpu():
        assert "precision.dtype: bf16" in message
    else:
        assert "precision.level: O0 (fp32)" in message
    assert found[0].filename == __file__  # attributed to the user's optimize() line, not to aiak's internals
    assert "fp16 emulated on cpu" in aiak.last_decision().render()  # and the decision record says so


def test_bf16_on_this_cpu_warns_only_without_bf16_hardware(monkeypatch):
    monkeypatch.setattr(warn, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _optimize({"level": "O2", "dtype": "bf16"})
        _optimize({"level": "O1", "dtype": "bf16"})
    found = _emulation_warnings(caught, "bf16 on this CPU is emulated")
    if probes.has_native_bf16_cpu():  # this project's test machine: avx512_bf16
        assert found == []
    else:
        assert len(found) == 1 and "precision.level: O0" in str(found[0].message)


def test_fp32_does_not_warn(monkeypatch):
    monkeypatch.setattr(warn, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _optimize({"level": "O0"})
    assert _emulation_warnings(caught, "emulated") == []


@pytest.mark.parametrize("dtype, device, flags, capability, key, advice", [
    ("fp16", "cpu", {"avx2", "avx512f"}, None, "fp16-on-cpu", "precision.level: O0"),
    ("fp16", "cpu", {"avx512f", "amx_bf16", "amx_tile"}, None, "fp16-on-cpu", "precision.dtype: bf16"),
    ("fp16", "cpu", {"avx512_bf16", "avx512_fp16"}, None, "fp16-on-cpu", "avx512_fp16 does not make it fast"),
    ("fp16", "cpu", {"avx512_bf16", "amx_fp16"}, None, "fp16-on-cpu", "amx_fp16, which oneDNN can use"),
    ("bf16", "cpu", {"avx2", "avx512f"}, None, "bf16-on-cpu", "precision.level: O0"),
    ("bf16", "cpu", {"avx512_bf16"}, None, None, None),
    ("bf16", "cpu", {"amx_bf16"}, None, None, None),
    ("bf16", "cuda:0", None, (7, 0), "bf16-on-cuda", "precision.dtype: fp16 with loss_scale: dynamic"),
    ("bf16", "cuda:0", None, (8, 0), None, None),
    ("fp16", "cuda:0", None, (7, 0), None, None),
])
def test_emulation_rules_for_other_machines(dtype, device, flags, capability, key, advice):
    found = emulation.emulation_warning(dtype, torch.device(device),
                                        cpu_flags=frozenset(flags) if flags is not None else None,
                                        capability=capability)
    if key is None:
        assert found is None
    else:
        assert found[0] == key and advice in found[1], found

"""glibc malloc's thresholds fixed by `malloc_retain`: a training step stops paging in the memory the previous one
freed, and trains exactly as before.

Each side runs in a fresh process: glibc cannot adapt its thresholds again once they were fixed, so a process that
turned the knob on cannot show the default behaviour (`aiak.runtime.malloc`)."""
import platform
import subprocess
import sys
import warnings

import pytest
import torch

import aiak
from aiak.runtime import malloc

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

CHILD = """
import hashlib, resource, sys, torch
import aiak
from aiak.cli.demo import DemoNet
torch.manual_seed(0)
model = DemoNet(width=32)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
if sys.argv[1] == "retain":
    model, opt, _ = aiak.optimize(model, opt, strategy={"malloc_retain": True})
g = torch.Generator().manual_seed(1)
x, y = torch.randn(128, 3, 32, 32, generator=g), torch.randint(0, 10, (128,), generator=g)

def step():
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()

for _ in range(2):
    step()
start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    step()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / 8
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
print(faults, digest)
"""


def _run(side):
    out = subprocess.run([sys.executable, "-c", CHILD, side], capture_output=True, text=True, timeout=300, check=True)
    faults, digest = out.stdout.split()[-2:]
    return float(faults), digest


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_a_step_stops_paging_in_freed_memory_and_trains_the_same():
    """DemoNet at batch 128, 32 px (its largest tensor 16 MiB): without the knob each step takes thousands of minor
    page faults (measured 8,700-13,400; at batch 64 once only 764, glibc's adapting thresholds kept more of a smaller
    step), with it a few hundred (0-887), and the weights after 10 steps are the same bytes. glibc's adapting
    thresholds keep part of a step or all of it in some runs (plain: 0 faults beside other tests, 2,548 in a fresh
    clone's CI, 4,592-21,188 in six runs alone), so the most of up to three plain runs stands for its paging."""
    seen = []
    for _ in range(3):
        faults, plain_digest = _run("plain")
        seen.append(faults)
        if faults > 5000:
            break
    plain_faults = max(seen)
    retain_faults, retain_digest = _run("retain")
    assert plain_faults > 1000, plain_faults        # the workload pages memory in every step without the knob
    assert retain_faults < plain_faults / 5, (plain_faults, retain_faults)
    assert retain_digest == plain_digest


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_the_switch_reads_what_aiak_set_and_turns_off_to_glibcs_ceiling():
    before = malloc.read()
    try:
        malloc.write(True)
        assert malloc.read() is True
        assert "kept for reuse" in malloc.apply_malloc_retain(True, torch.device("cpu"))
        malloc.write(False)
        assert malloc.read() is False
        assert malloc.apply_malloc_retain(False, torch.device("cpu")) == "off" and malloc.read() is False
    finally:
        malloc.write(before)


def test_without_glibc_it_warns_once_naming_what_to_use_instead(monkeypatch):
    from aiak.util import warn as warn_module

    monkeypatch.setattr(malloc, "_glibc", lambda: None)    # as on musl, macOS or Windows: no mallopt
    monkeypatch.setattr(malloc, "_retaining", False)
    monkeypatch.setattr(warn_module, "_warned", set(), raising=False)
    monkeypatch.setattr(warn_module, "_warned", set())
    with pytest.warns(UserWarning, match=r"malloc_retain needs glibc.*LD_PRELOAD"):
        aiak.optimize(torch.nn.Linear(2, 2), strategy={"malloc_retain": True})
    assert malloc.read() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # once: a second model says nothing
        assert malloc.apply_malloc_retain(True, torch.device("cpu")) == "skipped (not glibc)"


def test_retained_memory_is_bounded_by_the_machines():
    assert malloc.TRIM_CEILING <= malloc.retained_bytes() <= malloc.RETAINED_BYTES

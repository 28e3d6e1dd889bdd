"""aiak.measure.memory.PeakMemory on this CPU: what a piece of work added at its peak, not what was there before.

Run in a fresh process with glibc's mmap threshold fixed at 64 KiB, as benchmarks/linear_cross_entropy.py measures:
in a long-lived process, freed heap memory from earlier work is reused unseen (the figure is then a lower bound)."""
import os
import subprocess
import sys

WORK = '''
import torch
from aiak.measure.memory import PeakMemory

MIB = 2 ** 20
before = torch.ones(64 * MIB // 4)                     # 64 MiB held across the block: not the block's
with PeakMemory() as peak:
    inside = torch.ones(128 * MIB // 4)               # 128 MiB at the peak, freed before the end
    del inside
with PeakMemory() as nothing:
    float(before.sum())
print(peak.bytes / MIB, nothing.bytes / MIB)
'''


def test_a_tensor_made_and_freed_inside_counts_at_its_size_and_one_made_before_does_not():
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", WORK], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    peak, nothing = (float(x) for x in out.stdout.split())
    assert 120 <= peak <= 150, peak
    assert nothing < 16, nothing                           # the earlier peak was reset, not carried over

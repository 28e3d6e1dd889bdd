"""aiak.measure.memory.PeakMemory on this CPU: what a piece of work added at its peak, not what was there before."""
import torch

from aiak.measure.memory import PeakMemory

MIB = 2 ** 20


def test_a_tensor_made_and_freed_inside_counts_at_its_size_and_one_made_before_does_not():
    before = torch.ones(64 * MIB // 4)                     # 64 MiB held across the block: not the block's
    with PeakMemory() as peak:
        inside = torch.ones(128 * MIB // 4)               # 128 MiB at the peak, freed before the end
        del inside
    assert peak.bytes is not None
    assert 120 * MIB <= peak.bytes <= 150 * MIB, peak.mib
    with PeakMemory() as nothing:
        float(before.sum())
    assert nothing.bytes < 16 * MIB, nothing.mib           # the earlier peak was reset, not carried over

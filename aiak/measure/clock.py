"""The step clock of every measurement: host time on CPU, CUDA events on the stream on a GPU."""
from __future__ import annotations

import time

import torch


class StepClock:
    """Marks step boundaries where the work runs; seconds between two marks.

    CPU: ``time.perf_counter``. CUDA: an event recorded on the current stream at each mark, because host time
    between two hook calls is kernel-launch time, not step time. CUDA marks are read (one synchronisation) only
    by `seconds`, which the tuner calls once, when it has all its samples.
    """

    __slots__ = ("device",)

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def mark(self):
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start, end) -> float:
        if self.device.type != "cuda":
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

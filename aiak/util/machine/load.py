"""How much of this machine's CPU other work is using now: the cores left to this process.

A shared machine (a CI runner, a notebook server, a workstation training two jobs) runs other processes beside the
training. Their load distorts timings, and it hurts some kernels much more than others: with two busy processes
beside the demo model on a 2-core CPU, oneDNN's bf16 convolution backward took 44 ms per call on 2 intra-op threads
and 8.9 ms on one, while its fp32 one took 18.8 ms either way (torch.profiler, 30 steps each, while aiak's prefetch
thread still kept an OpenMP team of its own: `aiak.util.background_threads`). So the run-time guard
(`aiak.tune.guard`) reads the cores left before it offers a smaller thread budget, and the trials record the load
they measured under beside their decision in the cache.

The reading is the kernel's count of runnable tasks (`procs_running` in `/proc/stat`, the whole machine's), sampled
a few times, less this process's own running threads (`/proc/self/task/*/stat`). Inside a container limited to some
of a larger machine's cores, the count is the host's: the reading is then not used (`CpuLoad.known` is false).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from aiak.util.machine.cpu import usable_cores

SAMPLES = 5            # readings of the runnable count, ...
SAMPLE_INTERVAL = 0.004  # ... this many seconds apart (20 ms in all)


@dataclass(frozen=True)
class CpuLoad:
    """The cores this process may run on, and what other work keeps busy of them now.

    Attributes:
        cores: the CPUs this process may run on (its affinity mask).
        busy_elsewhere: the mean number of runnable tasks of other processes over the samples; None when unknown.
        load1: the kernel's one-minute load average (this process included).
    """

    cores: int
    busy_elsewhere: Optional[float]
    load1: float

    @property
    def known(self) -> bool:
        """Whether the runnable count could be read for this process's cores."""
        return self.busy_elsewhere is not None

    @property
    def free_cores(self) -> int:
        """The cores other work leaves to this process (at least one): `cores` when the load is unknown."""
        if self.busy_elsewhere is None:
            return self.cores
        return max(1, min(self.cores, int(self.cores - self.busy_elsewhere + 0.5)))

    def to_dict(self) -> dict:
        """The reading as the cache and the decision record keep it."""
        return {"cores": self.cores, "free_cores": self.free_cores,
                "busy_elsewhere": None if self.busy_elsewhere is None else round(self.busy_elsewhere, 2),
                "load1": round(self.load1, 2)}


def cpu_load(samples: int = SAMPLES, interval: float = SAMPLE_INTERVAL) -> CpuLoad:
    """Read the load now (about `samples * interval` seconds)."""
    cores = usable_cores()
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if cores != (os.cpu_count() or cores):  # a cpuset: the machine-wide count says nothing of these cores
        return CpuLoad(cores, None, load1)
    readings = []
    for i in range(samples):
        if i:
            time.sleep(interval)
        running, mine = _procs_running(), _own_running_threads()
        if running is None:
            return CpuLoad(cores, None, load1)
        readings.append(max(running - mine, 0))
    return CpuLoad(cores, sum(readings) / len(readings), load1)


def _procs_running() -> Optional[int]:
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("procs_running "):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _own_running_threads() -> int:
    """This process's threads in state R (running or runnable), reading this one included."""
    count = 0
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return 1
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        if stat[stat.rfind(")") + 2:].startswith("R"):
            count += 1
    return max(count, 1)

"""What ``aiak doctor`` reads: one `Machine` snapshot (roots for /proc, /sys and /dev, the environment,
a few limits, `TorchFacts`, the extras' probes and aiak's global patches installed in this process).
`Machine.here` reads this machine; a test builds one over a fake tree."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from aiak.runtime.patches import Patch, patches
from aiak.util.machine.cpu import usable_cores
from aiak.util.machine.versions import installed_version


PASS, WARN, FAIL = "pass", "warn", "fail"
EXIT_CODES = {PASS: 0, WARN: 1, FAIL: 2}
MIB, GIB = 2 ** 20, 2 ** 30

# Lowest NVIDIA driver branch each CUDA major runs on (CUDA minor-version compatibility, NVIDIA's CUDA
# compatibility guide): a torch wheel built for CUDA 12.x needs a >= 525 driver, 13.x a >= 580 one.
CUDA_MIN_DRIVER = {11: 450, 12: 525, 13: 580}
# The pytorch.org wheel index for the newest CUDA a driver branch runs (used in the fixes).
WHEEL_FOR_DRIVER = ((580, "cu130"), (525, "cu126"), (450, "cu118"))
# TF32 tensor cores and native bf16 arrived with Ampere (compute capability 8.0).
AMPERE = (8, 0)
# NCCL_NET_GDR_LEVEL values NCCL documents; NCCL compares them case-sensitively with its path-type names (the
# others below; digits are the legacy form) and ignores anything else.
GDR_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS")
NCCL_PATH_TYPES = GDR_LEVELS + ("NVL", "NVB", "C2C", "PXN", "P2C")
NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")
PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")  # the in-driver module, and Mellanox's older one
# DALI's wheels, one per CUDA major; aiak's "dali" extra installs the first.
DALI_DISTS = ("nvidia-dali-cuda120", "nvidia-dali-cuda130", "nvidia-dali-cuda110")
PROBE_TIMEOUT_S = 60.0
NAME_WIDTH = 19




@dataclass
class GpuFacts:
    name: str
    capability: Tuple[int, int]
    memory_gb: float = 0.0


@dataclass
class TorchFacts:
    """What torch says about itself and the GPUs. ``version`` None: torch does not import (``import_error``)."""

    version: Optional[str] = None
    import_error: str = ""
    cuda: Optional[str] = None           # torch.version.cuda: the CUDA the wheel was built for; None on a CPU wheel
    hip: Optional[str] = None            # torch.version.hip on a ROCm wheel
    cuda_available: bool = False
    cuda_warning: str = ""               # what torch.cuda.is_available() warned (driver too old, ...)
    gpus: List[GpuFacts] = field(default_factory=list)
    arch_list: List[str] = field(default_factory=list)  # torch.cuda.get_arch_list(): sm_XY / compute_XY it ships
    cudnn: Optional[int] = None          # torch.backends.cudnn.version(), when cuDNN is available
    nccl: Optional[str] = None           # torch.cuda.nccl.version(), read only with a GPU visible
    matmul_allow_tf32: bool = False
    float32_matmul_precision: str = "highest"
    distributed: bool = True
    gloo: bool = False
    nccl_backend: bool = False
    errors: Dict[str, str] = field(default_factory=dict)  # probe -> what could not be read

    @classmethod
    def here(cls) -> "TorchFacts":
        """Read the installed torch. Touches CUDA only when ``torch.cuda.is_available()`` (no GPU: no CUDA init)."""
        facts = cls()
        with warnings.catch_warnings(record=True):  # e.g. "Failed to initialize NumPy": not doctor's output
            warnings.simplefilter("always")
            try:
                import torch
            except Exception as e:  # a broken install is what doctor is for
                facts.import_error = one_line(f"{type(e).__name__}: {e}")
                return facts
        facts.version = torch.__version__
        facts.cuda, facts.hip = torch.version.cuda, getattr(torch.version, "hip", None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            facts.cuda_available = _guarded(facts.errors, "cuda", torch.cuda.is_available, False)
        facts.cuda_warning = one_line(str(caught[0].message)) if caught else ""
        if facts.cuda_available:
            def gpus():
                return [GpuFacts(torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i)),
                                 round(torch.cuda.get_device_properties(i).total_memory / GIB, 1))
                        for i in range(torch.cuda.device_count())]
            facts.gpus = _guarded(facts.errors, "gpus", gpus, [])
            facts.arch_list = _guarded(facts.errors, "arch_list", torch.cuda.get_arch_list, [])
            facts.nccl = _guarded(facts.errors, "nccl", lambda: _version_text(torch.cuda.nccl.version()), None)
        if _guarded(facts.errors, "cudnn", torch.backends.cudnn.is_available, False):
            facts.cudnn = _guarded(facts.errors, "cudnn", torch.backends.cudnn.version, None)
        facts.matmul_allow_tf32 = _guarded(facts.errors, "tf32", lambda: bool(torch.backends.cuda.matmul.allow_tf32),
                                           False)
        facts.float32_matmul_precision = _guarded(facts.errors, "tf32", torch.get_float32_matmul_precision, "highest")

        def backends():
            import torch.distributed as dist

            available = dist.is_available()
            return available, available and dist.is_gloo_available(), available and dist.is_nccl_available()

        facts.distributed, facts.gloo, facts.nccl_backend = _guarded(facts.errors, "distributed", backends,
                                                                     (False, False, False))
        return facts


@dataclass
class ExtraFacts:
    """An optional dependency: installed ``version`` (None: not installed) and whether it ran here.

    ``runs`` is None when it was not run (not installed, nothing to run it on, or probes skipped).
    """

    dist: str
    version: Optional[str] = None
    runs: Optional[bool] = None
    detail: str = ""


@dataclass
class Machine:
    """Everything the checks read; `here` reads the real one, tests build one over a fake tree."""

    proc: Path                      # normally /proc (cpuinfo, modules, driver/nvidia/version)
    sys: Path                       # normally /sys (class/net, class/infiniband, module, fs/cgroup)
    dev: Path                       # normally /dev (nvidia0, nvidiactl, ...)
    environ: Mapping[str, str]
    shm_bytes: Optional[int]        # size of /dev/shm; None when absent
    memlock_bytes: Optional[int]    # RLIMIT_MEMLOCK soft limit; None = unlimited
    cpus: int                       # len(os.sched_getaffinity(0))
    torch: TorchFacts
    extras: Dict[str, ExtraFacts] = field(default_factory=dict)  # "triton", "dali", "apex"
    platform: str = "linux"         # sys.platform
    python: str = ""                # platform.python_version()
    errors: Dict[str, str] = field(default_factory=dict)  # "shm" / "memlock" / "cpus" -> what could not be read
    patches: List[Patch] = field(default_factory=list)    # aiak's global patches installed in this process
    loadavg: Optional[float] = None  # os.getloadavg()[0], read first (before doctor's own work); None: unreadable

    @classmethod
    def here(cls, probe_extras: bool = True) -> "Machine":
        """This machine. ``probe_extras`` runs DALI's one-batch pipeline, apex's import and (with a GPU) a
        Triton kernel, each in a subprocess with a timeout; without it the extras are only looked up."""
        errors: Dict[str, str] = {}
        load = _guarded(errors, "load", lambda: os.getloadavg()[0], None)
        torch_facts = TorchFacts.here()
        return cls(proc=Path("/proc"), sys=Path("/sys"), dev=Path("/dev"), environ=dict(os.environ),
                   shm_bytes=_guarded(errors, "shm", _shm_bytes, None),
                   memlock_bytes=_guarded(errors, "memlock", _memlock_bytes, None),
                   cpus=_guarded(errors, "cpus", usable_cores, os.cpu_count() or 1), torch=torch_facts,
                   extras=probe_extras_here(torch_facts, run_probes=probe_extras), platform=sys.platform,
                   python=platform.python_version(), errors=errors, patches=patches(), loadavg=load)

    @property
    def gpus(self) -> List[GpuFacts]:
        return self.torch.gpus if self.torch.cuda_available else []

    @property
    def linux(self) -> bool:
        return self.platform.startswith("linux")




# -- reading this machine -------------------------------------------------------------------------------------
def _guarded(errors: Dict[str, str], key: str, read: Callable, default):
    """``read()``, or ``default`` with the error recorded under ``key`` (a probe that errors is a finding)."""
    try:
        return read()
    except Exception as e:
        errors[key] = one_line(f"{type(e).__name__}: {e}")
        return default


def _shm_bytes() -> Optional[int]:
    try:
        st = os.statvfs("/dev/shm")
    except FileNotFoundError:
        return None
    return st.f_blocks * st.f_frsize


def _memlock_bytes() -> Optional[int]:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _version_text(version) -> str:
    return ".".join(str(v) for v in version) if isinstance(version, (tuple, list)) else str(version)


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def _last_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[-1] if lines else ""


def read_small_file(path: Path) -> Optional[str]:
    """The stripped text of a small file, None when it is absent or unreadable (sysfs raises EINVAL often)."""
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except (OSError, ValueError):
        return None


# -- the extras' probes (subprocesses: a broken extra must not hang or crash doctor) --------------------------
DALI_PROBE = """
import sys, warnings
warnings.simplefilter("ignore")
from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.plugin.pytorch import DALIGenericIterator
device_id = None if sys.argv[1] == "cpu" else int(sys.argv[1])

@pipeline_def(batch_size=2, num_threads=1, device_id=device_id)
def one_batch():
    images = fn.random.uniform(range=[0.0, 255.0], shape=[8, 8, 3], dtype=types.FLOAT)
    if device_id is not None:
        images = images.gpu()
    return fn.crop_mirror_normalize(images, crop=(4, 4), mean=[0.0] * 3, std=[255.0] * 3, output_layout="CHW")

batch = next(iter(DALIGenericIterator(one_batch(), ["images"], size=2)))[0]["images"]
assert tuple(batch.shape) == (2, 3, 4, 4), batch.shape
print("device", batch.device)
"""

APEX_PROBE = """
import apex
try:
    import amp_C
    print("amp_C loads")
except Exception as e:
    print("amp_C does not load:", type(e).__name__, e)
"""

TRITON_PROBE = """
import torch, triton, triton.language as tl

@triton.jit
def _add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offsets < n
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=keep) + 1, mask=keep)

x = torch.arange(100, device="cuda", dtype=torch.float32)
y = torch.empty_like(x)
_add_one[(2,)](x, y, 100, BLOCK=64)
assert torch.equal(y, x + 1), "wrong result"
print("kernel ran on", torch.cuda.get_device_name(0))
"""


def run_probe(code: str, args: Sequence[str] = (), timeout: float = PROBE_TIMEOUT_S,
              env: Optional[Mapping[str, str]] = None) -> Tuple[bool, str, float]:
    """Run ``code`` (written to a file: ``triton.jit`` reads its source) in a fresh interpreter.

    Returns ``(ok, what it said, seconds)``: its last stdout line when it exits 0, else its last stderr line
    (the exception), or that it timed out. Never raises.
    """
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="aiak-doctor-") as tmp:
            script = Path(tmp) / "probe.py"
            script.write_text(code, encoding="utf-8")
            out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                                 timeout=timeout, env=dict(env) if env is not None else None)
    except subprocess.TimeoutExpired:
        return False, f"did not finish in {timeout:.0f} s", time.perf_counter() - start
    except OSError as e:  # no writable temp dir, or the interpreter cannot be started
        return False, f"could not run the probe: {one_line(e)}", time.perf_counter() - start
    seconds = time.perf_counter() - start
    if out.returncode == 0:
        return True, _last_line(out.stdout), seconds
    said = _last_line(out.stderr) or _last_line(out.stdout)
    return False, said or f"exited with status {out.returncode}", seconds


def probe_extras_here(torch_facts: TorchFacts, run_probes: bool = True) -> Dict[str, ExtraFacts]:
    """triton, DALI and apex on this machine: installed versions and, with ``run_probes``, whether they run."""
    dali = next((d for d in DALI_DISTS if installed_version(d)), DALI_DISTS[0])
    extras = {"triton": ExtraFacts("triton", installed_version("triton")),
              "dali": ExtraFacts(dali, installed_version(dali)),
              "apex": ExtraFacts("apex", installed_version("apex"))}
    if not run_probes or torch_facts.version is None:
        return extras
    gpu = torch_facts.cuda_available and bool(torch_facts.gpus) and torch_facts.hip is None
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the GPU probe means the GPU
    for name, code, args, wanted in (("triton", TRITON_PROBE, (), gpu),
                                     ("dali", DALI_PROBE, ("0" if gpu else "cpu",), True),
                                     ("apex", APEX_PROBE, (), True)):
        extra = extras[name]
        if extra.version is None or not wanted:
            continue
        ok, said, seconds = run_probe(code, args, env=env)
        extra.runs, extra.detail = ok, f"{said} ({seconds:.1f} s)" if ok else said
    return extras


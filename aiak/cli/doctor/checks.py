"""The checks of ``aiak doctor``: pure functions of a `Machine`, each a
`Check` (pass, warn or fail, and the fix of every warn and fail)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence, Tuple, Union

from aiak.cli.doctor.machine import (AMPERE, CUDA_MIN_DRIVER, DALI_DISTS, FAIL, GDR_LEVELS, GIB, MIB, NCCL_DEBUG_LEVELS,
                                     NCCL_PATH_TYPES, PASS, PEERMEM_MODULES, WARN, WHEEL_FOR_DRIVER, ExtraFacts,
                                     GpuFacts, Machine, one_line, read_small_file)
from aiak.util.machine.cpu import NATIVE_BF16_CPU_FLAGS, cpuinfo_fields
from aiak.util.machine.versions import installed_version


@dataclass
class Check:
    name: str
    status: str   # "pass" | "warn" | "fail"
    detail: str
    fix: str = ""



# -- helpers over the snapshot --------------------------------------------------------------------------------
@dataclass
class Interface:
    name: str
    state: str                   # operstate: up, down, unknown, ...
    speed_mbps: Optional[int]    # /sys/class/net/*/speed; None when the driver does not say
    loopback: bool
    up: bool


def interfaces(m: Machine) -> List[Interface]:
    """The network interfaces in ``/sys/class/net``. "unknown" operstate (virtual NICs) counts as up when
    the IFF_UP flag is set, as the kernel does."""
    root = m.sys / "class" / "net"
    found = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        state = read_small_file(path / "operstate") or "unknown"
        flags = _parse_int(read_small_file(path / "flags"), base=16) or 0
        speed = _parse_int(read_small_file(path / "speed"))
        loopback = path.name == "lo" or read_small_file(path / "type") == "772" or bool(flags & 0x8)
        up = state == "up" or (state == "unknown" and bool(flags & 0x1))
        found.append(Interface(path.name, state, speed if speed and speed > 0 else None, loopback, up))
    return found


def _parse_int(text: Optional[str], base: int = 10) -> Optional[int]:
    try:
        return int(text, base) if text is not None else None
    except ValueError:
        return None


def _describe(iface: Interface) -> str:
    if iface.loopback:
        return f"{iface.name} loopback"
    speed = f" {iface.speed_mbps / 1000:g} Gb/s" if iface.speed_mbps else ""
    return f"{iface.name} {iface.state}{speed}"


def fastest(ifaces: Iterable[Interface]) -> Optional[Interface]:
    """The up, non-loopback interface with the highest link speed (unknown speeds last, then by name)."""
    usable = [i for i in ifaces if i.up and not i.loopback]
    return min(usable, key=lambda i: (-(i.speed_mbps or 0), i.name)) if usable else None


def parse_ifname_filter(value: str) -> Tuple[bool, bool, List[str]]:
    """NCCL's interface-list grammar (NCCL_SOCKET_IFNAME, NCCL_IB_HCA): a comma list of prefixes; a leading
    ``^`` excludes the listed ones, then a leading ``=`` makes them exact names. Returns (exclude, exact, items);
    an IB_HCA item's ``:port`` suffix is dropped."""
    value = value.strip()
    exclude = value.startswith("^")
    value = value[1:] if exclude else value
    exact = value.startswith("=")
    value = value[1:] if exact else value
    items = [item.strip().split(":")[0] for item in value.split(",") if item.strip()]
    return exclude, exact, items


def filter_names(names: Iterable[str], value: str) -> List[str]:
    """The names NCCL's filter ``value`` selects."""
    exclude, exact, items = parse_ifname_filter(value)

    def listed(name: str) -> bool:
        return any(name == item if exact else name.startswith(item) for item in items)

    return [name for name in names if listed(name) != exclude]


def rdma_devices(m: Machine) -> List[Tuple[str, str]]:
    """(name, description) of each InfiniBand / RoCE device in /sys/class/infiniband, e.g.
    ("mlx5_0", "port 1 InfiniBand 200 Gb/sec ACTIVE")."""
    root = m.sys / "class" / "infiniband"
    found = []
    for dev in sorted(root.iterdir()) if root.is_dir() else []:
        ports = sorted((dev / "ports").iterdir()) if (dev / "ports").is_dir() else []
        parts = []
        for port in ports:
            state = (read_small_file(port / "state") or "").partition(":")[2].strip() or "state unknown"
            layer = read_small_file(port / "link_layer") or ""
            rate = (read_small_file(port / "rate") or "").split("(")[0].strip()
            parts.append(" ".join(p for p in (f"port {port.name}", layer, rate, state) if p))
        found.append((dev.name, "; ".join(parts) or "no ports listed"))
    return found


def _rdma_active(description: str) -> bool:
    return "ACTIVE" in description


def nvidia_driver(m: Machine) -> Tuple[bool, Optional[str], int]:
    """(an NVIDIA driver is present, its version, how many /dev/nvidiaN device nodes)."""
    text = read_small_file(m.proc / "driver" / "nvidia" / "version")
    version = None
    if text:
        match = re.search(r"Module\b.*?\s(\d{3,}\.\d+(?:\.\d+)?)\b", text)
        version = match.group(1) if match else None
    nodes = len([p for p in m.dev.glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)]) if m.dev.is_dir() else 0
    return text is not None or nodes > 0, version, nodes


def _driver_major(version: Optional[str]) -> Optional[int]:
    return int(version.split(".")[0]) if version else None


def torch_install_command(m: Machine, cpu: bool = False, capability: Optional[Tuple[int, int]] = None) -> str:
    """The pinned command that reinstalls this torch version: its CUDA build for the driver's branch (unknown
    driver: cu126, which runs on any >= 525 driver), or with ``cpu`` the CPU build. With a GPU's
    ``capability``: CUDA 12.8+ builds dropped GPUs below sm 7.5 (cu126 still has them), and Blackwell
    (sm 10.0+) needs a 12.8+ build."""
    base = (m.torch.version or installed_version("torch") or "").split("+")[0]
    pin = f"torch=={base}" if base else "torch"
    major = _driver_major(nvidia_driver(m)[1])
    tag = next((t for floor, t in WHEEL_FOR_DRIVER if major is not None and major >= floor), "cu126")
    if capability is not None and capability < (7, 5):
        tag = "cu126"
    elif capability is not None and capability >= (10, 0) and tag in ("cu126", "cu118"):
        tag = "cu128"
    return f"pip install --force-reinstall {pin} --index-url https://download.pytorch.org/whl/{'cpu' if cpu else tag}"


def loaded_modules(m: Machine) -> Optional[set]:
    """Kernel modules loaded (/proc/modules, else /sys/module); None when neither can be read."""
    text = read_small_file(m.proc / "modules")
    if text is not None:
        return {line.split()[0] for line in text.splitlines() if line.split()}
    root = m.sys / "module"
    return {p.name for p in root.iterdir()} if root.is_dir() else None


def cgroup_cpu_limit(m: Machine) -> Optional[float]:
    """The container's CPU quota in cores (cgroup v2 cpu.max, else v1 cfs quota/period); None when unlimited."""
    v2 = read_small_file(m.sys / "fs" / "cgroup" / "cpu.max")
    if v2:
        quota, _, period = v2.partition(" ")
        if quota != "max" and _parse_int(quota) and _parse_int(period):
            return int(quota) / int(period)
        return None
    quota = _parse_int(read_small_file(m.sys / "fs" / "cgroup" / "cpu" / "cpu.cfs_quota_us"))
    period = _parse_int(read_small_file(m.sys / "fs" / "cgroup" / "cpu" / "cpu.cfs_period_us"))
    return quota / period if quota and quota > 0 and period else None


def _size(n: int) -> str:
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    if n >= MIB:
        return f"{n / MIB:.0f} MiB"
    return f"{n / 1024:.0f} KiB"


def _cuda_major(m: Machine) -> Optional[int]:
    return _parse_int((m.torch.cuda or "").split(".")[0])


# -- the checks -----------------------------------------------------------------------------------------------
def check_python(m: Machine) -> Check:
    version = tuple(_parse_int(p) or 0 for p in m.python.split(".")[:2])
    if m.python and version < (3, 9):
        return Check("python", FAIL, f"{m.python}: aiak needs Python >= 3.9",
                     "create an environment with a newer Python: python3.11 -m venv .venv")
    return Check("python", PASS, m.python)


def check_torch(m: Machine) -> Check:
    t = m.torch
    if t.version is None:
        return Check("torch", FAIL, f"torch does not import: {t.import_error}",
                     torch_install_command(m, cpu=not nvidia_driver(m)[0]))
    build = f"CUDA {t.cuda} build" if t.cuda else f"ROCm {t.hip} build" if t.hip else "CPU build"
    version = tuple(_parse_int(p) or 0 for p in re.split(r"[.+]", t.version)[:2])
    if version < (2, 1):
        return Check("torch", FAIL, f"{t.version} ({build}): aiak needs torch >= 2.1",
                     "pip install --upgrade 'torch>=2.1'")
    return Check("torch", PASS, f"{t.version} ({build})")


def check_cudnn(m: Machine) -> Check:
    t = m.torch
    if t.version is None:
        return Check("cudnn", WARN, "not checked: torch does not import", "fix torch first (the torch line)")
    if not t.cuda:
        return Check("cudnn", PASS, "n/a: CPU build of torch")
    if t.cudnn:
        v = t.cudnn  # cuDNN 9 encodes major * 10000 + minor * 100 + patch, cuDNN 8 major * 1000 + ...
        major, rest = (v // 10000, v % 10000) if v >= 90000 else (v // 1000, v % 1000)
        return Check("cudnn", PASS, f"{major}.{rest // 100}.{rest % 100}")
    if m.gpus:
        return Check("cudnn", WARN, "cuDNN is not available: convolutions fall back to slow kernels",
                     f"pip install --force-reinstall nvidia-cudnn-cu{_cuda_major(m) or 12}")
    return Check("cudnn", PASS, "not available (no GPU here)")


def check_nccl(m: Machine) -> Check:
    if not m.gpus:
        return Check("nccl", PASS, "n/a: no GPU visible (read only with a GPU, so that no CUDA is initialised)")
    if m.torch.nccl:
        return Check("nccl", PASS, m.torch.nccl)
    why = m.torch.errors.get("nccl", "this torch has no NCCL")
    return Check("nccl", WARN, f"could not read the NCCL version: {why}", torch_install_command(m))


def check_gpu(m: Machine) -> List[Check]:
    """Driver present but torch sees no GPU, a CPU wheel on a GPU machine: fail. Then one line per GPU."""
    t = m.torch
    present, driver, nodes = nvidia_driver(m)
    driver_text = f"NVIDIA driver {driver}" if driver else "an NVIDIA driver"
    if t.cuda_available and m.gpus:
        cvd = m.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f"; CUDA_VISIBLE_DEVICES={cvd}" if cvd is not None else ""
        rows = [Check("gpu", PASS, f"{len(m.gpus)} GPU(s) visible to torch, driver {driver or 'version unread'}{seen}")]
        return rows + [check_one_gpu(m, label, gpu) for label, gpu in _gpu_runs(m.gpus)]
    if t.cuda_available:
        return [Check("gpu", WARN, f"torch reports CUDA available but lists no GPU: {t.errors.get('gpus', '')}",
                      "run nvidia-smi; if it lists the GPUs, reinstall torch: " + torch_install_command(m))]
    if not present:
        extra = " (this CUDA build of torch runs on CPU too)" if t.cuda else ""
        return [Check("gpu", PASS, f"no NVIDIA GPU: CPU training{extra}")]
    if t.version is None:
        return [Check("gpu", WARN, f"{driver_text} found; not checked further: torch does not import",
                      "fix torch first (the torch line)")]
    if not t.cuda and not t.hip:
        return [Check("gpu", FAIL, f"{driver_text} and {nodes} GPU device node(s) found, but torch {t.version} is a "
                                   "CPU build: training would run on the CPU", torch_install_command(m))]
    said = f" (torch: {t.cuda_warning})" if t.cuda_warning else ""
    cvd = m.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None and _hides_every_gpu(cvd, nodes):
        return [Check("gpu", FAIL, f"{driver_text} found, but CUDA_VISIBLE_DEVICES={cvd!r} hides every GPU{said}",
                      "unset CUDA_VISIBLE_DEVICES (or list the GPUs to use: CUDA_VISIBLE_DEVICES=0,1)")]
    need = CUDA_MIN_DRIVER.get(_cuda_major(m) or 0)
    major = _driver_major(driver)
    if need is not None and major is not None and major < need:
        return [Check("gpu", FAIL, f"driver {driver} is too old for torch's CUDA {t.cuda} build (CUDA "
                                   f"{_cuda_major(m)}.x needs a >= {need} driver): torch sees no GPU{said}",
                      torch_install_command(m) + f"  (or upgrade the driver to >= {need})")]
    if nodes == 0:
        return [Check("gpu", FAIL, f"{driver_text} found but no /dev/nvidiaN device node: torch sees no GPU{said}",
                      "in a container, start it with the GPUs: docker run --gpus all (NVIDIA Container Toolkit)")]
    return [Check("gpu", FAIL, f"{driver_text} and {nodes} device node(s) found, but torch (CUDA {t.cuda} build) "
                               f"sees no GPU{said}",
                  "run nvidia-smi: if it fails, reinstall the driver (or reboot after a driver upgrade); "
                  "if it lists the GPUs, reinstall torch: " + torch_install_command(m))]


def _gpu_runs(gpus: Sequence[GpuFacts]) -> List[Tuple[str, GpuFacts]]:
    """("gpu0-7", facts) for each run of identical consecutive GPUs: an 8-GPU node reads as one line."""
    runs: List[Tuple[int, int, GpuFacts]] = []
    for i, gpu in enumerate(gpus):
        if runs and runs[-1][2] == gpu:
            runs[-1] = (runs[-1][0], i, gpu)
        else:
            runs.append((i, i, gpu))
    return [(f"gpu{first}" if first == last else f"gpu{first}-{last}", gpu) for first, last, gpu in runs]


def _hides_every_gpu(value: str, nodes: int) -> bool:
    """CUDA reads CUDA_VISIBLE_DEVICES up to its first invalid entry: an empty value, "-1", a word or an index
    past the last GPU in first place leaves no GPU."""
    first = value.split(",")[0].strip()
    if first.startswith(("GPU-", "MIG-")):
        return False
    index = _parse_int(first)
    return index is None or index < 0 or (nodes > 0 and index >= nodes)


def check_one_gpu(m: Machine, name: str, gpu: GpuFacts) -> Check:
    """Capability, bf16 and TF32; fail when the torch build ships no kernel this GPU can run."""
    sm = f"{gpu.capability[0]}.{gpu.capability[1]}"
    if gpu.capability >= AMPERE:
        features = "bf16 native, TF32 tensor cores"
    else:
        features = "bf16 emulated (use fp16: precision dtype fp16), no TF32"
    detail = f"{gpu.name}, sm {sm}, {gpu.memory_gb:g} GiB: {features}"
    arch = m.torch.arch_list
    if arch and not _arch_runs(arch, gpu.capability):
        return Check(name, FAIL, f"{detail}; but torch's build has no kernels for sm_{sm.replace('.', '')} "
                                 f"(it has {' '.join(arch)})",
                     "install a torch build whose torch.cuda.get_arch_list() covers this GPU: "
                     + torch_install_command(m, capability=gpu.capability))
    return Check(name, PASS, detail)


def _arch_runs(arch_list: Sequence[str], capability: Tuple[int, int]) -> bool:
    """CUDA binary compatibility: an sm_XY cubin runs on X.Z for Z >= Y (arch-specific "a" cubins only on
    X.Y itself, family "f" ones like plain ones); compute_XY PTX is JIT-compiled for any capability >= X.Y."""
    for entry in arch_list:
        match = re.fullmatch(r"(sm|compute)_(\d+)(\d)([af]?)", entry)
        if not match:
            continue
        kind, major, minor, suffix = match.group(1), int(match.group(2)), int(match.group(3)), match.group(4)
        if kind == "compute" and (major, minor) <= capability:
            return True
        same_family = minor == capability[1] if suffix == "a" else minor <= capability[1]
        if kind == "sm" and major == capability[0] and same_family:
            return True
    return False


def check_cpu(m: Machine) -> Check:
    """The CPU model and its bf16 instructions; no bf16 on a CPU-only machine warns (bf16 would be emulated)."""
    path = m.proc / "cpuinfo"
    text = read_small_file(path)
    if text is None:
        if not m.linux:
            return Check("cpu", PASS, f"n/a: {path} exists on Linux only; bf16 support unknown")
        return Check("cpu", WARN, f"could not read {path}: bf16 support unknown",
                     "mount /proc (any Linux container has it) or run doctor on the host")
    fields = cpuinfo_fields(text)
    model = fields.get("model name") or fields.get("Hardware") or fields.get("CPU part") or "unknown CPU"
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    bf16 = sorted(flags & NATIVE_BF16_CPU_FLAGS)
    if "amx_bf16" in flags:
        return Check("cpu", PASS, f"{model}: AMX (amx_bf16): bf16 matmuls on the AMX tiles, the fastest CPU path")
    if bf16:
        return Check("cpu", PASS, f"{model}: bf16 in hardware ({', '.join(bf16)})")
    if m.gpus:
        return Check("cpu", PASS, f"{model}: no bf16 instructions (the GPU computes; no effect)")
    return Check("cpu", WARN, f"{model}: no bf16 instructions (avx512_bf16 / amx_bf16): bf16 would be emulated, "
                              "slower than fp32",
                 "keep fp32 here (strategy='auto' picks its cpu_bf16 profile only on CPUs with avx512_bf16 or "
                 "amx_bf16, so it trains in fp32 on this one); for bf16 speed use a CPU with AVX512-BF16 or AMX "
                 "(Intel Sapphire Rapids, AMD Zen 4 or newer)")


def check_tf32(m: Machine) -> Check:
    """fp32 matmuls on an sm80+ GPU with TF32 off run at the fp32 rate: 19.5 TFLOPS on an A100 against
    156 TFLOPS for TF32 (NVIDIA A100 datasheet). Off is torch's default in every new process."""
    if not m.gpus:
        return Check("tf32", PASS, "n/a: no GPU")
    ampere = [g for g in m.gpus if g.capability >= AMPERE]
    if not ampere:
        return Check("tf32", PASS, "n/a: TF32 needs compute capability 8.0+ (these GPUs: "
                                   f"{', '.join(f'{g.capability[0]}.{g.capability[1]}' for g in m.gpus)})")
    t = m.torch
    state = f"allow_tf32={t.matmul_allow_tf32}, float32_matmul_precision={t.float32_matmul_precision!r}"
    if not t.matmul_allow_tf32 and t.float32_matmul_precision == "highest":
        return Check("tf32", WARN, f"off ({state}, torch's default in a new process): fp32 matmuls on the "
                                   f"{ampere[0].name} run at the fp32 rate, ~8x below TF32 (A100: 19.5 vs 156 TFLOPS)",
                     "let aiak switch it on with a strategy that has `tf32: true` (the cuda, cnn or swin profile), "
                     "or call torch.set_float32_matmul_precision(\"high\") in your script")
    return Check("tf32", PASS, f"on ({state})")


def check_shm(m: Machine) -> Check:
    """DataLoader workers hand every batch to the trainer through /dev/shm, and NCCL keeps its intra-node
    buffers there. Below 64 MiB (Docker's default size) fail: one batch of 256 224x224 fp32 images is 154 MB.
    Below 1 GiB warn: NCCL's troubleshooting guide asks for --shm-size=1g at least, and 8 workers with
    prefetch_factor 2 keep 16 such batches in flight."""
    fix = "docker run --shm-size=8g (or --ipc=host); on a host: sudo mount -o remount,size=8G /dev/shm"
    if "shm" in m.errors:
        return Check("/dev/shm", WARN, f"could not read its size: {m.errors['shm']}", fix)
    if m.shm_bytes is None:
        if not m.linux:
            return Check("/dev/shm", PASS, "n/a off Linux")
        return Check("/dev/shm", FAIL, "missing: DataLoader workers (num_workers > 0) and NCCL cannot share memory",
                     fix)
    size = _size(m.shm_bytes)
    if m.shm_bytes < 64 * MIB:
        return Check("/dev/shm", FAIL, f"{size}, below Docker's 64 MiB default: DataLoader workers die with 'bus "
                                       "error' once a batch exceeds it (one 256x3x224x224 fp32 batch is 154 MB)", fix)
    if m.shm_bytes < GIB:
        return Check("/dev/shm", WARN, f"{size}: DataLoader workers and NCCL pass data through it; a few "
                                       "batches in flight fill it (Docker's default is 64 MiB)", fix)
    return Check("/dev/shm", PASS, f"{size}")


def check_memlock(m: Machine) -> Check:
    """``ulimit -l`` caps the memory a process may lock. RDMA (NCCL over InfiniBand / RoCE) registers its
    buffers with ibv_reg_mr, which is charged to this limit: with RDMA devices, anything but unlimited warns
    (NCCL's and NVIDIA's guides run containers with --ulimit memlock=-1). With a GPU but no RDMA, below
    64 MiB warns: Docker's default is 8 MiB, and NCCL's troubleshooting guide asks containers to lift it
    ("Docker containers default to limited shared and pinned memory resources": --ulimit memlock=-1). CUDA's
    own pinned allocations (pin_memory, cudaHostAlloc) are pinned by the NVIDIA driver, not by mlock
    (pin_memory works under Docker's default limit), hence no stricter threshold. Without a GPU nothing aiak
    does pins memory (pin_memory is a no-op): pass."""
    fix = "ulimit -l unlimited (in a container: docker run --ulimit memlock=-1; under systemd: LimitMEMLOCK=infinity)"
    if "memlock" in m.errors:
        return Check("ulimit -l", WARN, f"could not read RLIMIT_MEMLOCK: {m.errors['memlock']}", fix)
    limit = "unlimited" if m.memlock_bytes is None else _size(m.memlock_bytes)
    rdma = rdma_devices(m)
    if m.memlock_bytes is None:
        return Check("ulimit -l", PASS, "unlimited")
    if rdma:
        return Check("ulimit -l", WARN, f"{limit} with RDMA devices ({', '.join(n for n, _ in rdma)}): NCCL's "
                                        "registered network buffers count against it; NCCL fails or falls back to TCP",
                     fix)
    if m.gpus and m.memlock_bytes < 64 * MIB:
        return Check("ulimit -l", WARN, f"{limit}: NCCL's troubleshooting guide asks containers to lift it for "
                                        "NCCL's pinned host buffers (Docker's default is 8 MiB)", fix)
    if not m.gpus:
        return Check("ulimit -l", PASS, f"{limit} (no GPU: nothing is pinned)")
    return Check("ulimit -l", PASS, limit)


def recommended_workers(cores: int, gpus: int) -> int:
    """DataLoader workers per training process: the processes (one per GPU) share the cores, capped at 8 each
    (every worker is a process with its own copy of the dataset object). torch's DataLoader itself warns when
    the workers outnumber the cores it may run on."""
    return max(1, min(8, cores // max(1, gpus)))


def check_workers(m: Machine, num_workers: Optional[int] = None) -> Check:
    """Usable cores (affinity mask, capped by the container's CPU quota) against ``num_workers``."""
    quota = cgroup_cpu_limit(m)
    cores = max(1, min(m.cpus, math.floor(quota))) if quota else m.cpus
    source = f"{m.cpus} in the affinity mask" + (f", CPU quota {quota:g}" if quota else "")
    if "cpus" in m.errors:
        source += f" (affinity unreadable: {m.errors['cpus']})"
    gpus = len(m.gpus)
    processes = max(1, gpus)
    best = recommended_workers(cores, gpus)
    fix = f"DataLoader(..., num_workers={best}, pin_memory={gpus > 0})"
    if num_workers is None:
        return Check("cpu cores", PASS, f"{cores} usable ({source}): num_workers={best} per training process "
                                        f"suits {processes} process(es) (min(8, cores // GPUs))")
    if num_workers == 0 and gpus:
        return Check("cpu cores", WARN, f"num_workers=0 with {gpus} GPU(s): every batch is loaded in the training "
                                        "process and the GPU waits for it", fix)
    if num_workers * processes > cores:
        return Check("cpu cores", WARN, f"num_workers={num_workers} x {processes} process(es) = "
                                        f"{num_workers * processes} workers on {cores} usable cores ({source}): "
                                        "oversubscribed, loading and training slow each other", fix)
    return Check("cpu cores", PASS, f"num_workers={num_workers} x {processes} process(es) fits {cores} usable cores")


# Other work's load per usable core above which doctor warns. torch runs one intra-op thread per usable core, so
# with a load L of other work on C cores a training step gets about C / (C + L) of the CPU, and as that load comes
# and goes the same step's time moves with it: past L = C / 2 (a step under 2/3 of the CPU, up to 1.5x slower,
# by an amount that varies) aiak's alternating rounds cannot tell a few percent of speedup from the drift. Below
# it, a shell, an editor or a short job is ordinary background.
BUSY_LOAD_PER_CORE = 0.5
OWN_LOAD = 1.0  # doctor's own process, running when it reads the load


def load_check(loadavg: Optional[float], cores: int) -> Check:
    """The 1-minute load average ``loadavg`` on ``cores`` usable cores: a warning when the load of other work
    (doctor's own process taken off) exceeds `BUSY_LOAD_PER_CORE` x ``cores``."""
    if loadavg is None:
        return Check("load", PASS, "n/a: the load average cannot be read here")
    others = max(0.0, loadavg - OWN_LOAD)
    said = f"1-minute load average {loadavg:.1f} on {cores} usable core{'s' if cores != 1 else ''}"
    if others > BUSY_LOAD_PER_CORE * cores:
        return Check("load", WARN, f"{said} ({others:.1f} of other work): training shares the CPU, so step times "
                                   "and aiak's trials are distorted",
                     "measure again on an idle machine: let the other work finish or stop it (top lists it) before "
                     "timing steps, tuning (tune:) or running aiak bench / demo")
    return Check("load", PASS, f"{said}: quiet enough to time training")


def check_load(m: Machine) -> Check:
    """The machine's load against the cores in this process's affinity mask (`load_check`)."""
    return load_check(m.loadavg, m.cpus)


def check_network(m: Machine) -> Check:
    ifaces = interfaces(m)
    if not ifaces:
        if not m.linux:
            return Check("network", PASS, "n/a off Linux")
        return Check("network", WARN, f"no interface listed in {m.sys / 'class' / 'net'}",
                     "mount /sys (read-only is enough) or run doctor on the host")
    return Check("network", PASS, ", ".join(_describe(i) for i in ifaces))


def check_socket_ifname(m: Machine) -> Check:
    """NCCL_SOCKET_IFNAME must select an interface that is up; unset with several candidates up, NCCL may
    bootstrap over the wrong one (it skips lo and docker*, prefers ib*, then takes what it finds first)."""
    name = "NCCL_SOCKET_IFNAME"
    ifaces = interfaces(m)
    best = fastest(ifaces)
    exact_best = (f"export NCCL_SOCKET_IFNAME=={best.name}" if best
                  else "bring the cluster interface up: sudo ip link set <name> up")
    value = m.environ.get(name)
    if value is not None and value.strip():
        exclude, exact, items = parse_ifname_filter(value)
        up = [i.name for i in ifaces if i.up]
        selected = filter_names(up, value)
        if not items:
            return Check(name, FAIL, f"{value!r} lists no interface", exact_best)
        if not selected:
            listing = ", ".join(map(_describe, ifaces)) or "none listed"
            return Check(name, FAIL, f"{value!r} selects no interface that is up ({listing}): NCCL cannot start",
                         exact_best)
        missing = [item for item in items if exact and not exclude and item not in up]
        if missing:
            return Check(name, WARN, f"{value!r}: {', '.join(missing)} missing or down; NCCL uses "
                                     f"{', '.join(selected)}", f"export NCCL_SOCKET_IFNAME=={','.join(selected)}")
        return Check(name, PASS, f"{value!r}: NCCL uses {', '.join(selected)}")
    candidates = [i for i in ifaces if i.up and not i.loopback and not i.name.startswith("docker")]
    preferred = [i for i in candidates if i.name.startswith("ib")] or candidates
    if len(preferred) > 1 and m.gpus:
        listing = ", ".join(map(_describe, preferred))
        return Check(name, WARN, f"unset and {len(preferred)} interfaces are up ({listing}): NCCL takes the first "
                                 "it finds, maybe a slow or unrouted one", exact_best)
    if not preferred:
        return Check(name, PASS, "unset; only loopback is up: single-node runs only")
    if not m.gpus:
        return Check(name, PASS, f"unset; n/a without a GPU (gloo picks the interface of the hostname; "
                                 f"GLOO_SOCKET_IFNAME overrides); up: {', '.join(i.name for i in preferred)}")
    return Check(name, PASS, f"unset; NCCL will use {preferred[0].name}")


def check_gloo_ifname(m: Machine) -> List[Check]:
    """GLOO_SOCKET_IFNAME (only when set): a comma list of exact interface names, each must be up."""
    value = m.environ.get("GLOO_SOCKET_IFNAME")
    if value is None:
        return []
    ifaces = interfaces(m)
    up = {i.name for i in ifaces if i.up}
    names = [n.strip() for n in value.split(",") if n.strip()]
    bad = [n for n in names if n not in up]
    best = fastest(ifaces)
    if not names or bad:
        return [Check("GLOO_SOCKET_IFNAME", FAIL, f"{value!r}: {', '.join(bad) or 'nothing'} not an interface that "
                                                  "is up: gloo fails at init_process_group",
                      f"export GLOO_SOCKET_IFNAME={best.name}" if best else "unset GLOO_SOCKET_IFNAME")]
    return [Check("GLOO_SOCKET_IFNAME", PASS, f"{value!r}: up")]


def check_ib(m: Machine) -> Check:
    """RDMA devices with NCCL_IB_DISABLE set, no active port, or an NCCL_IB_HCA that selects none of them."""
    name = "NCCL_IB"
    devices = rdma_devices(m)
    disable = m.environ.get("NCCL_IB_DISABLE")
    hca = m.environ.get("NCCL_IB_HCA")
    if not devices:
        said = f"; NCCL_IB_DISABLE={disable} changes nothing" if disable is not None else ""
        return Check(name, PASS, f"no InfiniBand / RoCE device: NCCL uses TCP sockets between nodes{said}")
    listing = ", ".join(f"{n} ({d})" for n, d in devices)
    if disable is not None:
        number = _parse_int(disable.strip())
        if number is None:
            return Check(name, WARN, f"NCCL_IB_DISABLE={disable!r} is not an integer: NCCL ignores it and keeps "
                                     "RDMA on", "unset NCCL_IB_DISABLE (RDMA on) or export NCCL_IB_DISABLE=1 (off)")
        if number != 0:
            return Check(name, WARN, f"NCCL_IB_DISABLE={disable} while RDMA devices are present ({listing}): "
                                     "RDMA bought but unused, NCCL falls back to TCP sockets", "unset NCCL_IB_DISABLE")
    active = [n for n, d in devices if _rdma_active(d)]
    if hca is not None and hca.strip():
        chosen = filter_names([n for n, _ in devices], hca)
        if not chosen:
            fix = f"export NCCL_IB_HCA=={','.join(active)}" if active else "unset NCCL_IB_HCA"
            return Check(name, FAIL, f"NCCL_IB_HCA={hca!r} selects none of the RDMA devices ({listing}): NCCL "
                                     "falls back to TCP sockets", fix)
    if not active:
        return Check(name, WARN, f"{listing}: no port is ACTIVE, NCCL cannot use RDMA",
                     "ibstat shows each port's state: cable it, and run a subnet manager for InfiniBand (opensm)")
    return Check(name, PASS, f"{len(devices)} RDMA device(s): {listing}")


NCCL_SOCKETS_MAX = 64   # NCCL refuses more than 64 sockets per peer (NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD)


def check_nccl_sockets(m: Machine) -> Check:
    """NCCL between nodes over TCP sockets (no usable RDMA device) with its default of one socket on one thread
    (NCCL tunes it only on AWS and GCP): one TCP stream rarely fills a cloud link, whose providers cap each
    flow. ``NCCL_SOCKET_NTHREADS`` (1-16) x ``NCCL_NSOCKS_PERTHREAD`` sockets per peer, at most 64; NCCL reads
    them once per process, when its first communicator is created, so they belong in the job's environment."""
    name = "NCCL sockets"
    if not m.gpus:
        return Check(name, PASS, "n/a without a GPU (gloo: comm.connections sets TCP connections per peer)")
    disable = _parse_int((m.environ.get("NCCL_IB_DISABLE") or "0").strip())
    if any(_rdma_active(d) for _, d in rdma_devices(m)) and not disable:
        return Check(name, PASS, "n/a: NCCL uses InfiniBand / RoCE between nodes")
    values = {}
    for var, high in (("NCCL_SOCKET_NTHREADS", 16), ("NCCL_NSOCKS_PERTHREAD", NCCL_SOCKETS_MAX)):
        raw = m.environ.get(var)
        number = _parse_int(raw.strip()) if raw is not None else 1
        if number is None or not 1 <= number <= high:
            return Check(name, WARN, f"{var}={raw!r} is not an integer in 1-{high}: NCCL ignores it",
                         f"export {var}=4")
        values[var] = number
    sockets = values["NCCL_SOCKET_NTHREADS"] * values["NCCL_NSOCKS_PERTHREAD"]
    setting = " x ".join(f"{var}={values[var]}" for var in values)
    if sockets > NCCL_SOCKETS_MAX:
        return Check(name, WARN, f"{setting} asks for {sockets} sockets per peer, more than NCCL's "
                                 f"{NCCL_SOCKETS_MAX}: NCCL fails to connect", "export NCCL_NSOCKS_PERTHREAD=4")
    uplinks = [i for i in interfaces(m) if i.up and not i.loopback and not i.name.startswith("docker")]
    if sockets == 1 and uplinks:
        return Check(name, WARN, "NCCL between nodes over TCP sockets with one socket per peer (its default off "
                                 "AWS and GCP): one stream rarely fills a cloud link, which caps each flow",
                     "export NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4 in the job's environment (NCCL reads "
                     "them once, at its first communicator)")
    return Check(name, PASS, f"{sockets} socket(s) per peer ({setting})" if sockets > 1
                 else "one socket per peer; no interface but loopback is up (single node)")


def check_gdr_level(m: Machine) -> Check:
    """NCCL_NET_GDR_LEVEL must be a path type NCCL knows (case-sensitive) or a legacy digit; LOC turns
    GPUDirect RDMA off."""
    name = "NCCL_NET_GDR_LEVEL"
    value = m.environ.get(name)
    if value is None:
        return Check(name, PASS, "unset: NCCL decides by the GPU-NIC distance (GPUDirect RDMA up to PXB)")
    valid = value in NCCL_PATH_TYPES or value[:1].isdigit()
    if not valid:
        upper = value.strip().upper()
        fix = f"export {name}={upper}" if upper in GDR_LEVELS else f"unset {name} (valid: {', '.join(GDR_LEVELS)})"
        return Check(name, WARN, f"{value!r} is not a level NCCL knows (it compares case-sensitively): ignored", fix)
    off = value == "LOC" or value.strip() == "0"
    if off and rdma_devices(m) and m.gpus:
        return Check(name, WARN, f"{value}: GPUDirect RDMA off while RDMA devices and GPUs are present: every "
                                 "message is staged through host memory", f"unset {name}")
    legacy = " (digits are NCCL's legacy form: prefer a name)" if value[:1].isdigit() else ""
    return Check(name, PASS, f"{value}{legacy}")


def check_nccl_debug(m: Machine) -> Check:
    value = m.environ.get("NCCL_DEBUG")
    if value is None:
        return Check("NCCL_DEBUG", PASS, "unset (NCCL_DEBUG=INFO prints the interface and transport NCCL picks: "
                                         "NET/IB or NET/Socket, GDR on or off)")
    if value.upper() not in NCCL_DEBUG_LEVELS:
        return Check("NCCL_DEBUG", WARN, f"{value!r} is not a level NCCL knows ({', '.join(NCCL_DEBUG_LEVELS)})",
                     "export NCCL_DEBUG=WARN (or INFO while diagnosing)")
    return Check("NCCL_DEBUG", PASS, value)


def check_gpudirect(m: Machine) -> Check:
    """RDMA devices and NVIDIA GPUs without nvidia_peermem: NCCL stages every inter-node message through host
    memory instead of letting the NIC read GPU memory (unless its DMA-BUF path applies: NCCL >= 2.13,
    Linux >= 5.12, the open GPU kernel modules; NCCL_DEBUG=INFO says "DMABUF")."""
    name = "GPUDirect RDMA"
    devices = rdma_devices(m)
    if not devices:
        return Check(name, PASS, "n/a: no InfiniBand / RoCE device")
    if not (m.gpus or nvidia_driver(m)[0]):
        return Check(name, PASS, "n/a: no NVIDIA GPU")
    modules = loaded_modules(m)
    if modules is None:
        return Check(name, WARN, f"could not read the loaded kernel modules ({m.proc / 'modules'}, {m.sys / 'module'})",
                     "lsmod | grep peermem on the host; load it with: sudo modprobe nvidia_peermem")
    loaded = [mod for mod in PEERMEM_MODULES if mod in modules]
    if loaded:
        return Check(name, PASS, f"{loaded[0]} loaded: the NICs read and write GPU memory directly")
    return Check(name, WARN, "RDMA devices and NVIDIA GPUs present but nvidia_peermem is not loaded: RDMA bought, "
                             "GPUDirect RDMA unused (messages staged through host memory)",
                 "sudo modprobe nvidia_peermem (and add it to /etc/modules-load.d/ to keep it)")


def check_triton(m: Machine) -> Check:
    """Missing triton on a GPU machine warns: aiak's fused window attention then falls back to torch. Without
    a GPU it passes (nothing would use it); TRITON_INTERPRET=1 warns: kernels run in the slow interpreter."""
    extra = m.extras.get("triton") or ExtraFacts("triton")
    interpret = m.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if extra.version is None:
        if m.gpus:
            return Check("triton", WARN, "not installed: aiak's fused Swin window attention falls back to torch",
                         'pip install "aiak[triton]"')
        return Check("triton", PASS, "not installed; not needed without a CUDA GPU "
                                     '(on one: pip install "aiak[triton]")')
    if interpret:
        return Check("triton", WARN, f"{extra.version} with TRITON_INTERPRET={m.environ['TRITON_INTERPRET']}: "
                                     "every kernel runs in Triton's Python interpreter, orders of magnitude slower "
                                     "(meant for tests)", "unset TRITON_INTERPRET outside tests")
    if not m.gpus:
        return Check("triton", PASS, f"{extra.version}; not used here: no CUDA GPU (window attention runs with torch)")
    if extra.runs is False:
        return Check("triton", WARN, f"{extra.version} installed but a test kernel failed: {extra.detail}",
                     'pip install --force-reinstall "aiak[triton]"')
    ran = f": a test kernel ran, {extra.detail}" if extra.runs else " (kernel not run: --no-probes)"
    return Check("triton", PASS, f"{extra.version}{ran}")


def check_dali(m: Machine) -> Check:
    """DALI is used only when a script calls aiak.loaders.dali_loader, which names the extra if it is missing:
    so missing passes with the hint; installed but failing its one-batch pipeline warns."""
    extra = m.extras.get("dali") or ExtraFacts(DALI_DISTS[0])
    if extra.version is None:
        return Check("dali", PASS, 'not installed (only aiak.loaders.dali_loader needs it: pip install "aiak[dali]")')
    if extra.runs is False:
        cuda = _parse_int(extra.dist.rpartition("cuda")[2][:-1])  # nvidia-dali-cuda120 -> 12
        need = f" (on GPUs it needs a >= {CUDA_MIN_DRIVER[cuda]} driver)" if cuda in CUDA_MIN_DRIVER else ""
        return Check("dali", WARN, f"{extra.version} installed but a one-batch pipeline failed: {extra.detail}",
                     f'pip install --force-reinstall "{extra.dist}"{need}')
    ran = f": a one-batch pipeline ran, {extra.detail}" if extra.runs else " (pipeline not run: --no-probes)"
    return Check("dali", PASS, f"{extra.version}{ran}")


def check_apex(m: Machine) -> Check:
    """apex is never required (aiak's O2 replaces apex.amp); an apex that does not import warns, because
    libraries that find it installed (transformers, timm) import it."""
    extra = m.extras.get("apex") or ExtraFacts("apex")
    if extra.version is None:
        return Check("apex", PASS, "not installed (not needed: aiak's O2 precision replaces apex.amp)")
    if extra.runs is False:
        return Check("apex", WARN, f"{extra.version} installed but does not import: {extra.detail}",
                     "pip uninstall apex (aiak never needs it)")
    if extra.runs and "does not load" in extra.detail and m.gpus:
        return Check("apex", WARN, f"{extra.version}: a Python-only build, its fused CUDA kernels do not load "
                                   f"({extra.detail})", "pip uninstall apex (aiak's O2 replaces it)")
    return Check("apex", PASS, f"{extra.version}" + (f": {extra.detail}" if extra.detail else ""))


def check_backends(m: Machine) -> Check:
    t = m.torch
    if t.version is None:
        return Check("backends", WARN, "not checked: torch does not import", "fix torch first (the torch line)")
    if not t.distributed:
        return Check("backends", WARN, "torch.distributed is not built into this torch: no multi-process training",
                     torch_install_command(m, cpu=not m.gpus))
    have = [b for b, ok in (("gloo", t.gloo), ("nccl", t.nccl_backend)) if ok]
    if m.gpus and not t.nccl_backend:
        return Check("backends", WARN, f"{', '.join(have) or 'none'}: no NCCL, multi-GPU runs fall back to gloo "
                                       "(slow)", torch_install_command(m))
    if not t.gloo:
        return Check("backends", WARN, f"{', '.join(have) or 'none'}: no gloo, CPU distributed training cannot start",
                     torch_install_command(m, cpu=not m.gpus))
    return Check("backends", PASS, ", ".join(have))


CHECKS: Tuple[Callable[..., Union[Check, List[Check]]], ...] = (
    check_python, check_torch, check_cudnn, check_nccl, check_gpu, check_cpu, check_tf32, check_shm,
    check_memlock, check_workers, check_load, check_network, check_socket_ifname, check_gloo_ifname, check_ib,
    check_nccl_sockets, check_gdr_level, check_nccl_debug, check_gpudirect, check_triton, check_dali, check_apex,
    check_backends,
)


def checks(m: Machine, num_workers: Optional[int] = None) -> List[Check]:
    """Every check over ``m``, in report order. A check that raises becomes a warn saying what failed."""
    out: List[Check] = []
    for check in CHECKS:
        try:
            result = check(m, num_workers) if check is check_workers else check(m)
        except Exception as e:
            name = check.__name__.replace("check_", "")
            result = Check(name, WARN, f"could not check: {one_line(f'{type(e).__name__}: {e}')}",
                           "rerun aiak doctor --json and attach it to an aiak issue")
        out.extend(result if isinstance(result, list) else [result])
    return [Check(c.name, c.status, one_line(c.detail), one_line(c.fix)) for c in out]


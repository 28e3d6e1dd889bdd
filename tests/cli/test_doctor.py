"""``aiak doctor``: every check over simulated machines (a fake /proc, /sys and /dev under tmp_path, a fake
environment and fake TorchFacts), the exit codes and JSON of ``run()``, and the real command on this machine."""
import argparse
import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from aiak.cli import doctor
from aiak.cli.doctor import ExtraFacts, GpuFacts, Machine, TorchFacts
from aiak.runtime.patches import DECLARED, Patch

GIB, MIB = 2 ** 30, 2 ** 20
REPO = Path(__file__).resolve().parents[2]

CPU_TORCH = dict(version="2.14.1+cpu", gloo=True)
A100 = GpuFacts("NVIDIA A100-SXM4-80GB", (8, 0), 80.0)
V100 = GpuFacts("Tesla V100-SXM2-32GB", (7, 0), 32.0)
GPU_TORCH = dict(version="2.14.1+cu128", cuda="12.8", cuda_available=True, gpus=[A100], arch_list=["sm_80", "sm_90"],
                 cudnn=90100, nccl="2.21.5", gloo=True, nccl_backend=True)
ETH = {"lo": ("unknown", None, "0x9"), "eth0": ("up", 25000, "0x1003")}


def fake_machine(tmp_path, *, cpu_flags="fpu sse2 avx2 avx512f avx512_bf16", cpu_model="Test CPU", driver=None,
                 dev_nodes=0, torch=None, ifaces=ETH, rdma=None, modules=None, sys_modules=None, environ=None,
                 shm=8 * GIB, memlock=None, cpus=8, extras=None, cgroup_v2=None, cgroup_v1=None, python="3.11.7",
                 errors=None, loadavg=0.5):
    """A Machine over a fake tree: every argument writes the files the real machine would have."""
    proc, sysfs, dev = tmp_path / "proc", tmp_path / "sys", tmp_path / "dev"
    for root in (proc, sysfs, dev):
        root.mkdir(parents=True, exist_ok=True)
    if cpu_flags is not None:
        (proc / "cpuinfo").write_text(f"processor\t: 0\nmodel name\t: {cpu_model}\nflags\t\t: {cpu_flags}\n\n"
                                      f"processor\t: 1\nmodel name\t: {cpu_model}\nflags\t\t: {cpu_flags}\n")
    if driver is not None:
        (proc / "driver" / "nvidia").mkdir(parents=True)
        (proc / "driver" / "nvidia" / "version").write_text(
            f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {driver}  Release Build  (dvs-builder@U16)\n"
            "GCC version:  gcc version 12.3.0\n")
    for i in range(dev_nodes):
        (dev / f"nvidia{i}").write_text("")
    if dev_nodes:
        (dev / "nvidiactl").write_text("")
        (dev / "nvidia-uvm").write_text("")
    for name, (state, speed, flags) in (ifaces or {}).items():
        d = sysfs / "class" / "net" / name
        d.mkdir(parents=True)
        (d / "operstate").write_text(state + "\n")
        (d / "flags").write_text(flags + "\n")
        (d / "type").write_text("772\n" if name == "lo" else "1\n")
        if speed is not None:
            (d / "speed").write_text(f"{speed}\n")
    for name, (state, layer, rate) in (rdma or {}).items():
        port = sysfs / "class" / "infiniband" / name / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text(state + "\n")
        (port / "link_layer").write_text(layer + "\n")
        (port / "rate").write_text(rate + "\n")
    if modules is not None:
        (proc / "modules").write_text("".join(f"{m} 16384 0 - Live 0x0000000000000000\n" for m in modules))
    for name in sys_modules or ():
        (sysfs / "module" / name).mkdir(parents=True)
    if cgroup_v2 is not None:
        (sysfs / "fs" / "cgroup").mkdir(parents=True)
        (sysfs / "fs" / "cgroup" / "cpu.max").write_text(cgroup_v2 + "\n")
    if cgroup_v1 is not None:
        (sysfs / "fs" / "cgroup" / "cpu").mkdir(parents=True)
        (sysfs / "fs" / "cgroup" / "cpu" / "cpu.cfs_quota_us").write_text(f"{cgroup_v1[0]}\n")
        (sysfs / "fs" / "cgroup" / "cpu" / "cpu.cfs_period_us").write_text(f"{cgroup_v1[1]}\n")
    all_extras = {"triton": ExtraFacts("triton"), "dali": ExtraFacts("nvidia-dali-cuda120"), "apex": ExtraFacts("apex")}
    all_extras.update(extras or {})
    return Machine(proc=proc, sys=sysfs, dev=dev, environ=dict(environ or {}), shm_bytes=shm, memlock_bytes=memlock,
                   cpus=cpus, torch=TorchFacts(**(torch or CPU_TORCH)), extras=all_extras, platform="linux",
                   python=python, errors=dict(errors or {}), loadavg=loadavg)


def gpu_machine(tmp_path, torch=None, **kw):
    """A Linux host with one A100 that torch sees, driver 570."""
    kw.setdefault("driver", "570.86.15")
    kw.setdefault("dev_nodes", 1)
    return fake_machine(tmp_path, torch={**GPU_TORCH, **(torch or {})}, **kw)


def find(m, name, num_workers=None):
    """The check ``name`` of ``checks(m)``; asserts over every check that each warn and fail carries a fix."""
    results = doctor.checks(m, num_workers)
    for c in results:
        assert c.status in ("pass", "warn", "fail"), c
        assert c.status == "pass" or c.fix.strip(), f"{c.name} {c.status} without a fix: {c.detail}"
        assert "\n" not in c.detail + c.fix
    matches = [c for c in results if c.name == name]
    assert len(matches) == 1, [c.name for c in results]
    return matches[0]


def test_the_default_fake_machine_passes_everything(tmp_path):
    results = doctor.checks(fake_machine(tmp_path))
    assert [c for c in results if c.status != "pass"] == []
    assert doctor.exit_code(results) == 0


# -- versions -------------------------------------------------------------------------------------------------
def test_torch_version_build_and_import_failure(tmp_path):
    c = find(fake_machine(tmp_path / "a"), "torch")
    assert c.status == "pass" and c.detail == "2.14.1+cpu (CPU build)"
    c = find(gpu_machine(tmp_path / "b"), "torch")
    assert c.status == "pass" and "CUDA 12.8 build" in c.detail
    c = find(fake_machine(tmp_path / "c", torch=dict(version="1.13.1+cu117", cuda="11.7")), "torch")
    assert c.status == "fail" and ">= 2.1" in c.detail and "torch>=2.1" in c.fix
    c = find(fake_machine(tmp_path / "d", torch=dict(import_error="OSError: libtorch_cuda.so: cannot open")), "torch")
    assert c.status == "fail" and "libtorch_cuda.so" in c.detail
    assert c.fix.startswith("pip install --force-reinstall torch") and "whl/cpu" in c.fix  # no driver: the CPU wheel


def test_python_version(tmp_path):
    assert find(fake_machine(tmp_path / "a"), "python").status == "pass"
    c = find(fake_machine(tmp_path / "b", python="3.8.18"), "python")
    assert c.status == "fail" and "venv" in c.fix


def test_cudnn_version_and_missing_cudnn_on_a_gpu(tmp_path):
    assert find(gpu_machine(tmp_path / "a"), "cudnn").detail == "9.1.0"
    assert find(gpu_machine(tmp_path / "b", torch=dict(cudnn=8902)), "cudnn").detail == "8.9.2"
    assert find(fake_machine(tmp_path / "c"), "cudnn").detail == "n/a: CPU build of torch"
    c = find(gpu_machine(tmp_path / "d", torch=dict(cudnn=None)), "cudnn")
    assert c.status == "warn" and c.fix == "pip install --force-reinstall nvidia-cudnn-cu12"


def test_nccl_version_is_read_only_with_a_gpu(tmp_path):
    c = find(fake_machine(tmp_path / "a", torch=dict(version="2.14.1+cu128", cuda="12.8", gloo=True)), "nccl")
    assert c.status == "pass" and c.detail.startswith("n/a")
    assert find(gpu_machine(tmp_path / "b"), "nccl").detail == "2.21.5"
    c = find(gpu_machine(tmp_path / "c", torch=dict(nccl=None)), "nccl")
    assert c.status == "warn" and "--index-url" in c.fix


def test_importing_doctor_imports_no_torch_so_a_broken_torch_is_reported_not_raised():
    code = "import sys, aiak.cli.doctor; print(sorted(m for m in ('torch', 'triton', 'nvidia.dali') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


# -- GPU visibility and capability ----------------------------------------------------------------------------
def test_no_driver_is_cpu_training(tmp_path):
    c = find(fake_machine(tmp_path), "gpu")
    assert c.status == "pass" and c.detail.startswith("no NVIDIA GPU: CPU training")


def test_a_cpu_wheel_on_a_gpu_machine_fails_with_the_pinned_cuda_install(tmp_path):
    c = find(fake_machine(tmp_path, driver="570.86.15", dev_nodes=2), "gpu")
    assert c.status == "fail" and "CPU build" in c.detail
    assert "570.86.15" in c.detail and "2 GPU device node" in c.detail
    assert c.fix == ("pip install --force-reinstall torch==2.14.1 --index-url https://download.pytorch.org/whl/cu126")


@pytest.mark.parametrize("env, driver, nodes, expect_detail, expect_fix", [
    ({"CUDA_VISIBLE_DEVICES": ""}, "580.65.06", 2, "hides every GPU", "unset CUDA_VISIBLE_DEVICES"),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, "580.65.06", 2, "hides every GPU", "unset CUDA_VISIBLE_DEVICES"),
    ({"CUDA_VISIBLE_DEVICES": "4"}, "580.65.06", 2, "hides every GPU", "unset CUDA_VISIBLE_DEVICES"),
    ({}, "570.86.15", 2, "too old for torch's CUDA 13.0 build", "whl/cu126"),
    ({}, "580.65.06", 0, "no /dev/nvidiaN device node", "docker run --gpus all"),
    ({"CUDA_VISIBLE_DEVICES": "1"}, "580.65.06", 2, "sees no GPU", "nvidia-smi"),
], ids=["cvd-empty", "cvd-minus-one", "cvd-past-last", "driver-too-old", "no-device-nodes", "otherwise"])
def test_driver_present_but_torch_sees_no_gpu_fails_with_the_reason(tmp_path, env, driver, nodes, expect_detail,
                                                                     expect_fix):
    torch = dict(version="2.14.1+cu130", cuda="13.0", cuda_available=False, gloo=True, nccl_backend=True,
                 cuda_warning="CUDA initialization: The NVIDIA driver on your system is too old")
    c = find(fake_machine(tmp_path, driver=driver, dev_nodes=nodes, torch=torch, environ=env), "gpu")
    assert c.status == "fail" and expect_detail in c.detail and expect_fix in c.fix
    assert "driver on your system is too old" in c.detail  # what torch itself warned is shown


def test_each_visible_gpu_gets_capability_bf16_and_tf32(tmp_path):
    m = gpu_machine(tmp_path / "a", torch=dict(gpus=[A100, V100], arch_list=["sm_70", "sm_80"]))
    assert find(m, "gpu").status == "pass" and "2 GPU(s)" in find(m, "gpu").detail
    gpu0, gpu1 = find(m, "gpu0"), find(m, "gpu1")
    assert gpu0.status == "pass" and "sm 8.0" in gpu0.detail and "bf16 native, TF32" in gpu0.detail
    assert gpu1.status == "pass" and "sm 7.0" in gpu1.detail
    assert "bf16 emulated" in gpu1.detail and "no TF32" in gpu1.detail
    m = gpu_machine(tmp_path / "b", torch=dict(gpus=[A100] * 4 + [V100], arch_list=["sm_70", "sm_80"]))
    names = [c.name for c in doctor.checks(m) if c.name.startswith("gpu")]
    assert names == ["gpu", "gpu0-3", "gpu4"]  # identical GPUs share a line


@pytest.mark.parametrize("capability, arch_list, status, wheel", [
    ((8, 6), ["sm_80"], "pass", None),                 # sm_80 cubins run on 8.6
    ((12, 0), ["sm_80", "compute_90"], "pass", None),  # PTX is JIT-compiled for newer GPUs
    ((12, 0), ["sm_80", "sm_90"], "fail", "cu128"),    # Blackwell needs a CUDA 12.8+ build
    ((9, 0), ["sm_90a"], "pass", None),
    ((12, 1), ["sm_80", "sm_120f"], "pass", None),     # family cubins run across the family
    ((6, 0), ["sm_75", "sm_80", "sm_90"], "fail", "cu126"),  # CUDA 12.8+ builds dropped Pascal
    ((8, 9), ["sm_90", "sm_100"], "fail", "cu126"),    # driver 570: the CUDA 12 wheels
], ids=["same-major", "ptx", "blackwell", "arch-specific", "family", "pascal", "older-than-all"])
def test_a_gpu_the_torch_build_has_no_kernels_for_fails(tmp_path, capability, arch_list, status, wheel):
    m = gpu_machine(tmp_path, torch=dict(gpus=[GpuFacts("GPU", capability, 24.0)], arch_list=arch_list))
    c = find(m, "gpu0")
    assert c.status == status
    if status == "fail":
        assert f"sm_{capability[0]}{capability[1]}" in c.detail and "get_arch_list" in c.fix
        assert c.fix.endswith(f"torch==2.14.1 --index-url https://download.pytorch.org/whl/{wheel}")


# -- CPU ------------------------------------------------------------------------------------------------------
def test_cpu_bf16_and_amx(tmp_path):
    amx = "avx512f avx512_bf16 amx_tile amx_bf16"
    c = find(fake_machine(tmp_path / "a", cpu_flags=amx, cpu_model="Xeon 8480"), "cpu")
    assert c.status == "pass" and "AMX" in c.detail and "Xeon 8480" in c.detail
    c = find(fake_machine(tmp_path / "b", cpu_flags="avx2 avx512_bf16"), "cpu")
    assert c.status == "pass" and "avx512_bf16" in c.detail and "AMX" not in c.detail
    c = find(fake_machine(tmp_path / "c", cpu_flags="avx2 fma"), "cpu")
    assert c.status == "warn" and "no bf16" in c.detail and "fp32" in c.fix
    assert find(gpu_machine(tmp_path / "d", cpu_flags="avx2 fma"), "cpu").status == "pass"  # the GPU computes
    c = find(fake_machine(tmp_path / "e", cpu_flags=None), "cpu")
    assert c.status == "warn" and "could not read" in c.detail


# -- TF32 -----------------------------------------------------------------------------------------------------
def test_tf32_off_on_an_ampere_gpu_warns(tmp_path):
    assert find(fake_machine(tmp_path / "a"), "tf32").detail == "n/a: no GPU"
    c = find(gpu_machine(tmp_path / "b"), "tf32")
    assert c.status == "warn" and "A100" in c.detail
    assert "tf32: true" in c.fix and 'torch.set_float32_matmul_precision("high")' in c.fix
    assert find(gpu_machine(tmp_path / "c", torch=dict(matmul_allow_tf32=True)), "tf32").status == "pass"
    assert find(gpu_machine(tmp_path / "d", torch=dict(float32_matmul_precision="high")), "tf32").status == "pass"
    c = find(gpu_machine(tmp_path / "e", torch=dict(gpus=[V100])), "tf32")
    assert c.status == "pass" and "8.0+" in c.detail


# -- /dev/shm and ulimit -l -----------------------------------------------------------------------------------
@pytest.mark.parametrize("size, status", [(32 * MIB, "fail"), (64 * MIB, "warn"), (512 * MIB, "warn"), (GIB, "pass"),
                                          (8 * GIB, "pass"), (None, "fail")])
def test_dev_shm_size(tmp_path, size, status):
    c = find(fake_machine(tmp_path, shm=size), "/dev/shm")
    assert c.status == status
    if status != "pass":
        assert "--shm-size=" in c.fix and "--ipc=host" in c.fix


def test_dev_shm_unreadable_is_a_warning(tmp_path):
    c = find(fake_machine(tmp_path, shm=None, errors={"shm": "PermissionError: denied"}), "/dev/shm")
    assert c.status == "warn" and "PermissionError" in c.detail


MLX = {"mlx5_0": ("4: ACTIVE", "InfiniBand", "200 Gb/sec (4X HDR)")}


@pytest.mark.parametrize("gpu, rdma, memlock, status", [
    (False, None, 8 * MIB, "pass"),     # nothing is pinned without a GPU
    (True, None, 8 * MIB, "warn"),      # Docker's default with a GPU
    (True, None, 64 * MIB, "pass"),
    (True, None, None, "pass"),         # unlimited
    (True, MLX, 16 * GIB, "warn"),      # RDMA registrations want unlimited
    (True, MLX, None, "pass"),
], ids=["cpu-8m", "gpu-8m", "gpu-64m", "gpu-unlimited", "rdma-16g", "rdma-unlimited"])
def test_memlock_limit(tmp_path, gpu, rdma, memlock, status):
    make = gpu_machine if gpu else fake_machine
    c = find(make(tmp_path, rdma=rdma, memlock=memlock, modules=["nvidia_peermem"]), "ulimit -l")
    assert c.status == status
    if status == "warn":
        assert "ulimit -l unlimited" in c.fix and "--ulimit memlock=-1" in c.fix


def test_memlock_unreadable_is_a_warning(tmp_path):
    c = find(gpu_machine(tmp_path, errors={"memlock": "ValueError: bad limit"}), "ulimit -l")
    assert c.status == "warn" and "could not read RLIMIT_MEMLOCK" in c.detail and "ulimit -l unlimited" in c.fix


# -- CPU cores against num_workers ----------------------------------------------------------------------------
def test_workers_recommendation_without_num_workers(tmp_path):
    c = find(gpu_machine(tmp_path / "a", cpus=16, torch=dict(gpus=[A100] * 4)), "cpu cores")
    assert c.status == "pass" and "16 usable" in c.detail and "num_workers=4" in c.detail
    c = find(fake_machine(tmp_path / "b", cpus=64), "cpu cores")
    assert c.status == "pass" and "num_workers=8" in c.detail


@pytest.mark.parametrize("gpus, cpus, workers, status", [
    (1, 16, 0, "warn"),      # the GPU waits for loading
    (0, 16, 0, "pass"),      # CPU training may load in the main process
    (4, 16, 8, "warn"),      # 4 processes x 8 workers on 16 cores
    (4, 16, 4, "pass"),
    (0, 4, 6, "warn"),
])
def test_num_workers_against_cores_and_gpus(tmp_path, gpus, cpus, workers, status):
    m = gpu_machine(tmp_path, cpus=cpus, torch=dict(gpus=[A100] * gpus)) if gpus else fake_machine(tmp_path, cpus=cpus)
    c = find(m, "cpu cores", num_workers=workers)
    assert c.status == status
    if status == "warn":
        assert f"num_workers={doctor.recommended_workers(cpus, gpus)}" in c.fix


@pytest.mark.parametrize("cgroup", [dict(cgroup_v2="200000 100000"), dict(cgroup_v1=(200000, 100000))],
                         ids=["v2", "v1"])
def test_a_container_cpu_quota_caps_the_usable_cores(tmp_path, cgroup):
    m = fake_machine(tmp_path, cpus=8, **cgroup)
    c = find(m, "cpu cores", num_workers=4)
    assert c.status == "warn" and "2 usable cores" in c.detail and "quota 2" in c.detail
    assert find(m, "cpu cores", num_workers=2).status == "pass"


def test_unlimited_cgroup_quota_keeps_the_affinity_count(tmp_path):
    c = find(fake_machine(tmp_path, cpus=8, cgroup_v2="max 100000"), "cpu cores")
    assert "8 usable" in c.detail


def test_a_negative_num_workers_is_one_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        doctor.main(["--num-workers", "-1"])
    assert exit_info.value.code == 2
    assert "--num-workers: must be a whole number >= 0, got '-1'" in capsys.readouterr().err


# -- network and NCCL environment -----------------------------------------------------------------------------
TWO_NICS = {"lo": ("unknown", None, "0x9"), "eth0": ("up", 1000, "0x1003"), "eth1": ("up", 100000, "0x1003"),
            "eth2": ("down", None, "0x1002")}


def test_network_lists_interfaces_with_state_and_speed(tmp_path):
    c = find(fake_machine(tmp_path, ifaces=TWO_NICS), "network")
    assert c.status == "pass"
    assert c.detail == "eth0 up 1 Gb/s, eth1 up 100 Gb/s, eth2 down, lo loopback"


def test_nccl_ifname_grammar():
    assert doctor.parse_ifname_filter("^=eth0,eth1") == (True, True, ["eth0", "eth1"])
    assert doctor.parse_ifname_filter("=mlx5_0:1,mlx5_1:1") == (False, True, ["mlx5_0", "mlx5_1"])
    names = ["eth0", "eth10", "ib0", "docker0", "lo"]
    assert doctor.filter_names(names, "eth") == ["eth0", "eth10"]
    assert doctor.filter_names(names, "=eth1") == []
    assert doctor.filter_names(names, "=eth0") == ["eth0"]
    assert doctor.filter_names(names, "^docker,lo") == ["eth0", "eth10", "ib0"]
    assert doctor.filter_names(names, "^=eth0") == ["eth10", "ib0", "docker0", "lo"]


@pytest.mark.parametrize("value, status, in_detail, fix", [
    ("eth9", "fail", "selects no interface that is up", "export NCCL_SOCKET_IFNAME==eth1"),
    ("=eth2", "fail", "selects no interface that is up", "export NCCL_SOCKET_IFNAME==eth1"),   # eth2 is down
    ("^eth", "pass", "NCCL uses lo", ""),                                                     # lo is up (IFF_UP)
    ("^eth,lo", "fail", "selects no interface", "export NCCL_SOCKET_IFNAME==eth1"),
    ("=eth1,eth5", "warn", "eth5 missing or down", "export NCCL_SOCKET_IFNAME==eth1"),
    ("eth", "pass", "NCCL uses eth0, eth1", ""),
    ("=eth1", "pass", "NCCL uses eth1", ""),
    (",", "fail", "lists no interface", "export NCCL_SOCKET_IFNAME==eth1"),
])
def test_nccl_socket_ifname_set(tmp_path, value, status, in_detail, fix):
    c = find(gpu_machine(tmp_path, ifaces=TWO_NICS, environ={"NCCL_SOCKET_IFNAME": value}), "NCCL_SOCKET_IFNAME")
    assert c.status == status and in_detail in c.detail and c.fix == fix


def test_nccl_socket_ifname_unset(tmp_path):
    c = find(gpu_machine(tmp_path / "a", ifaces=TWO_NICS), "NCCL_SOCKET_IFNAME")
    assert c.status == "warn" and "2 interfaces are up" in c.detail
    assert c.fix == "export NCCL_SOCKET_IFNAME==eth1"  # the fastest up interface
    docker = {"lo": ("unknown", None, "0x9"), "eth0": ("up", 25000, "0x1003"), "docker0": ("up", 10000, "0x1003")}
    c = find(gpu_machine(tmp_path / "b", ifaces=docker), "NCCL_SOCKET_IFNAME")
    assert c.status == "pass" and "NCCL will use eth0" in c.detail  # NCCL skips docker*
    ib = {"eth0": ("up", 25000, "0x1003"), "ib0": ("up", 200000, "0x1003")}
    c = find(gpu_machine(tmp_path / "c", ifaces=ib), "NCCL_SOCKET_IFNAME")
    assert c.status == "pass" and "NCCL will use ib0" in c.detail  # NCCL prefers ib*
    c = find(fake_machine(tmp_path / "d", ifaces=TWO_NICS), "NCCL_SOCKET_IFNAME")
    assert c.status == "pass" and "without a GPU" in c.detail


def test_gloo_socket_ifname_only_when_set(tmp_path):
    names = [c.name for c in doctor.checks(fake_machine(tmp_path / "a"))]
    assert "GLOO_SOCKET_IFNAME" not in names
    c = find(fake_machine(tmp_path / "b", ifaces=TWO_NICS, environ={"GLOO_SOCKET_IFNAME": "eth2"}),
             "GLOO_SOCKET_IFNAME")
    assert c.status == "fail" and c.fix == "export GLOO_SOCKET_IFNAME=eth1"
    c = find(fake_machine(tmp_path / "c", ifaces=TWO_NICS, environ={"GLOO_SOCKET_IFNAME": "eth0"}),
             "GLOO_SOCKET_IFNAME")
    assert c.status == "pass"


@pytest.mark.parametrize("rdma, env, status, in_detail, fix", [
    (None, {}, "pass", "no InfiniBand / RoCE device", ""),
    (None, {"NCCL_IB_DISABLE": "1"}, "pass", "changes nothing", ""),
    (MLX, {}, "pass", "mlx5_0 (port 1 InfiniBand 200 Gb/sec ACTIVE)", ""),
    (MLX, {"NCCL_IB_DISABLE": "1"}, "warn", "RDMA bought but unused", "unset NCCL_IB_DISABLE"),
    (MLX, {"NCCL_IB_DISABLE": "true"}, "warn", "not an integer", "unset NCCL_IB_DISABLE"),
    (MLX, {"NCCL_IB_DISABLE": "0"}, "pass", "1 RDMA device", ""),
    ({"mlx5_0": ("1: DOWN", "Ethernet", "100 Gb/sec")}, {}, "warn", "no port is ACTIVE", "ibstat"),
    (MLX, {"NCCL_IB_HCA": "mlx4"}, "fail", "selects none of the RDMA devices", "export NCCL_IB_HCA==mlx5_0"),
    (MLX, {"NCCL_IB_HCA": "=mlx5_0:1"}, "pass", "1 RDMA device", ""),
], ids=["none", "none-disabled", "ib", "disabled", "disable-not-int", "enabled", "port-down", "hca-miss", "hca-hit"])
def test_nccl_ib(tmp_path, rdma, env, status, in_detail, fix):
    c = find(gpu_machine(tmp_path, rdma=rdma, environ=env, modules=["nvidia_peermem"]), "NCCL_IB")
    assert c.status == status and in_detail in c.detail and fix in c.fix


@pytest.mark.parametrize("gpu, rdma, env, status, in_detail, fix", [
    (False, None, {}, "pass", "n/a without a GPU", ""),
    (True, MLX, {}, "pass", "InfiniBand / RoCE", ""),
    (True, None, {}, "warn", "one socket per peer", "export NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4"),
    (True, MLX, {"NCCL_IB_DISABLE": "1"}, "warn", "one socket per peer", "NCCL_NSOCKS_PERTHREAD=4"),
    (True, None, {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"}, "pass", "16 socket(s) per peer", ""),
    (True, None, {"NCCL_SOCKET_NTHREADS": "8", "NCCL_NSOCKS_PERTHREAD": "16"}, "warn", "more than NCCL's 64",
     "export NCCL_NSOCKS_PERTHREAD=4"),
    (True, None, {"NCCL_SOCKET_NTHREADS": "32"}, "warn", "not an integer in 1-16", "export NCCL_SOCKET_NTHREADS=4"),
    (True, None, {"NCCL_NSOCKS_PERTHREAD": "many"}, "warn", "not an integer", "export NCCL_NSOCKS_PERTHREAD=4"),
], ids=["cpu", "rdma", "default", "ib-disabled", "sixteen", "too-many", "threads-range", "not-int"])
def test_nccl_sockets(tmp_path, gpu, rdma, env, status, in_detail, fix):
    make = gpu_machine if gpu else fake_machine
    c = find(make(tmp_path, rdma=rdma, environ=env, ifaces=TWO_NICS, modules=["nvidia_peermem"]), "NCCL sockets")
    assert c.status == status and in_detail in c.detail and fix in c.fix


@pytest.mark.parametrize("value, rdma, status, fix", [
    (None, MLX, "pass", ""),
    ("PXB", MLX, "pass", ""),
    ("3", MLX, "pass", ""),
    ("pxb", MLX, "warn", "export NCCL_NET_GDR_LEVEL=PXB"),
    ("nearby", MLX, "warn", "unset NCCL_NET_GDR_LEVEL"),
    ("LOC", MLX, "warn", "unset NCCL_NET_GDR_LEVEL"),     # GPUDirect RDMA off with RDMA devices
    ("LOC", None, "pass", ""),
])
def test_nccl_net_gdr_level(tmp_path, value, rdma, status, fix):
    env = {} if value is None else {"NCCL_NET_GDR_LEVEL": value}
    c = find(gpu_machine(tmp_path, rdma=rdma, environ=env, modules=["nvidia_peermem"]), "NCCL_NET_GDR_LEVEL")
    assert c.status == status and fix in c.fix


def test_nccl_debug(tmp_path):
    assert "NCCL_DEBUG=INFO" in find(fake_machine(tmp_path / "a"), "NCCL_DEBUG").detail
    assert find(fake_machine(tmp_path / "b", environ={"NCCL_DEBUG": "INFO"}), "NCCL_DEBUG").status == "pass"
    c = find(fake_machine(tmp_path / "c", environ={"NCCL_DEBUG": "verbose"}), "NCCL_DEBUG")
    assert c.status == "warn" and "NCCL_DEBUG=WARN" in c.fix


# -- GPUDirect RDMA -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, rdma, modules, sys_modules, status", [
    ("gpu", MLX, ["nvidia", "mlx5_core"], None, "warn"),
    ("gpu", MLX, ["nvidia", "nvidia_peermem"], None, "pass"),
    ("gpu", MLX, ["nvidia", "nv_peer_mem"], None, "pass"),
    ("gpu", MLX, None, ["nvidia", "nvidia_peermem"], "pass"),   # no /proc/modules: /sys/module
    ("gpu", MLX, None, None, "warn"),                           # neither readable
    ("gpu", None, ["nvidia"], None, "pass"),                    # no RDMA: n/a
    ("cpu", MLX, ["mlx5_core"], None, "pass"),                  # no GPU: n/a
], ids=["no-peermem", "peermem", "nv_peer_mem", "sys-module", "unreadable", "no-rdma", "no-gpu"])
def test_gpudirect_rdma(tmp_path, make, rdma, modules, sys_modules, status):
    maker = gpu_machine if make == "gpu" else fake_machine
    c = find(maker(tmp_path, rdma=rdma, modules=modules, sys_modules=sys_modules, memlock=None), "GPUDirect RDMA")
    assert c.status == status
    if status == "warn":
        assert "sudo modprobe nvidia_peermem" in c.fix


def test_a_driver_without_torch_gpus_still_counts_as_gpus_for_gpudirect(tmp_path):
    c = find(fake_machine(tmp_path, driver="570.86.15", dev_nodes=1, rdma=MLX, modules=["nvidia"]), "GPUDirect RDMA")
    assert c.status == "warn"


# -- extras and backends --------------------------------------------------------------------------------------
@pytest.mark.parametrize("gpu, extra, env, status, fix", [
    (True, ExtraFacts("triton"), {}, "warn", 'pip install "aiak[triton]"'),
    (False, ExtraFacts("triton"), {}, "pass", ""),
    (False, ExtraFacts("triton", "3.8.0"), {}, "pass", ""),
    (False, ExtraFacts("triton", "3.8.0"), {"TRITON_INTERPRET": "1"}, "warn", "unset TRITON_INTERPRET"),
    (True, ExtraFacts("triton", "3.8.0", True, "kernel ran on A100 (2.0 s)"), {}, "pass", ""),
    (True, ExtraFacts("triton", "3.8.0", False, "ptxas fatal"), {}, "warn",
     'pip install --force-reinstall "aiak[triton]"'),
], ids=["gpu-missing", "cpu-missing", "cpu-installed", "interpreter", "gpu-runs", "gpu-broken"])
def test_triton(tmp_path, gpu, extra, env, status, fix):
    maker = gpu_machine if gpu else fake_machine
    c = find(maker(tmp_path, extras={"triton": extra}, environ=env), "triton")
    assert c.status == status and fix in c.fix
    if extra.version is None and not gpu:
        assert 'pip install "aiak[triton]"' in c.detail  # the hint


def test_dali_and_apex(tmp_path):
    c = find(fake_machine(tmp_path / "a"), "dali")
    assert c.status == "pass" and 'pip install "aiak[dali]"' in c.detail
    ok = ExtraFacts("nvidia-dali-cuda120", "2.4.0", True, "device cpu (2.0 s)")
    assert find(fake_machine(tmp_path / "b", extras={"dali": ok}), "dali").status == "pass"
    broken = ExtraFacts("nvidia-dali-cuda120", "2.4.0", False, "RuntimeError: libcudart.so.12 not found")
    c = find(fake_machine(tmp_path / "c", extras={"dali": broken}), "dali")
    assert c.status == "warn" and "libcudart" in c.detail
    assert c.fix == 'pip install --force-reinstall "nvidia-dali-cuda120" (on GPUs it needs a >= 525 driver)'
    assert find(fake_machine(tmp_path / "d"), "apex").status == "pass"
    bad_apex = ExtraFacts("apex", "0.1", False, "ImportError: cannot import name 'amp'")
    c = find(fake_machine(tmp_path / "e", extras={"apex": bad_apex}), "apex")
    assert c.status == "warn" and c.fix == "pip uninstall apex (aiak never needs it)"
    python_only = ExtraFacts("apex", "0.1", True, "amp_C does not load: ModuleNotFoundError")
    assert find(fake_machine(tmp_path / "f", extras={"apex": python_only}), "apex").status == "pass"
    assert find(gpu_machine(tmp_path / "g", extras={"apex": python_only}), "apex").status == "warn"


def test_distributed_backends(tmp_path):
    assert find(gpu_machine(tmp_path / "a"), "backends").detail == "gloo, nccl"
    c = find(gpu_machine(tmp_path / "b", torch=dict(nccl_backend=False)), "backends")
    assert c.status == "warn" and "no NCCL" in c.detail and "--index-url" in c.fix
    c = find(fake_machine(tmp_path / "c", torch=dict(version="2.14.1+cpu", gloo=False)), "backends")
    assert c.status == "warn" and "whl/cpu" in c.fix
    c = find(fake_machine(tmp_path / "d", torch=dict(version="2.14.1+cpu", distributed=False)), "backends")
    assert c.status == "warn"


# -- aiak's global patches of torch: information, not checks ---------------------------------------------------
def test_patches_are_information_one_short_line_each_with_the_whole_story_under_verbose(tmp_path):
    fresh = fake_machine(tmp_path)
    assert not [c for c in doctor.checks(fresh) if "patch" in c.name]   # not pass checks
    rows = doctor.patch_rows(fresh.patches)
    assert [r["key"] for r in rows] == list(DECLARED) and not any(r["installed"] for r in rows)
    lines = doctor.render_patches(rows)
    assert len(lines) == 1 + len(DECLARED) and all(len(line) <= 160 for line in lines), lines
    for key, row in DECLARED.items():
        line = next(line for line in lines if line.split()[0] == key)
        assert line.endswith(f"not installed; aiak installs it {row.when}") and row.why not in line
    verbose = "\n".join(doctor.render_patches(rows, verbose=True))
    assert all(" ".join(row.why.split()[:6]) in " ".join(verbose.split()) for row in DECLARED.values())
    assert all(len(line) <= 120 for line in verbose.splitlines() if line.startswith(" " * 6))
    clip = Patch("clip", ("torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad_value_"), DECLARED["clip"].why,
                 "aiak.step.clip")
    rows = doctor.patch_rows([clip])
    assert rows[list(DECLARED).index("clip")]["installed"]
    line = next(line for line in doctor.render_patches(rows) if line.split()[0] == "clip")
    assert "installed in this process: torch.nn.utils.clip_grad_norm_ and 1 more" in line


def test_doctor_in_a_process_aiak_optimized_in_lists_the_patches_installed_there():
    code = ("import sys, warnings, torch, aiak, aiak.cli.doctor\n"
            "warnings.simplefilter('ignore')\n"
            "model = torch.nn.Linear(2, 2)\n"
            "aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy={'grad_accumulation': 2})\n"
            "sys.exit(aiak.cli.doctor.main(['--json', '--no-probes', '--num-workers', '1']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert out.returncode in (0, 1, 2) and "Traceback" not in out.stderr, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    by_key = {p["key"]: p for p in report["patches"]}
    assert by_key["clip"]["installed"] and by_key["clip"]["replaces"].startswith("torch.nn.utils.clip_grad_norm_")
    assert by_key["schedulers"]["replaces"].startswith("torch.optim.lr_scheduler.LRScheduler.step")
    assert not by_key["ddp-constructor"]["installed"]   # one process: no DDP
    assert not [c for c in report["checks"] if "patch" in c["name"]]


# -- the load: other work on the cores distorts every timing ---------------------------------------------------
@pytest.mark.parametrize("load, cores, status", [
    (0.2, 2, "pass"), (2.0, 2, "pass"), (2.1, 2, "warn"), (5.0, 2, "warn"), (15.0, 2, "warn"),
    (8.0, 16, "pass"), (9.5, 16, "warn"), (1.4, 1, "pass"), (1.6, 1, "warn"),
])
def test_the_load_warns_when_other_work_holds_more_than_half_the_usable_cores(load, cores, status):
    """Doctor's own process counts 1 in the load; above half the usable cores' worth of other work, training's
    threads get under 2/3 of the CPU, by an amount that comes and goes."""
    c = doctor.load_check(load, cores)
    assert c.status == status and c.name == "load", c
    assert f"{load:.1f}" in c.detail and f"{cores} usable core" in c.detail
    if status == "warn":
        assert "distorted" in c.detail and "aiak's trials" in c.detail and "idle machine" in c.fix
        assert len(f"  warn  {c.name:<19} {c.detail}") <= 200 and len(c.fix) <= 190


def test_the_load_check_reads_the_machines_load_and_usable_cores(tmp_path):
    assert find(fake_machine(tmp_path / "a", loadavg=6.0, cpus=2), "load").status == "warn"
    assert find(fake_machine(tmp_path / "b", loadavg=6.0, cpus=32), "load").status == "pass"
    assert find(fake_machine(tmp_path / "c", loadavg=None), "load").detail.startswith("n/a")
    assert doctor.load_check(6.0, 2).detail == find(fake_machine(tmp_path / "d", loadavg=6.0, cpus=2), "load").detail


def test_the_doctor_command_in_process_has_short_check_lines_and_no_patch_checks(capsys):
    from aiak.cli.main import main

    code = main(["doctor", "--no-probes"])
    out = capsys.readouterr().out
    statuses, _ = parse_report(out)
    assert code == (2 if "fail" in statuses else 1 if "warn" in statuses else 0)
    lines = out.splitlines()
    checks = [line for line in lines if STATUS_LINE.match(line) or FIX_LINE.match(line)]
    assert checks and all(len(line) <= 200 for line in checks), max(checks, key=len)
    assert not [line for line in checks if re.match(r"^  pass  patch", line)], out
    assert any(line.split()[1:2] == ["load"] for line in checks), out
    section = lines[lines.index(doctor.PATCHES_TITLE):-1]
    assert len(section) == 1 + len(DECLARED) and all(len(line) <= 200 for line in section), section
    main(["doctor", "--no-probes", "--verbose"])
    verbose = " ".join(capsys.readouterr().out.split())
    assert " ".join(DECLARED["clip"].why.split()) in verbose


def test_a_check_whose_input_is_unreadable_becomes_a_warning(tmp_path):
    garbage = GpuFacts("GPU", None, 0.0)  # a capability that could not be read
    results = doctor.checks(gpu_machine(tmp_path, torch=dict(gpus=[garbage])))
    broken = [c for c in results if c.detail.startswith("could not check")]
    assert broken and all(c.status == "warn" and c.fix for c in broken)
    assert {"gpu", "tf32"} <= {c.name for c in broken}


# -- the extras' subprocess probes ----------------------------------------------------------------------------
def test_run_probe_reports_output_errors_and_timeouts():
    ok, said, _ = doctor.run_probe("print('first')\nprint('ran fine')\n")
    assert ok and said == "ran fine"
    ok, said, _ = doctor.run_probe("raise RuntimeError('DALI is broken here')\n")
    assert not ok and said == "RuntimeError: DALI is broken here"
    ok, said, seconds = doctor.run_probe("import time\ntime.sleep(30)\n", timeout=1.0)
    assert not ok and said == "did not finish in 1 s" and seconds < 15


# -- the report, the exit codes and JSON ----------------------------------------------------------------------
STATUS_LINE = re.compile(r"^  (pass|warn|fail)  \S.{0,40}?\s+\S")
FIX_LINE = re.compile(r"^ {8}fix: \S")
SUMMARY = re.compile(r"^(\d+) pass, (\d+) warn, (\d+) fail$")


def parse_report(out: str):
    """(statuses in order, summary counts); asserts every line is the title, a status, a fix or the summary."""
    lines = out.rstrip("\n").splitlines()
    assert lines[0] == doctor.TITLE
    patches = lines.index(doctor.PATCHES_TITLE)  # information, after the checks: one line per patch
    assert all(re.match(r"^  [\w-]+ +(not )?installed", line) for line in lines[patches + 1:-1]), lines[patches:]
    statuses, previous = [], None
    for line in lines[1:patches]:
        if STATUS_LINE.match(line):
            statuses.append(line.split()[0])
            previous = statuses[-1]
        else:
            assert FIX_LINE.match(line), line
            assert previous in ("warn", "fail"), f"fix under a {previous} line: {line}"
            previous = "fixed"
    counts = SUMMARY.match(lines[-1])
    assert counts, lines[-1]
    return statuses, tuple(int(n) for n in counts.groups())


def args(**kw):
    return argparse.Namespace(**{"json": False, "num_workers": None, "no_probes": True, **kw})


@pytest.mark.parametrize("kw, code", [
    ({}, 0),
    (dict(shm=128 * MIB), 1),
    (dict(shm=128 * MIB, environ={"NCCL_SOCKET_IFNAME": "eth9"}), 2),
], ids=["all-pass", "a-warning", "a-failure"])
def test_run_prints_the_report_and_returns_the_exit_code(tmp_path, capsys, kw, code):
    assert doctor.run(args(), machine=fake_machine(tmp_path, **kw)) == code
    statuses, counts = parse_report(capsys.readouterr().out)
    assert counts == (statuses.count("pass"), statuses.count("warn"), statuses.count("fail"))
    assert counts[1:] == {0: (0, 0), 1: (1, 0), 2: (1, 1)}[code]


# podman's default /dev/shm is 64,000 KiB (a fail: below 64 MiB), Docker's 64 MiB (a warning)
@pytest.mark.parametrize("shm, strict", [(64_000 * 1024, 2), (64 * MIB, 1), (8 * GIB, 0)],
                         ids=["podman-default", "docker-default", "ample"])
def test_exit_zero_prints_the_same_report_and_exits_0_where_doctor_alone_is_strict(tmp_path, capsys, shm, strict):
    m = fake_machine(tmp_path, shm=shm)
    assert doctor.run(args(), machine=m) == strict
    report = capsys.readouterr().out
    assert doctor.run(args(exit_zero=True), machine=m) == 0
    out = capsys.readouterr().out
    assert out.startswith(report)
    added = out[len(report):].strip()
    if strict:  # the image's default command: the shm advice is in the report, and the strict code is named
        shm_line = next(line for line in report.splitlines() if "/dev/shm" in line)
        fix = report.splitlines()[report.splitlines().index(shm_line) + 1]
        assert "--ipc=host" in fix and "--shm-size=" in fix
        assert added == f"exit status 0 (--exit-zero); checked with `aiak doctor`, this machine gives {strict}"
    else:
        assert added == ""
    assert doctor.run(args(exit_zero=True, json=True), machine=m) == 0
    assert json.loads(capsys.readouterr().out)["exit_code"] == strict  # the JSON keeps the strict code


def test_exit_zero_from_the_command_line():
    out = subprocess.run([sys.executable, "-m", "aiak.cli", "doctor", "--exit-zero", "--no-probes", "--json"],
                         capture_output=True, text=True, timeout=180, cwd=REPO)
    assert out.returncode == 0 and json.loads(out.stdout)["exit_code"] in (0, 1, 2), out.stderr


def test_json_is_one_object_with_every_field(tmp_path, capsys):
    code = doctor.run(args(json=True, num_workers=0), machine=gpu_machine(tmp_path, shm=32 * MIB))
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"checks", "summary", "exit_code", "patches"} and report["exit_code"] == code == 2
    assert all(set(c) == {"name", "status", "detail", "fix"} for c in report["checks"])
    statuses = [c["status"] for c in report["checks"]]
    assert report["summary"] == {s: statuses.count(s) for s in ("pass", "warn", "fail")}
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["/dev/shm"]["status"] == "fail" and by_name["cpu cores"]["status"] == "warn"


# -- the real command on this machine -------------------------------------------------------------------------
def installed_version(dist):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


MODULES_MARK = "doctor-modules: "


def doctor_here(*argv):
    """``aiak.cli.doctor.main(argv)`` in a fresh interpreter; after it, one stderr line says whether triton or DALI
    ended up imported into doctor's own process."""
    code = ("import json, sys, aiak.cli.doctor\n"
            "code = aiak.cli.doctor.main(sys.argv[1:])\n"
            f"print({MODULES_MARK!r} + json.dumps({{'triton': 'triton' in sys.modules, "
            "'dali': 'nvidia.dali' in sys.modules}), file=sys.stderr)\n"
            "sys.exit(code)\n")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=180, cwd=REPO)


def test_doctor_on_this_machine_prints_a_parsable_report():
    out = doctor_here()  # with the probes: DALI's one-batch pipeline runs here, once in this file
    assert out.returncode in (0, 1, 2) and "Traceback" not in out.stderr, out.stderr
    statuses, counts = parse_report(out.stdout)
    assert out.returncode == (2 if counts[2] else 1 if counts[1] else 0)
    assert len(statuses) >= 20
    # DALI ran in a subprocess and triton was only looked up: a broken one cannot crash doctor itself
    modules = json.loads(out.stderr.split(MODULES_MARK)[1].splitlines()[0])
    assert modules == {"triton": False, "dali": False}
    if installed_version("nvidia-dali-cuda120"):
        dali = next(line for line in out.stdout.splitlines() if line.split()[1:2] == ["dali"])
        assert dali.split()[0] == "pass" and "a one-batch pipeline ran" in dali, dali


def test_aiak_doctor_json_on_this_machine():
    out = subprocess.run([sys.executable, "-m", "aiak.cli", "doctor", "--json", "--no-probes", "--num-workers", "1"],
                         capture_output=True, text=True, timeout=180, cwd=REPO)
    assert out.returncode in (0, 1, 2) and "Traceback" not in out.stderr, out.stderr
    report = json.loads(out.stdout)
    assert report["exit_code"] == out.returncode
    names = [c["name"] for c in report["checks"]]
    for expected in ("python", "torch", "cudnn", "nccl", "gpu", "cpu", "tf32", "/dev/shm", "ulimit -l", "cpu cores",
                     "network", "NCCL_SOCKET_IFNAME", "NCCL_IB", "NCCL_NET_GDR_LEVEL", "GPUDirect RDMA", "triton",
                     "dali", "apex", "backends"):
        assert expected in names
    assert all(c["status"] == "pass" or c["fix"] for c in report["checks"])

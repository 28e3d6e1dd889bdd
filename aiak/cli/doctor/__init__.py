"""``aiak doctor``: is this machine set up to train fast? One line per check, and every warn or fail names its fix.

The checks cover the versions (python, torch and the CUDA it was built for, cuDNN, NCCL), GPU visibility and
capability, the CPU's bf16 support, the TF32 state, ``/dev/shm``, ``ulimit -l``, CPU cores against
``num_workers``, the network interfaces and the NCCL environment, GPUDirect RDMA, the extras (triton, DALI,
apex) and the distributed backends: the configuration mistakes that cost users of this kind of toolkit most
(RDMA bought but GPUDirect RDMA unused, NCCL on the wrong interface, too few workers, pageable memory), and the
machine's load (other work on the cores distorts every timing, aiak's trials included). After the checks, as
information rather than checks, aiak's own global patches of torch (`aiak.cli.doctor.patches`): those installed in
this process, and every one aiak may install, and when; ``--verbose`` adds what each replaces and why.

Everything the checks read is one `Machine` snapshot: roots for ``/proc``, ``/sys`` and ``/dev``, the
environment, a few limits and `TorchFacts`. `Machine.here` reads the real machine; a test builds
one over a fake tree. `checks` is a pure function of it, so every check runs on simulated machines.
Reading this machine never initialises CUDA without a GPU and never imports triton or DALI into this process:
DALI and apex are run in subprocesses with a timeout, so a broken install can neither hang nor crash doctor.

Exit code of `run`: 0 when every check passes, 1 when any warns (none fails), 2 when any fails; always 0
with ``--exit-zero`` (the container image's default command: a container started with a small ``/dev/shm``
starts, prints the report and says how to start it properly). ``--json`` keeps the strict code in its
``exit_code`` field either way.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import asdict
from typing import Dict, List, Optional, Sequence

from aiak.cli.args import whole_number
from aiak.cli.doctor.checks import (Check, checks, filter_names, load_check, parse_ifname_filter,
                                    recommended_workers)
from aiak.cli.doctor.machine import (EXIT_CODES, FAIL, NAME_WIDTH, PASS, WARN, ExtraFacts, GpuFacts, Machine,
                                     TorchFacts, one_line, run_probe)
from aiak.cli.doctor.patches import PATCHES_TITLE, patch_rows, render_patches

__all__ = ["add_arguments", "run", "main", "checks", "Check", "Machine", "TorchFacts", "GpuFacts", "ExtraFacts",
           "render", "report", "summary", "exit_code", "filter_names", "parse_ifname_filter", "recommended_workers",
           "run_probe", "gpu_checks", "load_check", "patch_rows", "render_patches", "PATCHES_TITLE", "PASS", "WARN",
           "FAIL"]


# -- the report -----------------------------------------------------------------------------------------------
TITLE = "aiak doctor: is this machine set up to train fast? (every warn and fail comes with its fix)"


def summary(results: Sequence[Check]) -> Dict[str, int]:
    return {status: sum(c.status == status for c in results) for status in (PASS, WARN, FAIL)}


def exit_code(results: Sequence[Check]) -> int:
    return max((EXIT_CODES[c.status] for c in results), default=0)


def render(results: Sequence[Check], patches: Sequence[Dict] = (), verbose: bool = False) -> str:
    """The report: the checks, then ``patches`` (`patch_rows`) as information, then the counts."""
    lines = [TITLE]
    for c in results:
        lines.append(f"  {c.status}  {c.name:<{NAME_WIDTH}} {c.detail}")
        if c.fix:
            lines.append(f"{'':8}fix: {c.fix}")
    if patches:
        lines += render_patches(patches, verbose)
    counts = summary(results)
    lines.append(f"{counts[PASS]} pass, {counts[WARN]} warn, {counts[FAIL]} fail")
    return "\n".join(lines)


def report(results: Sequence[Check], patches: Sequence[Dict] = ()) -> Dict:
    return {"checks": [asdict(c) for c in results], "summary": summary(results), "exit_code": exit_code(results),
            "patches": list(patches)}


# -- command line ---------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", default=False,
                        help="print one JSON object {checks, summary, exit_code, patches} instead of the report "
                             "(default: off)")
    parser.add_argument("--num-workers", type=whole_number(0), default=None, metavar="N",
                        help="the DataLoader num_workers you use, checked against the usable cores and GPUs "
                             "(default: none given, doctor recommends one)")
    parser.add_argument("--exit-zero", action="store_true", default=False,
                        help="report as usual but exit 0 whatever is found: for a container's default command, "
                             "which should start and say what to fix rather than fail (default: off, the exit "
                             "status is 0 all pass, 1 warnings, 2 failures)")
    parser.add_argument("--no-probes", action="store_true", default=False,
                        help="only look the extras up; do not run DALI's one-batch pipeline, apex's import or a "
                             "Triton kernel in subprocesses (default: run them, a few seconds)")
    parser.add_argument("--verbose", "-v", action="store_true", default=False,
                        help="under each of aiak's global patches of torch, what it replaces, why and what undoing it "
                             "puts back (default: one line each)")


def run(args: argparse.Namespace, machine: Optional[Machine] = None) -> int:
    """Print the report (or, with ``--json``, one JSON object) and return the exit code: 0 all pass, 1 warnings,
    2 failures. ``machine`` defaults to this one."""
    patches: list = []
    try:
        m = machine if machine is not None else Machine.here(probe_extras=not getattr(args, "no_probes", False))
        results = checks(m, getattr(args, "num_workers", None))
        patches = patch_rows(m.patches)
    except Exception as e:  # reading the machine is guarded piece by piece; this is the last net
        results = [Check("doctor", WARN, f"could not read this machine: {one_line(f'{type(e).__name__}: {e}')}",
                         "rerun aiak doctor --json and attach it to an aiak issue")]
    code = exit_code(results)
    text = json.dumps(report(results, patches)) if getattr(args, "json", False) else \
        render(results, patches, getattr(args, "verbose", False))
    if getattr(args, "exit_zero", False) and code and not getattr(args, "json", False):
        text += f"\nexit status 0 (--exit-zero); checked with `aiak doctor`, this machine gives {code}"
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `aiak doctor | head`: the reader is gone; the exit code still says what was found
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if getattr(args, "exit_zero", False) else code


def main(argv: Optional[List[str]] = None) -> int:
    from aiak.cli.args import Parser

    parser = Parser(prog="aiak doctor", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


# -- the GPU check (benchmarks/gpu_check.py runs it on a machine with CUDA) ------------------------------------
def gpu_checks() -> List[Dict]:
    """Rows ``{check, ok, metric, value}``: doctor's CUDA paths on a real GPU, each against its goal (none
    without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []

    def row(check, ok, metric, value):
        return {"check": f"doctor: {check}", "ok": bool(ok), "metric": metric, "value": value}

    m = Machine.here(probe_extras=True)
    results = checks(m)
    by_name = {c.name: c for c in results}
    rows = [row("torch sees the GPUs", m.torch.cuda_available and len(m.gpus) == torch.cuda.device_count(),
                "GPUs read (goal = torch.cuda.device_count())", f"{len(m.gpus)} vs {torch.cuda.device_count()}"),
            row("gpu check passes", by_name.get("gpu", Check("gpu", FAIL, "missing")).status == PASS,
                "status (goal pass)", by_name.get("gpu", Check("gpu", FAIL, "missing")).detail)]
    capabilities = [g.capability for g in m.gpus]
    expected = [tuple(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())]
    rows.append(row("capabilities", capabilities == expected, "per GPU (goal = torch's)", f"{capabilities}"))
    per_gpu = [c for c in results if re.fullmatch(r"gpu\d+(-\d+)?", c.name)]
    rows.append(row("kernels in the build for every GPU", per_gpu and all(c.status == PASS for c in per_gpu),
                    "per-GPU lines (goal all pass)", "; ".join(f"{c.name} {c.status}" for c in per_gpu)))
    rows.append(row("nccl version read", bool(m.torch.nccl), "version (goal: read)", str(m.torch.nccl)))
    for name in ("triton", "dali"):
        extra = m.extras[name]
        if extra.version is not None:
            rows.append(row(f"{name} runs on the GPU", extra.runs is True, "probe (goal ran)", extra.detail))
    failing = [f"{c.name}: {c.detail}" for c in results if c.status == FAIL]
    rows.append(row("no failing check", not failing, "fails (goal none)", "; ".join(failing) or "none"))
    return rows


if __name__ == "__main__":
    sys.exit(main())


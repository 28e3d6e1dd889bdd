"""docker/Dockerfile, checked without a Docker engine.

Parsed with dockerfile-parse: the base image is NVIDIA's PyTorch container, every ``COPY`` source exists in the
repository (the build context), and every extra that a ``pip install`` names is declared in pyproject.toml.
Then the recipe runs for real, as ``docker build`` would run it, in a fresh virtual environment standing in for
the image's Python: it has no packages of its own and sees this environment's (torch, pip, setuptools, ...)
through a ``.pth`` file, as the image's Python sees the torch NVIDIA installed. ``ENV``, ``WORKDIR`` and
``COPY`` are applied under a temporary root and every ``RUN`` step runs with ``/bin/sh -c``; afterwards aiak
must be installed in that environment and nothing else (torch not replaced), and ``aiak doctor --json`` must
print a JSON report whose exit code is doctor's exit status.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import tomllib
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def instructions():
    """The Dockerfile's instructions in order, as ``(INSTRUCTION, value)``."""
    return [(i["instruction"], i["value"]) for i in DockerfileParser(path=str(DOCKERFILE)).structure]


def copy_sources_and_dest(value: str):
    words = [w for w in shlex.split(value) if not w.startswith("--")]
    return words[:-1], words[-1]


def installed_extras():
    """Every extra named in a ``pip install`` of a RUN step (``".[a,b]"`` -> a, b)."""
    extras = []
    for instruction, value in instructions():
        if instruction == "RUN" and "pip install" in value:
            for group in re.findall(r"\.\[([^\]]*)\]", value):
                extras += [e.strip() for e in group.split(",") if e.strip()]
    return extras


# What a RUN step may call: it runs on this machine too (the slow test below), so nothing that needs the image's
# package manager or root (apt-get), and pip only to add aiak and its missing small dependencies.
RUN_COMMANDS = {"pip", "python", "python3", "aiak", "grep", "[", "test", "rm", "mkdir", "cp", "echo"}
# Packages the base image ships as NVIDIA's own builds: reinstalling one from PyPI would replace or shadow it.
IMAGE_PACKAGES = re.compile(r"^(torch|torchvision|triton|pytorch-triton|apex|nvidia-dali[\w-]*)([<>=!~\[;@ ]|$)",
                            re.IGNORECASE)


def shell_commands(line: str):
    """The simple commands of a shell line, each as its words (split at ``&&``, ``||``, ``|``, ``;``; quotes kept
    together, redirections left out)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, words, redirect = [], [], False
    for token in lexer:
        if token in ("&&", "||", "|", ";"):
            commands.append(words)
            words = []
        elif token in (">", ">>", "<", "2>", "&>"):
            redirect = True
        elif redirect:
            redirect = False
        else:
            words.append(token)
    return [c for c in commands + [words] if c]


def run_step_problems():
    """Why the RUN steps could not run here, or would replace the image's torch (empty: none)."""
    problems = []
    for instruction, value in instructions():
        if instruction != "RUN":
            continue
        for words in shell_commands(value):
            if words[0] not in RUN_COMMANDS:
                problems.append(f"RUN {value!r}: {words[0]!r} is not one of {sorted(RUN_COMMANDS)}")
            if words[:2] == ["pip", "install"]:
                named = [w for w in words[2:] if not w.startswith("-") and IMAGE_PACKAGES.match(w)]
                if named:
                    problems.append(f"RUN {value!r}: pip install {named}: the base image ships its own")
    return problems


def test_base_image_is_nvidia_pytorch_pinned_by_digest_and_swappable():
    parsed = DockerfileParser(path=str(DOCKERFILE))
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d{2}\.\d{2}-py3@sha256:[0-9a-f]{64}", parsed.baseimage), \
        parsed.baseimage
    steps = [step for step in instructions() if step[0] != "COMMENT"]
    assert steps[0] == ("ARG", f"BASE_IMAGE={parsed.baseimage}")  # the default, which --build-arg replaces
    assert ("FROM", "${BASE_IMAGE}") in steps


def default_command():
    """The image's CMD as its argv (the exec form)."""
    return json.loads([value for instruction, value in instructions() if instruction == "CMD"][-1])


def test_every_copy_source_exists_in_the_repository():
    copies = [value for instruction, value in instructions() if instruction == "COPY"]
    assert copies, "the Dockerfile copies nothing"
    for value in copies:
        assert "--from" not in value, f"COPY --from is not checked here: {value}"
        sources, _ = copy_sources_and_dest(value)
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository (the build context)"
    copied = {Path(s).parts[0] for v in copies for s in copy_sources_and_dest(v)[0]}
    assert {"pyproject.toml", "aiak", "configs"} <= copied  # what `pip install .` needs


def test_installed_extras_are_declared_in_pyproject():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    extras = installed_extras()
    assert extras, "no `pip install .[extra]` step"
    unknown = [e for e in extras if e not in declared]
    assert not unknown, f"extras {unknown} are not in pyproject.toml's optional-dependencies {sorted(declared)}"


def test_run_steps_only_add_aiak_to_the_image():
    assert not run_step_problems()


def _image_python(venv: Path) -> dict:
    """A venv without packages of its own that sees this interpreter's site-packages (as the image's Python sees
    its torch), with a ``pip`` command; returns the environment to run the RUN steps in."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True, timeout=60).stdout.strip())
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "image-packages.pth").write_text("\n".join(ours) + "\n")
    pip = venv / "bin" / "pip"
    pip.write_text(f"#!{python}\nimport sys\nfrom pip._internal.cli.main import main\nsys.exit(main())\n")
    pip.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PIP_USER")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", VIRTUAL_ENV=str(venv))
    return env


def _env_pairs(value: str) -> dict:
    words = shlex.split(value)
    if words and "=" not in words[0]:          # the legacy form: ENV KEY value with spaces
        return {words[0]: " ".join(words[1:])}
    return dict(w.split("=", 1) for w in words)


@pytest.mark.slow
def test_run_steps_install_aiak_in_a_fresh_venv_and_doctor_reports_json(tmp_path):
    problems = run_step_problems()
    assert not problems, f"not run here: {problems}"
    venv, root = tmp_path / "venv", tmp_path / "root"
    env = _image_python(venv)
    workdir = root
    workdir.mkdir(parents=True)
    ran = []
    for instruction, value in instructions():
        if instruction == "ENV":
            env.update(_env_pairs(value))
        elif instruction == "WORKDIR":
            workdir = root / value.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif instruction == "COPY":  # Docker's rules: a directory's contents go into dest; a file into a dest/
            sources, dest = copy_sources_and_dest(value)
            target = workdir / dest
            for source in map(ROOT.joinpath, sources):
                if source.is_dir():
                    shutil.copytree(source, target, dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                else:
                    into = dest.endswith("/") or len(sources) > 1
                    (target if into else target.parent).mkdir(parents=True, exist_ok=True)
                    shutil.copy2(source, target / source.name if into else target)
        elif instruction == "RUN":
            out = subprocess.run(["/bin/sh", "-c", value], cwd=workdir, env=env, capture_output=True, text=True,
                                 timeout=240)
            assert out.returncode == 0, \
                f"RUN {value}\nexit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
            ran.append(value)
    assert any("pip install" in r for r in ran) and any("aiak doctor" in r for r in ran), ran

    python = venv / "bin" / "python"
    where = json.loads(subprocess.run(
        [str(python), "-c", "import json, aiak, torch; print(json.dumps([aiak.__file__, torch.__file__]))"],
        cwd=tmp_path, env=env, check=True, capture_output=True, text=True, timeout=120).stdout)
    assert Path(where[0]).is_relative_to(venv), f"aiak imported from {where[0]}, not from the install in {venv}"
    assert not Path(where[1]).is_relative_to(venv), f"pip installed a torch of its own: {where[1]}"
    site = Path(where[0]).parent.parent
    installed = sorted(p.name.split("-")[0] for p in site.glob("*.dist-info"))
    assert installed == ["aiak"], f"pip installed more than aiak into the image's Python: {installed}"

    doctor = subprocess.run([str(venv / "bin" / "aiak"), "doctor", "--json"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=180)
    report = json.loads(doctor.stdout)
    assert isinstance(report, dict) and report["checks"], doctor.stdout[-2000:]
    assert report["exit_code"] == doctor.returncode in (0, 1, 2), doctor.stderr[-2000:]

    # The default command reports like doctor and exits 0 whatever doctor finds: a container started with a small
    # /dev/shm must start, not exit 2 (docker/check.sh runs the image with the engine's defaults).
    argv = default_command()
    assert argv[:2] == ["aiak", "doctor"], argv
    started = subprocess.run([str(venv / "bin" / argv[0]), *argv[1:]], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=180)
    assert started.returncode == 0 and "pass, " in started.stdout, started.stdout[-2000:] + started.stderr[-2000:]


# -- docker/check.sh (.ci/run runs it whole: it builds and runs the image with podman) ----------------------------
CHECK = ROOT / "docker" / "check.sh"


def test_check_script_refuses_an_unknown_argument_naming_the_valid_ones():
    out = subprocess.run(["bash", str(CHECK), "--sav", "x"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == "docker/check.sh: unknown argument '--sav' (valid: --save FILE, --keep, --help)"
    missing = subprocess.run(["bash", str(CHECK), "--save"], capture_output=True, text=True, timeout=30)
    assert missing.returncode == 2 and "--save needs a file name" in missing.stderr


def test_check_script_help_is_its_header():
    out = subprocess.run(["bash", str(CHECK), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("Build aiak's container image")
    for flag in ("--save FILE", "--keep", "AIAK_CHECK_TIMEOUT"):
        assert flag in out.stdout



def _smoke_report(tmp_path, log: str):
    """Run check.sh's smoke_report function alone on a build log (the rest of the script needs root and podman)."""
    path = tmp_path / "build.log"
    path.write_text(log)
    body = re.search(r"^smoke_report\(\) \{\n.*?^\}\n", CHECK.read_text(), re.M | re.S)
    assert body, "docker/check.sh defines smoke_report()"
    return subprocess.run(["bash", "-c", body.group(0) + 'smoke_report "$1"', "-", str(path)],
                          capture_output=True, text=True, timeout=30)


def test_check_script_accepts_a_smoke_check_layer_from_the_engines_cache(tmp_path):
    # podman's own lines: a build of the same tree before (an image left from a stopped run) reuses the layer, which
    # then prints no count; CI failed on such a warm engine when the count was required.
    built = _smoke_report(tmp_path, "STEP 8/11: RUN aiak doctor || [ $? -eq 1 ]\n  pass  python  3.11\n"
                                    "21 pass, 1 warn, 0 fail\n--> 1b38c5d1a42\n")
    assert built.returncode == 0 and built.stdout.strip() == "build smoke check (aiak doctor): 21 pass, 1 warn, 0 fail"
    cached = _smoke_report(tmp_path, "STEP 8/11: RUN aiak doctor || [ $? -eq 1 ]\n"
                                     "--> Using cache f1543fdc3899a8368530c492c524c5072b80fb6f7b7e88a9307ce0456221b3f6\n"
                                     "--> f1543fdc389\nSTEP 9/11: COPY examples ./examples\n")
    assert cached.returncode == 0 and "from the engine's cache" in cached.stdout, cached.stdout + cached.stderr
    # A build whose doctor step printed nothing it recognises (neither count nor cache) fails, saying why.
    silent = _smoke_report(tmp_path, "STEP 8/11: RUN aiak doctor || [ $? -eq 1 ]\n--> 3c0ffee\n")
    assert silent.returncode == 1 and "no smoke check (aiak doctor) count" in silent.stderr

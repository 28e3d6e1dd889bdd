"""The wheel ships every subpackage and the built-in profiles, and they are found from the installed package."""
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wheel_contains_all_packages_and_profiles(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    wheel = next(tmp_path.glob("aiak-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    source_packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "aiak").rglob("__init__.py")}
    for pkg in source_packages:
        assert f"{pkg}/__init__.py" in names, f"{pkg} is missing from the wheel: add it to pyproject.toml"
    profiles = {p.name for p in (ROOT / "configs").glob("*.yaml")}
    assert profiles and {f"aiak/configs/{p}" for p in profiles} <= names
    assert any(n.endswith("entry_points.txt") for n in names)

    # Heavy or GPU-only libraries are extras: a bare `pip install aiak` pulls only torch and pyyaml, and the
    # real third-party Swin models of the surgery tests come with the test extra.
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    core = {re.split(r"[<>=!~; ]", r, maxsplit=1)[0] for r in requires if "extra ==" not in r}
    test_extra = {re.split(r"[<>=!~; ]", r, maxsplit=1)[0] for r in requires if r.endswith('extra == "test"')}
    assert core == {"torch", "pyyaml", "numpy"}, core
    assert {"timm", "torchvision", "transformers", "triton"} <= test_extra, test_extra

    # installed into a scratch target (no deps): the profiles are found inside the package
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=120)
    code = ("import aiak.strategy as s; d = s.profiles_dir(); print(d); "
            "assert 'site' in str(d) and 'swin' in s.list_profiles()")
    env_path = f"{target}"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert res.returncode == 0, res.stderr

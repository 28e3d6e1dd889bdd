"""The documentation: README stays short and points into docs/, the API reference names every public name, and
the site builds with ``mkdocs build --strict`` where MkDocs is installed (the docs extra; CI installs it)."""
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

# The public names code outside aiak imports: the package's own, and those of its subpackages that scripts use.
PUBLIC = ["aiak.optimize", "aiak.Strategy", "aiak.StrategyError", "aiak.load_strategy", "aiak.select_strategy",
          "aiak.last_decision", "aiak.stepped", "aiak.clip_grad_norm_", "aiak.clip_grad_value_", "aiak.patches",
          "aiak.undo_patches",
          "aiak.optim.Lamb", "aiak.optim.Lars", "aiak.loaders.PrefetchLoader", "aiak.loaders.dali_loader",
          "aiak.loaders.BalancedBatchSampler", "aiak.ops.window_attention", "aiak.ops.replace_window_attention",
          "aiak.comm", "aiak.amp"]


def test_readme_is_short_and_links_into_the_docs():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert links and all((ROOT / link).is_file() for link in links), links
    for command in ('pip install torch==2.13.0 && pip install -e . && aiak demo',
                    'pip install torch==2.14.1 torchvision==0.29.1 && pip install -e ".[test]" && python -m pytest -q'):
        assert command in text
    assert "Never run on a GPU" in text


def test_every_page_of_the_site_is_in_its_navigation():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    pages = {next(iter(entry.values())) for entry in config["nav"]}
    assert pages == {p.name for p in (ROOT / "docs").glob("*.md")}


def test_the_api_reference_documents_every_public_name():
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    entries = re.findall(r"^::: (\S+)\n    options:\n      heading: (\S+)", text, re.M)
    headings = {heading: target for target, heading in entries}
    assert set(PUBLIC) <= set(headings), set(PUBLIC) - set(headings)
    for name, target in headings.items():   # each heading is the object it documents, under its public name
        module, _, attr = name.rpartition(".")
        public = getattr(importlib.import_module(module), attr) if module != "aiak" or attr in dir(
            importlib.import_module("aiak")) else None
        t_module, _, t_attr = target.rpartition(".")
        try:
            documented = getattr(importlib.import_module(t_module), t_attr)
        except ModuleNotFoundError:
            documented = importlib.import_module(target)
        assert public is documented, (name, target)


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="MkDocs is not installed (pip install -e '.[docs]')")
def test_the_site_builds_strictly(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    assert "Apply a strategy to a training setup" in api   # the docstrings are in

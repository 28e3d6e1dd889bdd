"""The documentation: README stays short and points into docs/, the API reference names every public name, and
the site builds with ``mkdocs build --strict`` where MkDocs is installed (the docs extra; CI installs it); the code a
newcomer pastes from README and the quickstart runs as it stands."""
import html
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import textwrap
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


# The commands CI runs (.ci/run), each in a fresh virtual environment: the demo's on a machine without torch, and
# the tests'; and the one for a machine that has its torch already.
DEMO_COMMAND = "pip install torch==2.13.0 && pip install -e . && aiak demo"
TEST_COMMAND = 'pip install torch==2.14.1 torchvision==0.29.1 && pip install -e ".[test]" && python -m pytest -q'
WITH_TORCH_COMMAND = "pip install -e . && aiak demo"
FIRST_SCREEN = 45  # lines


def test_readme_is_short_and_links_into_the_docs():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert links and all((ROOT / link).is_file() for link in links), links
    for command in (DEMO_COMMAND, TEST_COMMAND):
        assert command in text
    assert "Never run on a GPU" in text


def test_readme_tells_one_install_story_on_its_first_screen():
    """README's commands that install are three, all on its first screen: one for a machine with torch, one without
    (torch first, pinned), the tests'. Which torch, its CPU wheel and why two torches are docs/install.md's."""
    installs = [(fence + 1 + i, line.split("  #")[0].strip()) for fence, block in _fenced("README.md", "bash")
                for i, line in enumerate(block.splitlines()) if "pip install" in line]
    assert [command for _, command in installs] == [WITH_TORCH_COMMAND, DEMO_COMMAND, TEST_COMMAND], installs
    assert all(number <= FIRST_SCREEN for number, _ in installs), installs
    install = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
    for said in (WITH_TORCH_COMMAND, DEMO_COMMAND, TEST_COMMAND, "--index-url https://download.pytorch.org/whl/cpu",
                 "torchvision 0.29.1 goes with torch 2.14.1"):
        assert said in install, said


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


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once for the tests that read it (``mkdocs build --strict``: a warning fails it)."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("MkDocs is not installed (pip install -e '.[docs]')")
    out_dir = tmp_path_factory.mktemp("site")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out_dir)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    return out_dir


def test_the_site_builds_strictly(site):
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    assert "Apply a strategy to a training setup" in api   # the docstrings are in


def _text(markup: str) -> str:
    """What a reader sees of some HTML: the tags dropped, the entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", markup))


def test_no_sphinx_role_is_printed_on_the_site(site):
    """A Sphinx role (``:class:`x```) is Markdown's plain text: the site would print it as it stands. So would a
    cross-reference left unresolved (``[aiak.Strategy][]``: aiak's lazy re-exports are invisible to the renderer;
    write the rendered object's path, ``[aiak.Strategy][aiak.strategy.schema.Strategy]``)."""
    printed = {str(page.relative_to(site)): sorted(set(re.findall(r":(?:class|func|mod|meth|attr|data):`?|"
                                                                  r"\[[\w.]+\]\[[\w.]*\]",
                                                                  _text(page.read_text(encoding="utf-8")))))
               for page in site.rglob("*.html")}
    assert not {page: roles for page, roles in printed.items() if roles}


def _api_entries():
    """``[(heading, target)]`` of docs/api.md, in its order."""
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    return [(heading, target) for target, heading in
            re.findall(r"^::: (\S+)\n    options:\n      heading: (\S+)", text, re.M)]


def _documented(target: str):
    module, _, attr = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ModuleNotFoundError, AttributeError):
        return importlib.import_module(target)


def _section(api_html: str, target: str) -> str:
    """The HTML of one object of the API reference, from its heading to the next object's."""
    start = api_html.rindex("<", 0, api_html.index(f'id="{target}"'))
    end = api_html.find('<div class="doc doc-object doc-', start)
    return api_html[start:end if end > 0 else len(api_html)]


def _parameters(obj) -> list:
    return [name for name, p in inspect.signature(obj).parameters.items()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def test_every_function_and_class_of_the_api_reference_shows_its_signature_and_parameters(site):
    """Each function and class of docs/api.md: its signature (``name(param, ...)``, every parameter in order) in
    the block under its heading, and every parameter in its "Parameters" section (the docstring's ``Args:``)."""
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    checked = 0
    for heading, target in _api_entries():
        obj = _documented(target)
        if inspect.ismodule(obj):
            continue
        section = _section(api, target)
        signature = re.search(r'<div class="doc-signature[^"]*">(.*?)</div>', section, re.S)
        assert signature, f"{heading}: no signature"
        shown = _text(signature.group(1)).strip()
        params = _parameters(obj)
        assert shown.startswith(f"{target.rsplit('.', 1)[-1]}("), (heading, shown)
        found = [re.search(rf"(?<![\w.]){p}(?=\s*[:=,)])", shown) for p in params]
        assert all(found), (heading, params, shown)
        positions = [f.start() for f in found]
        assert positions == sorted(positions), (heading, params, shown)
        if params:
            table = re.search(r"Parameters:(.*?)</table>", section, re.S)
            assert table, f"{heading}: no Parameters section"
            described = _text(table.group(1))
            assert not [p for p in params if p not in described], (heading, params, described[:500])
        checked += 1
    assert checked >= 20, checked


def test_optimize_documents_its_returns_and_raises_and_links_strategy(site):
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    section = _section(api, "aiak.api.optimize")
    text = _text(section)
    for title in ("Parameters:", "Returns:", "Raises:"):
        assert title in text, title
    raises = _text(re.search(r"Raises:(.*?)</table>", section, re.S).group(1))
    for error in ("StrategyError", "TypeError", "ValueError"):
        assert error in raises, (error, raises)
    assert re.search(r'<a [^>]*href="[^"]*#aiak\.strategy\.schema\.Strategy"', section), "no link to aiak.Strategy"


# The code a newcomer pastes: README's and the quickstart's.
PASTED = ("README.md", "docs/quickstart.md")
FRAGMENT = "# fragment:"


def _fenced(path: str, language: str) -> list:
    """``[(line, code)]`` of each ```` ```language```` block of a Markdown file, those indented in list items too."""
    text = (ROOT / path).read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, textwrap.dedent(m.group(2)))
            for m in re.finditer(rf"^( *)```{language}\n(.*?)^\1```", text, re.M | re.S)]


def _scripts() -> list:
    return [pytest.param(path, code, id=f"{path}:{line}")
            for path in PASTED for line, code in _fenced(path, "python") if not code.startswith(FRAGMENT)]


def test_the_quickstart_opens_with_a_script_that_runs():
    _, first = _fenced("docs/quickstart.md", "python")[0]
    assert not first.startswith(FRAGMENT), first


@pytest.mark.parametrize("path, code", _scripts())
def test_the_code_a_newcomer_pastes_runs_as_it_stands(path, code, tmp_path):
    """Each ```` ```python```` block of README.md and docs/quickstart.md runs as pasted into a file: a fresh Python,
    no GPU, exit code 0 and no warning on stderr. The convention: a block whose first line is ``# fragment: ...``
    (saying whose names it uses) is a fragment of the reader's own script, and is not run. A ```` ```yaml```` block
    whose first line is ``# save as NAME.yaml`` is written there first, as the text tells the reader to."""
    for path_ in PASTED:
        for _, text in _fenced(path_, "yaml"):
            saved = re.match(r"# save as (\S+\.ya?ml)\b", text)
            if saved:
                (tmp_path / saved.group(1)).write_text(text, encoding="utf-8")
    (tmp_path / "pasted.py").write_text(code, encoding="utf-8")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", AIAK_TUNE_CACHE=str(tmp_path / "tune.json"),
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    out = subprocess.run([sys.executable, "pasted.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "warning" not in out.stderr.lower(), out.stderr[-3000:]

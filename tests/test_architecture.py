"""ARCHITECTURE.md held against the code: every file and folder it names exists, every name it places in a file
is defined there, its sentence on the middle row's imports is the imports as they are, and no folder outgrows a
room."""
import re
from pathlib import Path

from tests.test_layers import _imports, _unit

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "ARCHITECTURE.md").read_text()
OUTSIDE_THE_PACKAGE = ("tests/", "benchmarks/", "configs/", "docs/", "docker/", "examples/", "README.md", "mkdocs.yml")
MIDDLE_ROW = {"step", "amp", "optim", "comm", "loaders", "ops", "runtime", "measure"}


def _paths():
    return sorted(set(re.findall(r"`([\w./*]+(?:\.py|\.yaml|\.md|\.yml|/))`", TEXT)))


def _resolve(name: str) -> list:
    """The files or folders ``name`` means: from the repository's root (tests/, benchmarks/, ...), from the
    package's, or, for a name given inside its folder's paragraph (``hooks.py`` under ``comm/allreduce/``), the
    package's files of that name."""
    if name.startswith(OUTSIDE_THE_PACKAGE):
        return list(ROOT.glob(name))
    found = list((ROOT / "aiak").glob(name))
    return found or list((ROOT / "aiak").rglob(name.rstrip("/")))


def test_every_file_and_folder_named_exists():
    missing = [name for name in _paths() if not _resolve(name)]
    assert not missing and len(_paths()) > 50, missing


def test_every_name_placed_in_a_file_is_defined_there():
    """``file.py`` (``Name`` ... and ``file.py``'s ``Name``: a class, function or module-level name of that file."""
    pairs = re.findall(r"`([\w/]+\.py)`(?: \(|'s )`(\w+)", TEXT)
    wrong = []
    for path, name in pairs:
        defined = rf"^\s*(def|class) {name}\b|^{name}\b\s*[:=]|^\s+{name}\b\s*[:=]|\b{name}\s*="
        if not any(re.search(defined, file.read_text(), re.MULTILINE) for file in _resolve(path)):
            wrong.append(f"{path}: {name}")
    assert not wrong and len(pairs) > 15, wrong


def _middle_row_imports():
    """The pairs of middle-row packages one imports the other, read by the layer test's own import reader."""
    return {(_unit(a), _unit(b)) for a, b, _, _ in _imports()
            if _unit(a) in MIDDLE_ROW and _unit(b) in MIDDLE_ROW and _unit(a) != _unit(b)}


def test_the_middle_row_sentence_is_the_imports():
    sentence = TEXT[TEXT.index("Inside the middle row today:"):TEXT.index("### Communication")]
    said = set()
    for chain in re.findall(r"`(\w+(?: -> \w+)+)`", sentence):
        steps = chain.split(" -> ")
        said |= set(zip(steps, steps[1:]))
    assert said == _middle_row_imports()
    for alone in re.findall(r"`(\w+)` imports only `util`", sentence):
        assert not any(a == alone for a, _ in _middle_row_imports())


def test_no_folder_of_the_package_holds_more_than_twelve_modules():
    """A folder past twelve modules does several jobs: split it into rooms (as comm/ is) before it grows on."""
    crowded = {str(d.relative_to(ROOT)): n for d in (ROOT / "aiak").rglob("*") if d.is_dir()
               for n in [len([f for f in d.glob("*.py") if f.name != "__init__.py"])] if n > 12}
    assert not crowded, crowded

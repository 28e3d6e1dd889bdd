"""Suite-wide: every test gets its own tuning cache, so no decision leaks between tests or into ~/.cache."""
import pytest


@pytest.fixture(autouse=True)
def _private_tuning_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AIAK_TUNE_CACHE", str(tmp_path / "aiak-tune-cache.json"))


@pytest.fixture
def warnings_said_again():
    """aiak's once-per-process warnings are said again inside the test; the record is put back afterwards."""
    from aiak.util import warn

    saved = set(warn._warned)
    warn._warned.clear()
    yield
    warn._warned.update(saved)


class _Said:
    """The warnings said inside a ``with said:`` block, as one text (``said.text``)."""

    def __init__(self):
        self.text = ""

    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings(record=True)
        self._caught = self._catch.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self.text += "\n".join(str(w.message) for w in self._caught)
        return self._catch.__exit__(*exc)


@pytest.fixture
def said():
    """What aiak warned inside ``with said:`` (rank 0's ``warnings`` channel, :mod:`aiak.util.warn`)."""
    return _Said()

"""Suite-wide: every test gets its own tuning cache, so no decision leaks between tests or into ~/.cache."""
import pytest


@pytest.fixture(autouse=True)
def _private_tuning_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AIAK_TUNE_CACHE", str(tmp_path / "aiak-tune-cache.json"))


@pytest.fixture
def warnings_said_again():
    """aiak's once-per-process warnings are said again inside the test; the record is put back afterwards."""
    from aiak.amp import warn

    saved = set(warn._warned)
    warn._warned.clear()
    yield
    warn._warned.update(saved)

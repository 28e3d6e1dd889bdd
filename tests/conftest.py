"""Suite-wide: every test gets its own tuning cache, so no decision leaks between tests or into ~/.cache."""
import pytest


@pytest.fixture(autouse=True)
def _private_tuning_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AIAK_TUNE_CACHE", str(tmp_path / "aiak-tune-cache.json"))

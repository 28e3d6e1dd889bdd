"""Every strategy test sees only the built-in profiles unless it adds user folders itself: the real user's
``~/.config/aiak/profiles`` and ``AIAK_PROFILE_PATH`` are hidden behind an empty home folder."""
import pytest


@pytest.fixture(autouse=True)
def no_user_profiles(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))
    monkeypatch.delenv("AIAK_PROFILE_PATH", raising=False)

"""aiak speaks from rank 0 only (issue 14, item 3): warnings and the ``aiak`` logger (the summary) on other ranks say
nothing. Here the rank comes from torchrun's ``RANK`` (no process group); tests/integrations/test_torchrun.py runs
the real 2-rank case."""
import logging
import warnings

from aiak.util import warn


def test_other_ranks_neither_warn_nor_log(monkeypatch, caplog):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(warn, "_warned", set())
    with warnings.catch_warnings(record=True) as record, caplog.at_level(logging.INFO, logger="aiak"):
        warnings.simplefilter("always")
        assert warn.warn_once("rank-test", "aiak: said on rank 1?") is False
        logging.getLogger("aiak").info("aiak.optimize: strategy 'x'")
    assert record == [] and caplog.records == []
    assert "rank-test" not in warn._warned  # rank 1 keeps the key unspent: nothing was said


def test_rank_zero_warns_once_and_logs(monkeypatch, caplog):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(warn, "_warned", set())
    with warnings.catch_warnings(record=True) as record, caplog.at_level(logging.INFO, logger="aiak"):
        warnings.simplefilter("always")
        assert warn.warn_once("rank-test", "aiak: said once") is True
        assert warn.warn_once("rank-test", "aiak: said once") is False
        logging.getLogger("aiak").info("aiak.optimize: strategy 'x'")
    assert [str(w.message) for w in record] == ["aiak: said once"]
    assert [r.getMessage() for r in caplog.records] == ["aiak.optimize: strategy 'x'"]

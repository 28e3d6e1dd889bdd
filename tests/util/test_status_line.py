"""The trials' status line: on a terminal's stderr while ``auto`` times its candidates, cleared at the end; nothing
at all where stderr is a pipe (a log, CI)."""
import os
import pty
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import torch, aiak
    import aiak.util.status_line as status_line
    from aiak.cli.demo import make_setup
    status_line.SHOW_AFTER_S = 0.0          # the demo's trials take about a second here: show from the start
    aiak.optimize(*make_setup(n=512, batch_size=32), strategy={"extends": "auto_base", "channels_last": True,
                                                               "tune": {"guard": False}})   # rounds on copies
    model, optimizer, loader = make_setup(n=512, batch_size=32)
    aiak.optimize(model, optimizer, loader, strategy="auto")   # its candidates timed in the run: first steps only
""")


def _run(stderr_is_terminal: bool, tmp_path) -> bytes:
    env = dict(os.environ, AIAK_TUNE_CACHE=str(tmp_path / "tune.json"))   # no cached decision: the trials run
    if not stderr_is_terminal:
        out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stderr
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:     # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=300) == 0, b"".join(chunks)[-3000:]
    os.close(leader)
    return b"".join(chunks)


def test_a_terminal_sees_the_trials_progress_and_then_a_clean_line(tmp_path):
    err = _run(True, tmp_path)
    assert b"\r\x1b[Kaiak: timing " in err and b" candidate strategies on the first batches: " in err, err[-2000:]
    assert b"first step of 'plain'" in err and b"round 1 of " in err, err[-2000:]
    last_status = err.rindex(b"\raiak: timing") if b"\raiak: timing" in err else err.rindex(b"\x1b[Kaiak: timing")
    assert b"\r\x1b[K" in err[last_status + 4:], "the status line was left on the screen"
    assert b"aiak: applied strategy" in err[last_status:]          # the headline comes after, on a clean line


def test_a_pipe_gets_no_status_line(tmp_path):
    err = _run(False, tmp_path)
    assert b"aiak: applied strategy" in err and b"timing" not in err and b"\r" not in err, err[-2000:]

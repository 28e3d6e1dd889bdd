"""aiak's background threads finish what they are doing, and leave torch, before the interpreter finalizes.

A daemon thread still inside a torch call with the GIL released when finalization begins (the comm worker
returning from the last bucket's ``set_result``) aborts the whole process as it takes the GIL back: a rank of a
finished run exits with SIGABRT. Each test runs a script that exits while a thread is mid-job, and checks the
job's last line ran: killed at finalization, it never does.
"""
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, marker: Path) -> None:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), str(marker)], cwd=REPO, timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_comm_worker_finishes_its_job_before_the_interpreter_exits(tmp_path):
    marker = tmp_path / "done"
    _run("""
        import sys, time
        import torch
        from aiak.comm.allreduce.hooks import _Worker

        def job():
            time.sleep(0.5)  # the script's main thread is exiting meanwhile
            open(sys.argv[1], "w").write("done")

        _Worker().submit(job)
        """, marker)
    assert marker.read_text() == "done"


def test_the_prefetch_thread_leaves_the_loader_before_the_interpreter_exits(tmp_path):
    marker = tmp_path / "done"
    _run("""
        import sys, time
        import torch
        from aiak.loaders import PrefetchLoader

        def batches():
            try:
                for i in range(100):
                    time.sleep(0.05)
                    yield torch.full((2,), float(i))
            finally:  # runs when the loading thread lets go of the loader
                open(sys.argv[1], "w").write("done")

        epoch = iter(PrefetchLoader(batches(), "cpu", depth=2))
        next(epoch)
        next(epoch)  # the thread is loading now; the script ends without finishing the epoch
        keep = epoch
        """, marker)
    assert marker.read_text() == "done"

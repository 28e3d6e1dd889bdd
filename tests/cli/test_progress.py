"""aiak.cli.progress: live bars on a terminal (rich, else tqdm), a few plain lines anywhere else."""
import io
import os

import pytest

from aiak.cli.progress import Board


def drive(board, totals):
    with board:
        for name, total in totals.items():
            for done in range(1, total + 1):
                board.update(name, done, 1.0 / done)


def test_a_redirected_board_writes_plain_lines_at_each_tenth_and_no_carriage_returns():
    out = io.StringIO()
    totals = {"baseline": 200, "auto": 37}
    board = Board(totals, stream=out)
    assert board.library == "lines"  # a StringIO is not a terminal
    drive(board, totals)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    for name, total in totals.items():
        mine = [line for line in lines if line.split()[0] == name]
        assert 9 <= len(mine) <= 10, mine  # one per tenth of its steps, the last at total
        assert mine[-1].split()[1] == f"{total}/{total}" and "loss" in mine[-1]


def test_a_grown_total_moves_the_end_and_the_lines_go_on_to_it():
    out = io.StringIO()
    board = Board({"baseline": 20, "aiak": 20}, stream=out)
    with board:
        for done in range(1, 21):
            board.update("aiak", done)
        board.grow("aiak", 40)
        board.note("  20 more steps: the first ones were too noisy")
        for done in range(21, 41):
            board.update("aiak", done)
    lines = out.getvalue().splitlines()
    note = lines.index("  20 more steps: the first ones were too noisy")
    before, after = [line.split()[1] for line in lines[:note]], [line.split()[1] for line in lines[note + 1:]]
    assert before[-1] == "20/20" and after[0] == "24/40" and after[-1] == "40/40" and len(after) == 5, lines


def test_a_terminal_gets_a_live_bar_from_rich():
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as tty:
            board = Board({"baseline": 5}, stream=tty)
            assert board.library == "rich"
            drive(board, {"baseline": 5})
        os.close(slave)
        chunks = b""
        while True:  # everything written, in as many reads as it takes (EIO once the closed side is drained)
            try:
                data = os.read(master, 1 << 16)
            except OSError:
                break
            if not data:
                break
            chunks += data
        chunks = chunks.decode(errors="replace")
    finally:
        os.close(master)
    assert "baseline" in chunks and "5/5" in chunks and "\x1b[" in chunks  # rich redraws with ANSI sequences


@pytest.mark.parametrize("library", ["rich", "tqdm"])
def test_each_library_draws_every_task_to_its_end(library):
    out = io.StringIO()
    totals = {"baseline": 8, "aiak": 8}
    drive(Board(totals, stream=out, library=library), totals)
    text = out.getvalue()
    assert "baseline" in text and "aiak" in text and "8/8" in text


@pytest.mark.parametrize("library", ["rich", "tqdm"])
def test_each_library_grows_a_total_and_writes_a_note(library):
    out = io.StringIO()
    with Board({"aiak": 4}, stream=out, library=library) as board:
        for done in range(1, 5):
            board.update("aiak", done)
        board.grow("aiak", 6)
        board.note("two more steps")
        for done in (5, 6):
            board.update("aiak", done)
    text = out.getvalue()
    assert "6/6" in text and "two more steps" in text and "7/" not in text


def test_disabled_board_writes_nothing():
    out = io.StringIO()
    drive(Board({"a": 10}, stream=out, enabled=False), {"a": 10})
    assert out.getvalue() == ""

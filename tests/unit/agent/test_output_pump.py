"""The output pump: lines prefixed, bar redraws forwarded as they come, lines bounded, ranks chosen."""

from __future__ import annotations

import io

import pytest

from elastic.agent.output_pump import CUT_MARK, ConsoleRanks, OutputPump, SharedConsole, console_ranks
from elastic.contract.console import LOG_FILE_ONLY
from elastic.contract.log_files import RotatingFile


class _Log:
    def __init__(self):
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


def _pump(label="rank0", ranks=ConsoleRanks(), max_line=64 * 1024, out=None):
    out = out or io.StringIO()
    log = _Log()
    return OutputPump(lambda: label, SharedConsole(out), log, ranks, max_line), out, log


@pytest.mark.parametrize("chunks, console, log", [
    ([b"hello\n"], "[rank0]: hello\n", b"hello\n"),
    ([b"hel", b"lo\nwor", b"ld\n"], "[rank0]: hello\n[rank0]: world\n", b"hello\nworld\n"),
    # tqdm: "\r" then the bar, redrawn; the final bar ends with "\n"
    ([b"\r 10%|#", b"\r 50%|#####", b"\r100%|##########|\n"],
     "\r[rank0]:  10%|#\r[rank0]:  50%|#####\r[rank0]: 100%|##########|\n",
     b"\r 10%|#\r 50%|#####\r100%|##########|\n"),
    # a shorter redraw wipes the longer one's tail
    ([b"\rabcdef", b"\rab"], "\r[rank0]: abcdef\r[rank0]: ab    ", b"\rabcdef\r"),
    ([b"a\r\n"], "[rank0]: a\n", b"a\r\n"),
    ([LOG_FILE_ONLY.encode() + b"details\nshown\n"], "[rank0]: shown\n", b"details\nshown\n"),
    # torch's excepthook prefixes a traceback itself: one prefix on the console (it was two)
    ([b"[rank0]: Traceback (most recent call last):\n[rank0]: ValueError: x\n"],
     "[rank0]: Traceback (most recent call last):\n[rank0]: ValueError: x\n",
     b"[rank0]: Traceback (most recent call last):\n[rank0]: ValueError: x\n"),
    # the runtime logs a file-only record while the bar's line is open: the bar stays, on one line
    ([b"\r 10%", LOG_FILE_ONLY.encode() + b"step_times ...\n", b"\r 20%\n"],
     "\r[rank0]:  10%\r[rank0]:  20%\n", b"\r 10%step_times ...\n\r 20%\n"),
])
def test_lines_and_bar_redraws(chunks, console, log):
    pump, out, file = _pump()
    for chunk in chunks:
        pump.feed(chunk)
    assert out.getvalue() == console
    assert file.data == log


def test_a_bar_redraw_reaches_the_console_before_its_line_ends():
    pump, out, _ = _pump()
    pump.feed(b"\r 30%|###")
    assert out.getvalue().endswith("[rank0]:  30%|###")
    pump.close()
    assert out.getvalue().endswith("\n")


@pytest.mark.parametrize("label, ranks, shows_bar, shows_line", [
    ("rank0", ConsoleRanks(), True, True),
    ("rank1", ConsoleRanks(), False, True),  # default: every rank's lines, rank 0's bars
    ("rank1", console_ranks("all"), True, True),
    ("rank1", console_ranks("0,2-3"), False, False),
    ("rank2", console_ranks("0,2-3"), True, True),
    ("host.w0", ConsoleRanks(), False, True),  # no rank yet
])
def test_console_ranks(label, ranks, shows_bar, shows_line):
    pump, out, log = _pump(label, ranks)
    pump.feed(b"\rbar")
    assert ("bar" in out.getvalue()) == shows_bar
    pump.feed(b"\nline\n")
    assert ("line" in out.getvalue()) == shows_line
    assert log.data == b"\rbar\nline\n"  # the log gets everything


@pytest.mark.parametrize("text, parsed", [
    ("all", ConsoleRanks(None, None)),
    ("0", ConsoleRanks(frozenset({0}), frozenset({0}))),
    ("0, 2-4", ConsoleRanks(frozenset({0, 2, 3, 4}), frozenset({0, 2, 3, 4}))),
])
def test_console_ranks_option(text, parsed):
    assert console_ranks(text) == parsed


@pytest.mark.parametrize("text", ["", "x", "3-1", "1-", "-1"])
def test_console_ranks_option_refuses(text):
    with pytest.raises(ValueError):
        console_ranks(text)


def test_a_line_without_end_is_cut_at_the_bound_and_nothing_is_dropped():
    pump, out, log = _pump(max_line=10)
    pump.feed(b"0123456789abcdefghijXY")
    pump.feed(b"Z\n")
    lines = out.getvalue().splitlines()
    mark = CUT_MARK.decode()
    assert lines == [f"[rank0]: 0123456789{mark}", f"[rank0]: abcdefghij{mark}", "[rank0]: XYZ"]
    assert log.data.replace(CUT_MARK + b"\n", b"") == b"0123456789abcdefghijXYZ\n"


def test_pending_text_is_bounded_whatever_the_chunks():
    pump, _, _ = _pump(max_line=100)
    for _ in range(1000):
        pump.feed(b"x" * 37)
        assert len(pump._pending) <= 100


def test_another_workers_line_ends_an_open_bar_line():
    out = io.StringIO()
    console = SharedConsole(out)
    bar = OutputPump(lambda: "rank0", console, None)
    other = OutputPump(lambda: "rank1", console, None)
    bar.feed(b"\r 10%")
    other.feed(b"hello\n")
    bar.feed(b"\r 20%")
    assert out.getvalue() == "\r[rank0]:  10%\n[rank1]: hello\n\r[rank0]:  20%"


def test_worker_log_rotates_at_its_bound(tmp_path):
    path = str(tmp_path / "worker.log")
    log = RotatingFile(path, max_bytes=10, keep=2)
    for i in range(5):
        log.write(b"%d23456789\n" % i)
    log.close()
    assert open(path, "rb").read() == b"423456789\n"
    assert open(path + ".1", "rb").read() == b"323456789\n"
    assert open(path + ".2", "rb").read() == b"223456789\n"
    assert not (tmp_path / "worker.log.3").exists()


def test_the_agents_log_line_ends_an_open_bar_line_first():
    out = io.StringIO()
    console = SharedConsole(out)
    bar = OutputPump(lambda: "rank0", console, None)
    bar.feed(b"\r 10%")
    console.break_line()
    console.break_line()  # nothing open any more
    bar.feed(b"\r 20%")
    assert out.getvalue() == "\r[rank0]:  10%\n\r[rank0]:  20%"

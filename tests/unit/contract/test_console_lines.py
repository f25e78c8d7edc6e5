"""Console lines people can read: gloo's text shortened, failure details kept for the
log file only, no "round None" before the first round."""

from __future__ import annotations

import logging

from elastic.contract.console import FILE_ONLY, LOG_FILE_ONLY, ConsoleFormatter, OutputRouter, WorkerFormatter, route
from elastic.worker.failures import summarize
from elastic.contract.events import EventLog

GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:48280: "
        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
        "application. Check the logs of the remote worker before reporting an error. GLHF!")


def test_summarize_drops_glooss_source_location_and_advice_but_keeps_what_happened():
    assert summarize(RuntimeError(GLOO)) == "RuntimeError: Read error [127.0.0.1]:48280: Connection reset by peer"
    assert summarize(RuntimeError("[x/unbound_buffer.cc:81] Timed out waiting 60000ms\nframe #0")) == (
        "RuntimeError: Timed out waiting 60000ms")
    assert summarize(ValueError("bad batch at step 5")) == "ValueError: bad batch at step 5"


def record(message, level=logging.INFO, **extra):
    rec = logging.LogRecord("elastic", level, __file__, 1, message, None, None)
    rec.__dict__.update(extra)
    return rec


def test_file_only_records_are_marked_on_every_line_under_an_agent_and_routed_off_the_console():
    marked = WorkerFormatter("elastic: %(message)s", marks=True)
    text = marked.format(record("ring broken: one\ntwo", logging.WARNING, **FILE_ONLY))
    assert text.split("\n") == [LOG_FILE_ONLY + "elastic: WARNING: ring broken: one", LOG_FILE_ONLY + "two"]
    for line in text.split("\n"):
        to_file, to_console = route((line + "\n").encode())
        assert not to_console and not to_file.startswith(LOG_FILE_ONLY.encode())
    assert marked.format(record("reform_done")) == "elastic: reform_done"
    assert route(b"elastic: reform_done\n") == (b"elastic: reform_done\n", True)
    # Without an agent there is no log file: everything is printed as is.
    assert WorkerFormatter("elastic: %(message)s", marks=False).format(record("x", **FILE_ONLY)) == "elastic: x"


def test_events_before_the_first_round_have_no_round_prefix_and_console_false_is_file_only(caplog):
    events = EventLog(None, host="h")
    with caplog.at_level(logging.INFO, logger="elastic.contract.events"):
        events.emit("agent_started", workers=2)
        events.round = 3
        events.emit("failure_detected", reason="x", console=False)
    first, second = caplog.records
    assert first.getMessage() == "agent_started workers=2"
    assert second.getMessage() == "round 3: failure_detected reason=x" and second.log_file_only


def test_a_warning_reads_as_one_on_the_console_and_other_lines_carry_no_level():
    """The console shows no levels, so a warning says it is one: a test (and a person)
    can then tell that a successful job printed none."""
    agent = ConsoleFormatter("elastic-run: %(message)s")
    assert agent.format(record("round 3: round_formed")) == "elastic-run: round 3: round_formed"
    assert agent.format(record("lease not revoked", logging.WARNING)) == "elastic-run: WARNING: lease not revoked"
    assert agent.format(record("cannot read", logging.ERROR)) == "elastic-run: ERROR: cannot read"
    worker = WorkerFormatter("checkpoint: %(message)s", marks=True)
    assert worker.format(record("write failed", logging.WARNING)) == "checkpoint: WARNING: write failed"
    warning = record("x", logging.WARNING)
    agent.format(warning)
    assert warning.getMessage() == "x"  # the record itself is left alone for other handlers


CPP_WARNING = [
    b"[rank1]:[W1124 20:26:30.569049306 TCPStore.cpp:106] [c10d] sendBytes failed on SocketImpl(fd=11): Broken pipe\n",
    b"Exception raised from sendBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp:758 "
    b"(most recent call first):\n",
    b"frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f1ff6b79b8d in libc10.so)\n",
    b"<omitting python frames>\n",
    b"frame #33: _start + 0x21 (0x564307bd0081 in python)\n",
    b"\n",
]


def test_torchs_cpp_warning_with_its_stack_goes_to_the_log_file_only():
    """A ring that breaks makes c10d log a warning and a stack of frames straight to the
    worker's stderr (a store write on an aborted ring): the log file keeps it, the
    console shows the worker's reform_done line alone."""
    router = OutputRouter()
    lines = [b"elastic: round 1: sync of commit initial\n", *CPP_WARNING, b"elastic: round 2: reform_done x\n",
             b"[W1124 20:26:31.000000001 ProcessGroupGloo.cpp:12] without a rank yet\n", b"user output\n"]
    routed = [router.route(line) for line in lines]
    assert [line for line, console in routed] == lines  # every line reaches the log file as it was
    assert [line for line, console in routed if console] == [
        b"elastic: round 1: sync of commit initial\n", b"elastic: round 2: reform_done x\n", b"user output\n"]
    assert router.route(LOG_FILE_ONLY.encode() + b"elastic: x\n") == (b"elastic: x\n", False)

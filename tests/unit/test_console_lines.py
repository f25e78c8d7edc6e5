"""Console lines people can read: gloo's text shortened, failure details kept for the
log file only, no "round None" before the first round."""

from __future__ import annotations

import logging

from elastic.console import FILE_ONLY, LOG_FILE_ONLY, WorkerFormatter, route
from elastic.errors import summarize
from elastic.events import EventLog

GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:48280: "
        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
        "application. Check the logs of the remote worker before reporting an error. GLHF!")


def test_summarize_drops_glooss_source_location_and_advice_but_keeps_what_happened():
    assert summarize(RuntimeError(GLOO)) == "RuntimeError: Read error [127.0.0.1]:48280: Connection reset by peer"
    assert summarize(RuntimeError("[x/unbound_buffer.cc:81] Timed out waiting 60000ms\nframe #0")) == (
        "RuntimeError: Timed out waiting 60000ms")
    assert summarize(ValueError("bad batch at step 5")) == "ValueError: bad batch at step 5"


def record(message, **extra):
    rec = logging.LogRecord("elastic", logging.WARNING, __file__, 1, message, None, None)
    rec.__dict__.update(extra)
    return rec


def test_file_only_records_are_marked_on_every_line_under_an_agent_and_routed_off_the_console():
    marked = WorkerFormatter("elastic: %(message)s", marks=True)
    text = marked.format(record("ring broken: one\ntwo", **FILE_ONLY))
    assert text.split("\n") == [LOG_FILE_ONLY + "elastic: ring broken: one", LOG_FILE_ONLY + "two"]
    for line in text.split("\n"):
        to_file, to_console = route((line + "\n").encode())
        assert not to_console and not to_file.startswith(LOG_FILE_ONLY.encode())
    assert marked.format(record("reform_done")) == "elastic: reform_done"
    assert route(b"elastic: reform_done\n") == (b"elastic: reform_done\n", True)
    # Without an agent there is no log file: everything is printed as is.
    assert WorkerFormatter("elastic: %(message)s", marks=False).format(record("x", **FILE_ONLY)) == "elastic: x"


def test_events_before_the_first_round_have_no_round_prefix_and_console_false_is_file_only(caplog):
    events = EventLog(None, host="h")
    with caplog.at_level(logging.INFO, logger="elastic.events"):
        events.emit("agent_started", workers=2)
        events.round = 3
        events.emit("failure_detected", reason="x", console=False)
    first, second = caplog.records
    assert first.getMessage() == "agent_started workers=2"
    assert second.getMessage() == "round 3: failure_detected reason=x" and second.log_file_only

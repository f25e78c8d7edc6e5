"""The human line of an event: a recovery that succeeded reads as one, its cause kept."""

from __future__ import annotations

import logging

from elastic.contract.events import EventLog


def _line(caplog, event: str, **fields) -> str:
    log = EventLog(None, host="h", rank=0)
    log.round = 2
    with caplog.at_level(logging.INFO, logger="elastic.contract.events"):
        log.emit(event, **fields)
    return caplog.records[-1].getMessage()


def test_a_recovery_reads_as_one_with_its_cause_kept(caplog):
    line = _line(caplog, "reform_done", worker="h.w0", world_size=1, failed=True,
                 reason="RuntimeError: Read error [127.0.0.1]:30396: Connection reset by peer",
                 detect_s=0.001, total_s=0.014, commit=104, sync_holders=1)
    # It was "reform_done worker=h.w0 world_size=1 failed=True reason=RuntimeError: ..."
    assert line == ("round 2: reform_done recovered: training again at world size 1 0.014 s after the failure, "
                    "from commit 104; cause: RuntimeError: Read error [127.0.0.1]:30396: Connection reset by peer; "
                    "worker=h.w0 detect_s=0.001 sync_holders=1")
    assert "failed=" not in line


def test_a_planned_switch_reads_as_nothing_rolled_back(caplog):
    line = _line(caplog, "reform_done", world_size=3, failed=False, reason="hosts updated", total_s=0.1, commit=50)
    assert line == "round 2: reform_done re-formed: world size 3 at commit 50, nothing rolled back, in 0.100 s " \
                   "(hosts updated)"


def test_other_events_keep_their_fields(caplog):
    assert _line(caplog, "worker_started", worker="h.w0", pid=7) == "round 2: worker_started worker=h.w0 pid=7"

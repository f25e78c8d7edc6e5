"""A worker under elastic-run survives the SIGTERM that Slurm sends to every process of a step."""

from __future__ import annotations

import os
import signal

from elastic.worker import step_signals


def test_sigterm_is_left_to_the_agent_and_said_once(capsys):
    before = signal.getsignal(signal.SIGTERM)
    try:
        step_signals.leave_sigterm_to_the_agent()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        # Still here: the handler ran (Python runs it at the next bytecode) and returned.
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN  # a handler, not inherited by exec'd programs
        assert capsys.readouterr().err.count("SIGTERM left to the agent") == 1
    finally:
        signal.signal(signal.SIGTERM, before)
        step_signals._told.clear()

"""benchmarks/hybrid.py's figures from its workers' records: no processes."""

from __future__ import annotations

from benchmarks.hybrid import elastic_figures


def _sync(seconds: float, moved: int) -> dict:
    return {"sync_s": seconds, "moved": moved}


def test_elastic_figures_from_a_host_loss_and_a_refill():
    killed = 100.0
    recs = [
        # 2 x 2 before the loss: loops of 1.0 s (0.9 training + 0.1 commit).
        *[{"event": "step", "t": 90.0 + i, "world": 4, "host": h, "step_s": 0.9, "commit_s": 0.1}
          for i in range(3) for h in "ab"],
        # Host a alone: training again 0.3 s after the kill, its first step done 1.2 s after it.
        *[{"event": "entered", "t": 100.3, "world": 2, "host": "a", "sync": _sync(0.05, 0),
           "mesh": "1x2 groups [[0, 1]]"} for _ in range(2)],
        {"event": "step", "t": 101.2, "world": 2, "host": "a", "step_s": 0.8, "commit_s": 0.1},
        {"event": "step", "t": 102.1, "world": 2, "host": "a", "step_s": 0.8, "commit_s": 0.1},
        {"event": "held", "t": 103.0, "world": 2, "host": "a"},
        # The refill: b's two workers receive 500 MB each in 0.6 s; a's sync 0.65 s.
        {"event": "entered", "t": 103.8, "world": 4, "host": "b", "sync": _sync(0.6, 500_000_000),
         "mesh": "2x2 groups [[0, 1], [2, 3]]"},
        {"event": "entered", "t": 103.8, "world": 4, "host": "b", "sync": _sync(0.5, 500_000_000),
         "mesh": "2x2 groups [[0, 1], [2, 3]]"},
        {"event": "entered", "t": 103.7, "world": 4, "host": "a", "sync": _sync(0.65, 0), "mesh": "2x2"},
        {"event": "step", "t": 104.9, "world": 4, "host": "a", "step_s": 0.9, "commit_s": 0.1},
        {"event": "step", "t": 105.9, "world": 4, "host": "a", "step_s": 0.9, "commit_s": 0.1},
    ]
    figures = elastic_figures(recs, killed, detected_at=100.1)
    assert figures["train_loop_s"] == 1.0
    assert figures["loss_to_training_s"] == 0.3 and figures["loss_to_next_step_s"] == 1.2
    assert figures["loss_detected_s"] == 0.1 and figures["loss_detected_to_training_s"] == 0.2
    assert figures["loss_moved_mb"] == 0.0 and figures["loss_mesh"] == "1x2 groups [[0, 1]]"
    assert figures["refill_moved_mb"] == 1000.0 and figures["refill_sync_s"] == 0.6
    assert figures["refill_s_per_gb"] == 0.6
    # From a's last commit alone (103.0) to its first step's end after (104.9), less one loop.
    assert figures["refill_host_a_stall_s"] == 0.9

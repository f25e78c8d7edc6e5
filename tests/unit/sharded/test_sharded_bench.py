"""The figures of benchmarks/sharded.py (sharded_figures.py) as tables: no processes."""

from __future__ import annotations

import pytest

from benchmarks.sharded_figures import (memory_bound, memory_verdict, recovery_figures, reshard_holders, steps_for,
                                        width_for)


@pytest.mark.parametrize("size_mb", [6, 48, 1000])
def test_width_makes_the_state_size(size_mb):
    width = width_for(size_mb)
    state_mb = 4 * (width * width + width) * 3 * 4 / 1e6  # 4 layers, parameter + 2 Adam states, float32
    assert abs(state_mb - size_mb) / size_mb < 0.01


def test_big_sizes_run_their_own_steps():
    assert steps_for(6, 30, 15, 16, 8, 200) == (30, 15)
    assert steps_for(1000, 30, 15, 16, 8, 200) == (16, 8)
    with pytest.raises(ValueError):
        steps_for(6, 10, 10, 16, 8, 200)  # no step left after the kill


def test_holders_after_losing_rank_2_of_4_with_one_replica():
    # One host: rank r's replica is on rank r+1; old ranks 0, 1, 3 become 0, 1, 2.
    assert reshard_holders(4, [2], 1) == {0: [0, 1], 1: [1], 2: [2], 3: [0, 2]}
    assert reshard_holders(4, [2], 0) == {0: [0], 1: [1], 2: [], 3: [2]}


def test_memory_bound_per_new_rank():
    # Width 12: 4 rows per rank of 3 (3 per rank of 4); per layer 4 x 12 weight + 4 bias elements,
    # x 3 states x 4 layers x 4 bytes = 2496 bytes of live shard per rank.
    bounds = memory_bound(12, 4, [2], 1)
    assert [b["live"] for b in bounds] == [2496] * 3
    assert [b["snapshot"] for b in bounds] == [2496] * 3
    assert [b["replicas"] for b in bounds] == [2496] * 3
    # New rank 0 takes old row 3 (shard 1, only on new rank 1): one weight row of 12 floats.
    # New rank 1 takes old rows 6-7 (shard 2, only on new rank 2); new rank 2 holds all its rows.
    assert [b["chunk"] for b in bounds] == [48, 96, 0]
    assert [b["bound"] for b in bounds] == [3 * 2496 + 48, 3 * 2496 + 96, 3 * 2496]


def test_memory_bound_of_a_gigabyte():
    bounds = memory_bound(width_for(1000), 4, [2], 1)
    assert all(990e6 < b["bound"] < 1020e6 for b in bounds)  # a third of the state, three times, + a piece


def _step(t, step_s, copy_s=0.0, snapshot_s=0.0, step=1):
    return {"t": t, "step": step, "step_s": step_s, "copy_s": copy_s, "snapshot_s": snapshot_s}


def test_recovery_subtracts_one_median_loop_iteration():
    before = [_step(10.0 + i, 0.5, 0.1, 0.4) for i in range(5)]
    after = [_step(103.0, 0.5, step=6), _step(101.5, 0.5, step=5), _step(99.0, 0.5, step=4)]  # 99.0: before the kill
    figures = recovery_figures(before, after, killed_at=100.0)
    assert figures["kill_to_next_step_s"] == 1.5
    assert figures["stall_beyond_rerun_s"] == 0.5
    assert figures["resumed_at_step"] == 5
    assert (figures["train_median_s"], figures["copy_median_s"], figures["snapshot_median_s"]) == (0.5, 0.1, 0.4)


def test_memory_verdict_names_the_worst_rank():
    bounds = [{"live": 1e6, "snapshot": 1e6, "replicas": 1e6, "chunk": 0, "bound": 3e6}] * 3
    verdict = memory_verdict({0: 2.5, 1: 3.5, 2: 2.0}, bounds)
    assert (verdict["rank"], verdict["peak_mb"], verdict["bound_mb"], verdict["met"]) == (1, 3.5, 3.0, False)
    assert memory_verdict({0: 2.5, 1: 3.0}, bounds)["met"]

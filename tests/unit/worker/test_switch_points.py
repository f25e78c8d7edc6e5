"""Switch points: every commit until the ranks agree on a pace, then spaced by it; the
spacing changes only at a point, so every rank counts the same points."""

from elastic.worker.stragglers import StragglerWatch
from elastic.worker.switch_points import SwitchPoints
from tests.fakes.ring import FakeRing, Recorder


def test_before_a_pace_is_agreed_every_commit_is_a_point():
    points = SwitchPoints()
    assert all(points.is_point(c) for c in range(1, 20))


def test_points_are_spaced_by_the_agreed_pace():
    assert SwitchPoints().agree(11, 0.04) == 6  # 0.25 s of 40 ms steps
    assert SwitchPoints().agree(11, 0.5) == 1  # slow steps: every commit, as before
    assert SwitchPoints().agree(11, 0.0001) == 16  # at most MAX_EVERY
    points = SwitchPoints()
    points.agree(11, 0.04)
    assert [c for c in range(1, 30) if points.is_point(c)] == [11, 17, 23, 29]


class _Still:
    waiting_s = 0.0

    def stop(self):
        pass


def test_the_spacing_changes_only_at_a_point_of_the_spacing_before():
    # The straggler watch's exchanges set the spacing. Each rank decides at its points
    # whether to take rank 0's word (a collective), so a change of spacing must come at a
    # commit that was a point before it, whatever the paces: else the ranks would
    # disagree on which commits are points.
    for step_s in (0.01, 0.03, 0.04, 0.07, 0.2):
        for pace_change_at in (30, 77, 140):
            now = [0.0]
            points = SwitchPoints()
            watch = StragglerWatch(Recorder(), "w0", ratio=1.5, clock=_Still(), now=lambda: now[0])
            watch.begin_round(FakeRing(round=1), on_pace=points.agree)
            changes = 0
            for c in range(1, 400):
                now[0] += step_s if c < pace_change_at else step_s * 3
                before = (points.every, points.origin)
                was_point = points.is_point(c)
                watch.on_commit(c)  # may change the spacing, at a point
                if (points.every, points.origin) != before:
                    changes += 1
                    assert was_point and points.is_point(c), (step_s, pace_change_at, c)
            assert changes >= 1, (step_s, pace_change_at)

"""Switch points: every commit until the ranks agree on a pace, then spaced by it; a
change of spacing never skips a switch rank 0 scheduled."""

from elastic.worker.stragglers import StragglerWatch
from elastic.worker.switch_points import SwitchPoints
from tests.fakes.ring import FakeRing, Recorder


def test_before_a_pace_is_agreed_every_commit_is_a_point():
    points = SwitchPoints()
    assert all(points.is_point(c) for c in range(1, 20))
    assert [points.next_point(c) for c in (1, 2, 7)] == [2, 3, 8]


def test_points_are_spaced_by_the_agreed_pace():
    assert SwitchPoints().agree(11, 0.04) == 6  # 0.25 s of 40 ms steps
    assert SwitchPoints().agree(11, 0.5) == 1  # slow steps: every commit, as before
    assert SwitchPoints().agree(11, 0.0001) == 16  # at most MAX_EVERY
    points = SwitchPoints()
    points.agree(11, 0.04)
    assert [c for c in range(1, 30) if points.is_point(c)] == [11, 17, 23, 29]
    assert [points.next_point(c) for c in (11, 12, 16, 17)] == [17, 17, 17, 23]


class _Still:
    waiting_s = 0.0

    def stop(self):
        pass


def test_a_switch_scheduled_before_a_change_of_spacing_is_still_a_point_after_it():
    # The straggler watch's exchanges set the spacing; whatever the paces, a switch rank 0
    # schedules at commit c (the first point after c) must be a point where the other
    # ranks look, also when the spacing changes between c and it.
    for step_s in (0.01, 0.03, 0.04, 0.07, 0.2):
        for pace_change_at in (30, 77, 140):
            now = [0.0]
            points = SwitchPoints()
            watch = StragglerWatch(Recorder(), "w0", ratio=1.5, clock=_Still(), now=lambda: now[0])
            watch.begin_round(FakeRing(round=1), on_pace=points.agree)
            scheduled: dict[int, int] = {}  # decided at -> switch point, as rank 0 would
            for c in range(1, 400):
                now[0] += step_s if c < pace_change_at else step_s * 3
                watch.on_commit(c)  # may change the spacing, at a point
                for decided, p in scheduled.items():
                    if p == c:
                        assert points.is_point(c), (step_s, pace_change_at, decided, p)
                scheduled[c] = points.next_point(c)

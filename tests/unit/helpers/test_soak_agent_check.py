"""compare_agents: the soak's leak check sets an agent's last descriptors and threads against
itself in the same role, so that leading the job (the coordinator's loop and watch streams,
6-7 threads) is not taken for a leak, and a leak still is."""

from tests.chaos.soak_bed import compare_agents


def grown(samples):
    return {pid: c.grown for pid, c in compare_agents(samples).items()}


def life(counts_and_roles, start=1):
    return [(start + i, counts, leads) for i, (counts, leads) in enumerate(counts_and_roles)]


def test_the_check_as_a_table():
    follower, leader = (20, 21), (20, 27)
    cases = [
        # (what, one agent's samples after each fault, grown?)
        ("flat, never leading", life([(follower, False)] * 40), False),
        ("became the leader, had led before", life([(follower, False)] * 12 + [(leader, True)] * 5
                                                   + [(follower, False)] * 10 + [(leader, True)] * 13), False),
        ("became the leader, never had since settling", life([(follower, False)] * 35 + [(leader, True)] * 5), False),
        ("gave up leading", life([(follower, False)] * 5 + [(leader, True)] * 20 + [(follower, False)] * 15), False),
        ("a follower that grew 6 threads", life([(follower, False)] * 35 + [((20, 27), False)] * 5), True),
        ("a leader that grew 6 threads past its role", life([(leader, True)] * 35 + [((20, 33), True)] * 5), True),
        ("new leader, 15 more threads", life([(follower, False)] * 35 + [((20, 36), True)] * 5), True),
        ("descriptors past the store's allowance", life([(follower, False)] * 35 + [((37, 21), False)] * 5), True),
        ("role unknown at the end: the first settled sample", life([(follower, False)] * 39 + [(follower, None)]),
         False),
        ("too short a life to judge", life([(follower, False)] * 10 + [((40, 40), False)] * 19), None),
        # Nothing sampled between 10 in and 20 before its end: set against its first sample
        # 10 in, as the check did before roles (no error, and nothing to judge by).
        ("unsampled from 10 in to 20 before the end", life([(follower, False)] * 5)
         + life([((40, 40), False)] * 3, start=30), False),
    ]
    for what, samples, expected in cases:
        assert grown({1: samples}).get(1) == expected, what

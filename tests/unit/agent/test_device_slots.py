"""Device slots as a table: starts, losses, replacements, joins, a holder not yet gone."""

from __future__ import annotations

import pytest

from elastic.agent.device_slots import DeviceSlots, SlotConflict, check_distinct, free_slot


@pytest.mark.parametrize("size, held, expected", [
    (4, set(), 0),  # the first worker of a host
    (4, {0}, 1),
    (4, {0, 1, 2}, 3),
    (4, {0, 2, 3}, 1),  # the worker on slot 1 is gone: its replacement takes 1
    (4, {1, 2, 3}, 0),  # rank order does not matter: slot 0 was freed
    (4, {0, 1, 2, 3}, None),  # every slot held (a holder has not exited yet): none
    (1, {0}, None),
    (2, {5}, 0),  # a stray slot outside the range does not take one inside it
])
def test_free_slot_is_the_lowest_one_no_live_process_holds(size, held, expected):
    assert free_slot(size, held) == expected


# Each row: events in order, then the slot every start got. "start W PID", "exit PID".
SCENARIOS = [
    ("four starts", ["start a 10", "start b 11", "start c 12", "start d 13"], {"a": 0, "b": 1, "c": 2, "d": 3}),
    ("the worker on slot 1 lost and replaced: survivors keep theirs",
     ["start a 10", "start b 11", "start c 12", "start d 13", "exit 11", "start e 14"],
     {"a": 0, "b": 1, "c": 2, "d": 3, "e": 1}),
    ("slot 0 lost, not replaced, then a joiner: it takes slot 0",
     ["start a 10", "start b 11", "exit 10", "start c 12"], {"a": 0, "b": 1, "c": 0}),
    ("two lost: replacements fill the lowest first",
     ["start a 10", "start b 11", "start c 12", "exit 12", "exit 10", "start d 13", "start e 14"],
     {"a": 0, "b": 1, "c": 2, "d": 0, "e": 2}),
    ("a restarted torchrun worker keeps its id, its old process exited first",
     ["start a 10", "start b 11", "exit 11", "start b 12"], {"a": 0, "b": 1}),
    ("the exit of a pid that held nothing frees nothing",
     ["start a 10", "exit 99", "start b 11"], {"a": 0, "b": 1}),
]


def _play(size, events):
    slots, got, waiting = DeviceSlots(size), {}, []
    for event in events:
        kind, *rest = event.split()
        if kind == "start":
            worker, pid = rest[0], int(rest[1])
            slot = slots.claim(worker)
            if slot is None:
                waiting.append(worker)
                continue
            slots.hold(slot, pid, worker)
            got[worker] = slot
        else:
            slots.release(int(rest[0]))
    return slots, got, waiting


@pytest.mark.parametrize("name, events, expected", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_slots_over_a_host_life(name, events, expected):
    _, got, waiting = _play(4, events)
    assert got == expected and waiting == []


def test_a_holder_not_seen_to_exit_keeps_its_slot_and_the_successor_waits():
    # b (slot 1) was killed but its exit has not been seen (a process in the driver):
    # with every slot held, its replacement waits instead of sharing a GPU.
    slots, got, waiting = _play(2, ["start a 10", "start b 11", "start c 12"])
    assert got == {"a": 0, "b": 1} and waiting == ["c"]
    assert slots.awaiting(lambda w: True) == []  # still nothing free
    slots.release(11)  # the agent sees b's exit
    assert slots.awaiting(lambda w: True) == ["c"]
    assert slots.claim("c") == 1 and slots.awaiting(lambda w: True) == []


def test_a_waiting_worker_no_longer_wanted_is_forgotten():
    slots, _, waiting = _play(1, ["start a 10", "start b 11"])
    assert waiting == ["b"]
    slots.release(10)
    assert slots.awaiting(lambda w: w != "b") == []
    assert slots.awaiting(lambda w: True) == []  # forgotten for good


def test_two_processes_on_one_slot_is_a_bug_that_raises():
    slots = DeviceSlots(4)
    slots.hold(1, 10, "a")
    with pytest.raises(SlotConflict, match="slot 1"):
        slots.hold(1, 11, "b")
    with pytest.raises(SlotConflict, match="outside"):
        slots.hold(4, 12, "c")


@pytest.mark.parametrize("pairs, error", [
    ([("a", 0), ("b", 1)], None),
    ([("a", 1), ("b", 1)], "both hold device slot 1"),
    ([("a", -1)], "outside"),
    ([], None),
])
def test_check_distinct(pairs, error):
    if error is None:
        check_distinct(pairs, 2)
    else:
        with pytest.raises(SlotConflict, match=error):
            check_distinct(pairs, 2)

"""What a worker tells its agent to act on: typed messages, one line each, read by host."""

from __future__ import annotations

import json
import threading

import pytest

from elastic.contract.agent_channel import (ChannelBell, ChannelReader, RingBroke, RingFormed, Straggler, Told, decode,
                                           encode, tell_agent)
from elastic.contract.worker_config import WorkerConfig


def _config(path, host="h1", worker="m.w0") -> WorkerConfig:
    return WorkerConfig(job_id="j", endpoints="e", worker_id=worker, member_id="m", host_id=host, round=1,
                        agent_channel=str(path) if path else None)


def test_what_a_worker_tells_its_agent_arrives_typed_and_in_order(tmp_path):
    path = tmp_path / "channel.jsonl"
    reader = ChannelReader(str(path), "h1")
    assert reader.read_new() == []  # nothing told yet: no file
    tell_agent(_config(path), RingBroke(3, "DistNetworkError: peer closed"))
    tell_agent(_config(path, worker="m.w1"), Straggler(3, 1, 2.5, 3))
    tell_agent(_config(path, worker="m.w1"), RingFormed(4))
    assert reader.read_new() == [Told("h1", "m.w0", RingBroke(3, "DistNetworkError: peer closed")),
                                 Told("h1", "m.w1", Straggler(3, 1, 2.5, 3)), Told("h1", "m.w1", RingFormed(4))]
    assert reader.read_new() == []  # read once
    # Survives the config's trip through the worker's environment.
    assert WorkerConfig.from_env(_config(path).to_env()).agent_channel == str(path)


def test_another_hosts_message_is_never_acted_on(tmp_path, caplog):
    path = tmp_path / "channel.jsonl"
    tell_agent(_config(path, host="h2", worker="n.w0"), RingBroke(3, "x"))  # a channel shared by mistake
    tell_agent(_config(path), RingBroke(4, "y"))
    assert ChannelReader(str(path), "h1").read_new() == [Told("h1", "m.w0", RingBroke(4, "y"))]
    assert "from host h2 (not ours)" in caplog.text


def test_without_an_agent_nothing_is_written(tmp_path):
    tell_agent(_config(None), RingBroke(1, "x"))
    assert list(tmp_path.iterdir()) == []


GOOD = json.loads(encode("h1", "m.w0", Straggler(3, 1, 2.5, 3)))


@pytest.mark.parametrize("line", [
    "not json",
    "[1, 2]",
    json.dumps({**GOOD, "schema": 2}),  # a newer worker's schema: not guessed at
    json.dumps({**GOOD, "kind": "failure_detected"}),  # an events-log name is not a message
    json.dumps({**GOOD, "rank": "1"}),
    json.dumps({**GOOD, "remaining": True}),  # a bool is not a count
    json.dumps({k: v for k, v in GOOD.items() if k != "ratio"}),
    json.dumps({**GOOD, "host": None}),
])
def test_a_line_that_is_not_a_message_is_skipped(line):
    assert decode(line) is None


def test_an_int_ratio_is_a_float_and_an_unknown_field_is_ignored():
    assert decode(json.dumps({**GOOD, "ratio": 2, "extra": 1})) == Told("h1", "m.w0", Straggler(3, 1, 2.0, 3))


def test_lines_of_many_writers_never_interleave(tmp_path):
    path = tmp_path / "channel.jsonl"
    reason = "x" * 1500  # longer than a pipe's atomic write would need to be

    def worker(n):
        for _ in range(50):
            tell_agent(_config(path, worker=f"m.w{n}"), RingBroke(n, reason))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    told = ChannelReader(str(path), "h1").read_new()
    assert len(told) == 200 and all(t.message == RingBroke(int(t.worker[-1]), reason) for t in told)


def test_a_line_still_being_written_is_read_whole_later(tmp_path):
    path = tmp_path / "channel.jsonl"
    line = encode("h1", "m.w0", RingBroke(5, "r")) + "\n"
    reader = ChannelReader(str(path), "h1")
    path.write_text(line[:20])
    assert reader.read_new() == []
    with open(path, "a") as f:
        f.write(line[20:])
    assert reader.read_new() == [Told("h1", "m.w0", RingBroke(5, "r"))]


def test_the_bell_rings_for_each_message_and_not_while_nothing_is_told(tmp_path):
    path = tmp_path / "channel.jsonl"
    rung = threading.Semaphore(0)
    bell = ChannelBell(str(path), rung.release, every=0.01).start()
    try:
        assert not rung.acquire(timeout=0.1)  # no file yet: silence
        tell_agent(_config(path), RingFormed(2))
        assert rung.acquire(timeout=5)
        assert not rung.acquire(timeout=0.1)  # rung once for one message
        tell_agent(_config(path), RingBroke(2, "x"))
        assert rung.acquire(timeout=5)
    finally:
        bell.stop()

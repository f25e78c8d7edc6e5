"""A live host is never dropped: a slow, bloated link and starved CPUs on namespaced hosts.

A host that died hard answers nothing, so the agents' peer probe reports a peer that
answers none of its connects for 0.75 s (one every 0.25 s), and the coordinator plans
without it: the survivors go on about 1.3 s after the loss (``benchmarks/faults.py``,
partition-host). This is the other side of that bound. Three hosts, one worker each,
as in test_partitions.py, train through two faults that slow a host without killing it:

* **a slow link**: host 2's traffic out is shaped to 4 Mbit/s behind a 0.4 s queue
  (tc's token bucket filter), and a bulk flow fills that queue, so every packet it
  sends, a SYN-ACK to a probe included, waits about 0.4 s: longer than one connect's
  slot, shorter than the probe's window. The ring slows down and stalls, the agents
  probe, hear host 2 late (``peers_slow``), and nobody is excluded.
* **starved CPUs**: busy processes, three per core, on this machine that runs every
  host. The probes' answers come from the kernel, and a prober that wakes late takes
  the answers the kernel already has: nobody is excluded.

Through both the ring is never re-formed, and the job ends with equal parameters.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import pytest

from tests.fakes.jobs import read_jsonl, wait_until
from tests.hosts.test_partitions import finish, start, steps_after

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

FAULT_S = 12.0  # each fault lasts this long: many probe windows, several stalls
SINK_PORT = 47011

_SINK = ("import socket\n"
         "server = socket.create_server(('0.0.0.0', %d))\n"
         "conn, _ = server.accept()\n"
         "while conn.recv(1 << 16):\n"
         "    pass\n") % SINK_PORT
_FLOOD = ("import socket, sys, time\n"
          "deadline = time.monotonic() + 30\n"
          "while True:\n"
          "    try:\n"
          "        conn = socket.create_connection((sys.argv[1], %d))\n"
          "        break\n"
          "    except OSError:\n"
          "        if time.monotonic() > deadline:\n"
          "            raise\n"
          "        time.sleep(0.05)\n"
          "block = b'x' * (1 << 16)\n"
          "while True:\n"
          "    conn.sendall(block)\n") % SINK_PORT
_SPIN = "while True:\n    pass\n"


def events_of(jobs, kind):
    return [e for job in jobs for e in job.events() if e["event"] == kind]


def step_gaps(out, since, until):
    times = sorted(s["t"] for s in steps_after(out, since, 3) if s["t"] <= until)
    return [b - a for a, b in zip(times, times[1:])]


def test_a_slow_link_and_starved_cpus_drop_no_live_host(netns_hosts, tmp_path):
    hosts = netns_hosts(3)
    jobs = start(hosts, tmp_path, "livehosts")
    out = tmp_path / "out"
    wait_until(lambda: len(steps_after(out, 0, 3)) >= 30, 180, "the 3-worker ring to train")
    ring_round = max(s["round"] for s in steps_after(out, 0, 3))
    helpers: list[subprocess.Popen] = []
    try:
        # -- a slow link: host 2's packets out wait ~0.4 s behind a bulk flow
        slow_at = time.time()
        hosts[2].slow_link(rate="4mbit", queue_s=0.4)
        helpers.append(hosts[1].run([sys.executable, "-c", _SINK]))
        helpers.append(hosts[2].run([sys.executable, "-c", _FLOOD, hosts[1].addr]))
        slow = wait_until(lambda: [e for e in events_of(jobs, "peers_slow") if e["time"] > slow_at], FAULT_S + 30,
                          "a probe that hears host 2 late")
        time.sleep(max(0.0, slow_at + FAULT_S - time.time()))  # the fault's length, not a synchronisation
        slow_until = time.time()
        for helper in helpers:
            helper.kill()
        hosts[2].heal()

        # -- starved CPUs: three busy processes per core
        starved_at = time.time()
        helpers += [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(3 * (os.cpu_count() or 2))]
        time.sleep(FAULT_S)  # the fault's length, not a synchronisation
        starved_until = time.time()
    finally:
        for helper in helpers:
            helper.kill()
            helper.wait(10)
        hosts[2].heal()

    slowed = step_gaps(out, slow_at, slow_until)
    starved = step_gaps(out, starved_at, starved_until)
    print(f"\nslow link: {len(slowed) + 1} steps in {slow_until - slow_at:.1f}s, median gap "
          f"{statistics.median(slowed) if slowed else float('nan'):.2f}s, longest {max(slowed, default=0):.2f}s; "
          f"heard late: {[e['answered_after_s'] for e in slow]}")
    print(f"starved CPUs: {len(starved) + 1} steps in {starved_until - starved_at:.1f}s, longest gap "
          f"{max(starved, default=0):.2f}s")
    # The link was slow enough to matter: the ring stalled past the probe's bound, and a
    # probe heard host 2 only on a later connect than its first.
    assert max(slowed, default=0) > 0.4, slowed
    assert any(seconds > 0.25 for e in slow for seconds in e["answered_after_s"].values()), slow
    # Nobody excluded, nothing re-formed, and both faults trained at full strength.
    assert events_of(jobs, "peers_unreachable") == []
    assert max(s["round"] for s in read_jsonl(out / "steps.jsonl")) == ring_round
    assert slowed and starved, "steps of the 3-worker ring during each fault"
    finish(tmp_path, jobs, out)


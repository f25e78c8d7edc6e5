"""Asymmetric partitions on namespaced hosts: a host loses etcd or its peers, not both.

Three hosts, one worker each (--min-np 2), as in test_partitions.py.

* **etcd cut, peers reachable** (``cut_etcd``). While membership is stable the ring
  needs no etcd and trains on. But the host cannot refresh its lease: after
  --rdzv-ttl it is gone from the job's point of view, and the coordinator plans a
  round without it, like any host that went silent. That is the consistent choice: a
  host that cannot see the plans cannot be told about re-formations, fenced or
  admitted, so it must not stay in the ring. The survivors go on within ttl + 2 s of
  the cut, the cut host's workers never complete a step of the round the job left,
  and when etcd is reachable again its agent registers again and the job grows back.
* **peers cut, etcd reachable** (``cut_peers``). Its lease stays alive, so nothing
  evicts it by TTL, and every worker blocks in a collective: a victim, not a culprit,
  for the hang watchdog. The agents see their workers stalled, probe each other's
  ports and report to etcd what they cannot reach; the coordinator plans without the
  host that the others cannot reach (rendezvous/reachability.py). The survivors go
  on within ttl + 2 s, the cut host's worker never completes a step of the round the
  job left, and once its probes and theirs succeed again it rejoins at a commit.
"""

from __future__ import annotations

import time

import pytest

from tests.fakes.jobs import wait_until
from tests.hosts.test_partitions import SLACK_S, TTL, Cut, assert_fenced, finish, start, steps_after

# Heavy: the slow run, which CI runs too. A plain host cut (the same assertions on a simpler
# path than the host holding rank 0, the store and the coordinator) is extended: by hand only.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

HOLD_S = 8.0  # a cut kept this long after the survivors moved on: longer than a probe cycle


@pytest.mark.parametrize("victim", [pytest.param(0, id="rank0-store-and-coordinator"), pytest.param(2, id="plain", marks=pytest.mark.extended)])
def test_a_host_cut_from_etcd_only_is_left_behind_within_ttl_and_rejoins(netns_hosts, tmp_path, victim):
    hosts = netns_hosts(3)
    jobs = start(hosts, tmp_path, f"etcdcut-{victim}")
    out = tmp_path / "out"
    wait_until(lambda: len(steps_after(out, 0, 3)) >= 15, 180, "the 3-worker ring to train")
    old_round = max(s["round"] for s in steps_after(out, 0, 3))

    cut_at = time.time()
    hosts[victim].cut_etcd()
    assert not hosts[victim].reaches(hosts.bridge_addr, hosts.etcd.client_port)
    after_cut = wait_until(lambda: steps_after(out, cut_at, 2), TTL + 60, "a step of the 2 survivors")
    stall = min(s["t"] for s in after_cut) - cut_at
    print(f"\nhost {victim} cut from etcd: survivors' next step after {stall:.2f}s (ttl {TTL:g}s)")
    assert stall <= TTL + 2 + SLACK_S, f"survivors stalled {stall:.1f}s"
    # Fenced: no step of the round the job left completes once the survivors moved on.
    first_new = min(s["t"] for s in after_cut)
    assert_fenced(out, old_round, first_new)

    healed_at = time.time()
    hosts[victim].heal()
    rejoined = wait_until(lambda: steps_after(out, healed_at, 3), 180, "the cut host to rejoin")
    print(f"host {victim} reaches etcd again: back to 3 workers after {min(s['t'] for s in rejoined) - healed_at:.2f}s")
    finish(tmp_path, jobs, out, fenced=Cut(cut_at, old_round, first_new))  # and after the heal


@pytest.mark.parametrize("victim", [pytest.param(0, id="rank0-store-and-coordinator"), pytest.param(2, id="plain", marks=pytest.mark.extended)])
def test_a_host_cut_from_its_peers_only_is_left_behind_and_rejoins(netns_hosts, tmp_path, victim):
    hosts = netns_hosts(3)
    jobs = start(hosts, tmp_path, f"peercut-{victim}")
    out = tmp_path / "out"
    wait_until(lambda: len(steps_after(out, 0, 3)) >= 15, 180, "the 3-worker ring to train")
    old_round = max(s["round"] for s in steps_after(out, 0, 3))
    peer = hosts[1 if victim != 1 else 0]

    cut_at = time.time()
    hosts[victim].cut_peers()
    assert not hosts[victim].reaches(peer.addr, 22)
    assert hosts[victim].reaches(hosts.bridge_addr, hosts.etcd.client_port)
    after_cut = wait_until(lambda: steps_after(out, cut_at, 2), TTL + 2 + SLACK_S + 10, "a step of the 2 survivors")
    stall = min(s["t"] for s in after_cut) - cut_at
    print(f"\nhost {victim} cut from its peers: survivors' next step after {stall:.2f}s (ttl {TTL:g}s)")
    assert stall <= TTL + 2 + SLACK_S, f"survivors stalled {stall:.1f}s"
    # The cut host's agent named both peers; the coordinator said why it planned without it.
    cut_report = [e for e in jobs[victim].events() if e["event"] == "peers_unreachable"]
    assert cut_report and len(cut_report[0]["unreachable"]) == 2, cut_report
    assert any("unreachable from the ring" in e.get("reason", "") for job in jobs for e in job.events()
               if e["event"] == "round_formed")

    # While the cut lasts, the survivors train on without it, and it is not let back in.
    first_new = min(s["t"] for s in after_cut)
    wait_until(lambda: steps_after(out, first_new + HOLD_S, 2), 60, f"the survivors to train {HOLD_S:g}s more")
    # (A step of the old ring may be recorded just after cut_at: its all-reduce can end
    # while the cut is being made. A ring of 3 after the cut is what must not exist.)
    readmitted = [s for s in steps_after(out, cut_at, 3) if s["round"] > old_round]
    assert not readmitted, readmitted
    # Fenced: no step of the round the job left completes once the survivors moved on.
    assert_fenced(out, old_round, first_new)

    healed_at = time.time()
    hosts[victim].heal()
    rejoined = wait_until(lambda: steps_after(out, healed_at, 3), 180, "the cut host to rejoin")
    print(f"host {victim} reaches its peers again: back to 3 workers after "
          f"{min(s['t'] for s in rejoined) - healed_at:.2f}s")
    finish(tmp_path, jobs, out, fenced=Cut(cut_at, old_round, first_new))  # and after the heal

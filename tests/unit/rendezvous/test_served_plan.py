"""served_plan.decide: the members of a bare-metal job's own etcd -> the next change (a table, no etcd)."""

from __future__ import annotations

import pytest

from elastic.rendezvous.served_plan import Add, Offer, Promote, Remove, Seat, Wait, decide, initial_cluster


def offer(n: int, order: int | None = None, addr: str | None = None) -> Offer:
    return Offer(f"h{n}", addr or f"10.0.0.{n}", 2379, 2380, order if order is not None else n)


def seat(n: int, *, learner=False, started=True, addr: str | None = None) -> Seat:
    return Seat(100 + n, f"h{n}" if started else "", offer(n, addr=addr).peer_url, learner)


H = {n: offer(n) for n in range(6)}


@pytest.mark.parametrize("seats, offers, learners, expected", [
    # One member on the endpoint's host; a second host offers: it gets a learner.
    ([seat(0)], [H[0], H[1]], True, Add(H[1], learner=True)),
    # etcd without learners: a plain member.
    ([seat(0)], [H[0], H[1]], False, Add(H[1], learner=False)),
    # Alone: nothing to do, the single point of failure is said.
    ([seat(0)], [H[0]], True, Wait("1 member(s), no other host to hold one")),
    # Added but not started: wait (one change at a time).
    ([seat(0), seat(1, learner=True, started=False)], [H[0], H[1], H[2]], True,
     Wait(f"member {H[1].peer_url} added, not started yet")),
    ([seat(0), seat(1, started=False)], [H[0], H[1], H[2]], False,
     Wait(f"member {H[1].peer_url} added, not started yet")),
    # A started learner is promoted before anything else is added.
    ([seat(0), seat(1, learner=True)], [H[0], H[1], H[2]], True, Promote(101, "h1")),
    # Two voting members, a third host: the third member.
    ([seat(0), seat(1)], [H[0], H[1], H[2]], True, Add(H[2], learner=True)),
    # Three: enough, whatever else offers.
    ([seat(0), seat(1), seat(2)], [H[n] for n in range(5)], True, Wait("3 members")),
    # The first to offer goes first (its key's create revision), not the name's order.
    ([seat(0)], [H[0], offer(4, order=1), offer(3, order=2)], True, Add(offer(4, order=1), learner=True)),
    # Two agents on one host (one address) are one host: the second one gets nothing.
    ([seat(0)], [H[0], Offer("h0b", "10.0.0.0", 2381, 2382, 9)], True,
     Wait("1 member(s), no other host to hold one")),
    # A lost host's member is removed first, even with a learner waiting.
    ([seat(0), seat(1), seat(2)], [H[1], H[2], H[3]], True, Remove(100, "member h0's host is gone")),
    ([seat(0), seat(1), seat(2, learner=True, started=False)], [H[0], H[2]], True,
     Remove(101, "member h1's host is gone")),
    # ... then (next call) the replacement: remove first, then add.
    ([seat(1), seat(2)], [H[1], H[2], H[3]], True, Add(H[3], learner=True)),
    # A member added but never started, whose host died: removed like any other.
    ([seat(0), seat(1, learner=True, started=False)], [H[0]], True, Remove(101, "member 65's host is gone")),
    # The last voting member is never removed.
    ([seat(0)], [H[1]], True, Wait("member h0 has no live host, but it is the last voting member")),
])
def test_decide(seats, offers, learners, expected):
    assert decide(seats, offers, learners=learners) == expected


def test_a_member_is_its_hosts_by_name_once_started_and_by_peer_url_before():
    moved = Offer("h1", "10.0.0.1", 2379, 2999, 1)  # same host, another peer port: not the unstarted member's
    assert decide([seat(0), seat(1, started=False)], [H[0], moved], learners=True) == Remove(
        101, "member 65's host is gone")  # an unstarted member is named by its id (hex)
    assert decide([seat(0), seat(1)], [H[0], moved], learners=True) == Wait("2 member(s), no other host to hold one")


def test_initial_cluster_names_every_started_member_and_the_new_one():
    seats = [seat(0), seat(1), seat(2, learner=True, started=False)]
    assert initial_cluster(seats, H[2]) == (f"h0={H[0].peer_url},h1={H[1].peer_url},h2={H[2].peer_url}")


def test_ipv6_urls_are_bracketed():
    assert Offer("h", "fd00::1", 1, 2).peer_url == "http://[fd00::1]:2"


def test_a_secured_offer_speaks_https_to_peers_and_clients():
    offer = Offer("h", "10.0.0.1", 2379, 2380, tls=True)
    assert (offer.peer_url, offer.client_url) == ("https://10.0.0.1:2380", "https://10.0.0.1:2379")
    assert Offer("h", "fd00::1", 1, 2, tls=True).peer_url == "https://[fd00::1]:2"

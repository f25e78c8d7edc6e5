"""The host side of ``elastic-run``: one agent per host.

The agent holds the host's membership (a lease in etcd), starts and supervises its
worker processes, serves the round's store when one of them is rank 0, watches them
for hangs and turns what it sees into membership changes. The worker side (the
runtime, state, recovery) lives beside this package in ``elastic/``.

    agent.py        the agent: its loop, following plans, what a worker's exit means, leaving
    worker_env.py   the environment a worker starts with (torchrun's variables, ours)
    etcd_writes.py  reports queued while etcd is away, sent in order when it is back
    workers.py      worker processes: start, output, exit, signals
    watchdog.py     hang detection from the workers' progress marks
    health.py       the health endpoint for pod probes
    plain_store.py  a fresh store per round for torchrun-style scripts
    addressing.py   which address and interface peers reach this host at
"""

from .agent import Agent, AgentConfig

__all__ = ["Agent", "AgentConfig"]

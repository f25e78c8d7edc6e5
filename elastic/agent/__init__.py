"""The host side of ``elastic-run``: one agent per host.

The agent holds the host's membership (a lease in etcd), starts and supervises its
worker processes, serves the round's store when one of them is rank 0, watches them
for hangs and turns what it sees into membership changes. It starts workers as
processes (``python -m elastic.worker.bootstrap``) and never imports the worker
runtime: what passes between the two is ``elastic/contract/``. May import the
contract, the timeline model, ``rendezvous`` and ``checkpoint``.

    agent.py        the agent: its loop, following plans, acting on a worker's exit, leaving
    fate.py         what a worker's exit means (its record, the agent's view) -> one decision
    budgets.py      what the agent may still spend on failures (restarts, network rounds), in one object
    local_workers.py  this host's workers: the ids offered, the processes running, their device slots
    outcome.py      the job's final status -> elastic-run's exit status (a user error is 3)
    config.py       what the agent is told, and what it tells each worker
    worker_env.py   the environment a worker starts with (torchrun's variables, ours)
    event_tail.py   the workers' events, read from the events file they append to (metrics, summary)
    metrics.py      Prometheus metrics from those events and the progress boards
    straggler_eviction.py  a reported straggler's host leaves (--evict-stragglers)
    chaos.py        --chaos-kill-every: kill our own workers, report the recoveries
    peer_probe.py   can we reach our peers' agents while the ring is stalled?
    etcd_writes.py  reports queued while etcd is away, sent in order when it is back
    workers.py      worker processes: start, output, exit, signals
    output_pump.py  a worker's output: lines prefixed, progress bars live, --console-ranks, bounded lines
    run_watch.py    progress for `elastic-run status`, the end-of-run summary, the chaos monkey's events
    watchdog.py     hang detection from the workers' progress marks
    health.py       the health endpoint for pod probes
    plain_store.py  a fresh store per round for torchrun-style scripts
    store_server.py the stores the agent serves: torch's TCPStore protocol, in Python (no torch)
    store_wire.py   that protocol's bytes; store_table.py  what a store holds and answers
    addressing.py   which address and interface peers reach this host at
"""

from .agent import Agent
from .config import AgentConfig

__all__ = ["Agent", "AgentConfig"]

"""The in-worker runtime: everything a training process runs besides the user's code.

The recovery path (``recovery.py``, read it first); a round's ring as a value
(``ring.py``; what a state may ask of it: ``ring_view.py``; the world of one:
``local_ring.py``), the way into each round (``ring_entry.py``) and the process's session
(``session.py``); ring abort, the state sync (``sync_plan.py`` decides, ``state_transfer.py``
moves), the left-behind and publish checks, reset budgets and nudges, switch points,
joiners, the round's store, stragglers, step records and test fault points; what a
failure means (``failures.py``), why a joiner's collectives before ``@elastic.run`` cannot
run (``pre_train.py``) and how the worker tells its agent it ended (``exit_record.py``).

May import ``elastic.contract``, ``rendezvous`` and ``checkpoint``; never the agent,
the commands, or the user API above it (``elastic/__init__.py``, ``state.py``, ...),
which build on this room. The process's session is ``lifecycle.current()``, its ring
``lifecycle.ring()``.
"""

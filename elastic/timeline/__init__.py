"""What a job did, read from its events: a model (pure) and a picture of it.

    model.py  the events of every host -> a Timeline (lanes, failures, re-formations)
    draw.py   a Timeline -> a PNG (matplotlib, the ``timeline`` extra)
    summary.py  a Timeline -> what failures cost, and the agent's end-of-run block
    progress.py rank 0's step records -> how far a running job is (``elastic-run status``)

Not a command (``elastic-run timeline`` is ``elastic/cli/timeline.py``): the agent's
chaos report reads the same model. Imports nothing of ``elastic`` outside this room.
"""

from .model import PHASES, Failure, Lane, MemberChange, Reformation, Span, Timeline, WorkerReform, build

__all__ = ["PHASES", "Failure", "Lane", "MemberChange", "Reformation", "Span", "Timeline", "WorkerReform", "build"]

"""``elastic-run timeline LOG_DIR -o FILE.png``: a picture of what a job did.

    model.py  the events of every host -> a Timeline (pure: lanes, failures, re-formations)
    draw.py   a Timeline -> a PNG (matplotlib)
    cli.py    the command: find the events files, build, draw
"""

from .model import PHASES, Failure, Lane, MemberChange, Reformation, Span, Timeline, WorkerReform, build

__all__ = ["PHASES", "Failure", "Lane", "MemberChange", "Reformation", "Span", "Timeline", "WorkerReform", "build"]

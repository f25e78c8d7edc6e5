"""The keys of a round's store: the one namespace per round in the TCPStore that rank 0's agent serves.

Every round builds its process group on a fresh namespace, ``/round/<n>/``: re-using one
hangs (gloo's init keys of the old ring are still there). Inside it the workers count
their arrival, settle whether the round formed, and the process group keeps its own keys under ``pg/``. The agent prunes
old rounds' namespaces (``round_of``); torch's NCCL watchdog writes one key outside every
namespace (``DUMP_SIGNAL``).
"""

from __future__ import annotations

from typing import Optional

ARRIVED = "arrived"  # counter: workers of the round at its store
OUTCOME = "outcome"  # "formed" or "abandoned", settled once by compare-and-set
GROUP = "pg/"  # the process group's own keys (init_process_group's store prefix)
# A round that may form on shrunk NCCL communicators (worker/ring_shrink.py): each
# worker's "1" or "0", whether it holds one; and the keys of the group made anew when a
# shrunk one could not join the group after all (the failed build's gloo keys are in GROUP).
SHRUNK = "shrunk/"
GROUP_AFTER_SHRINK = "pg-fresh/"

# torch's NCCL watchdog writes this key into the job-wide store (the store below every
# prefix: ProcessGroupNCCL's globalStore_) on any timeout or asynchronous error, and
# never deletes it (torch 2.13, ProcessGroupNCCL.hpp kStoreDumpKey).
DUMP_SIGNAL = "exception_dump"


def prefix(round_number: int) -> str:
    """The namespace of round ``round_number``'s keys."""
    return f"/round/{round_number}/"


def round_of(key: str) -> Optional[int]:
    """The round whose namespace holds ``key`` (as the store lists it), or None."""
    parts = key.split("/", 3)
    if len(parts) > 2 and parts[1] == "round" and parts[2].isdigit():
        return int(parts[2])
    return None

"""What failures cost a run: the time each one lost, and the block the agent prints at the end.

Pure functions of a ``Timeline`` (model.py). A re-formation loses

* its band: from the failure (or the first worker's detection) until the last
  worker has synced, the ring training again (``Reformation.duration``), and
* for a failure, the steps done again: the commits reached before it was noticed
  beyond the commit the new ring resumed from, at the run's mean step time.

A planned switch (a join, a leave) loses its band only: nothing is rolled back.

A torchrun-style script (no elastic API, so no commits and no re-formations) recovers the
torchrun way: its agent restarts every worker, the script from the top. Such a failure is
recovered once the workers it had started before are started again (``restarts``); its
loss is the time until the last of them was started again, and the job's steps are not
counted (only commits are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .model import Failure, Reformation, Timeline

MAX_LISTED = 5  # re-formations listed one per line; the rest are counted

_VERBS = {"killed": "killed", "died": "died", "hung": "hung", "error": "failed", "network": "lost its network"}


@dataclass(frozen=True)
class Loss:
    at: float  # seconds since the run's first event
    kind: str  # "failure", "join", "leave", "switch"
    what: str  # who, in a few words
    recovery_s: float  # the failure until the ring trains again
    rerun_steps: int = 0
    rerun_s: float = 0.0
    restarted: bool = False  # torchrun-style: every worker restarted (recovery_s: until the last was)

    @property
    def total_s(self) -> float:
        return self.recovery_s + self.rerun_s


def step_seconds(timeline: Timeline) -> Optional[float]:
    """Mean time per commit over every worker's step spans (None: no steps)."""
    steps = sum(s.last - s.first + 1 for lane in timeline.lanes for s in lane.spans)
    seconds = sum(max(0.0, s.end - s.start) for lane in timeline.lanes for s in lane.spans)
    return seconds / steps if steps and seconds > 0 else None


def steps_done(timeline: Timeline) -> int:
    return max((s.last for lane in timeline.lanes for s in lane.spans), default=0)


def losses(timeline: Timeline) -> list[Loss]:
    """One ``Loss`` per re-formation, in time order."""
    per_step = step_seconds(timeline) or 0.0
    out = []
    for reform in timeline.reformations:
        if reform.failed:
            noticed = min(w.detected for w in reform.workers)
            reached, resumed = timeline.steps_before(noticed), reform.resumed_commit
            rerun = max(0, reached - resumed) if reached is not None and resumed is not None else 0
            out.append(Loss(reform.start, "failure", _who_failed(timeline, reform.cause), reform.duration,
                            rerun, rerun * per_step))
        else:
            kind, before = _switch_kind(timeline, reform)
            out.append(Loss(reform.start, kind, f"world {before} -> {reform.world_size}", reform.duration))
    for failure, restarted_s in restarts(timeline):
        out.append(Loss(failure.time, "failure", _who_failed(timeline, failure), restarted_s, restarted=True))
    return sorted(out, key=lambda loss: loss.at)


def restarts(timeline: Timeline) -> list[tuple[Failure, float]]:
    """The failures recovered the torchrun way, each with the seconds until the last worker
    it restarted was started again: no re-formation recovered it, and workers started
    before it were started again after it (the same worker ids, new processes)."""
    out = []
    failures = sorted((f for f in timeline.failures if timeline.recovery_of(f) is None), key=lambda f: f.time)
    for i, failure in enumerate(failures):
        until = failures[i + 1].time if i + 1 < len(failures) else float("inf")
        before = {lane.worker for lane in timeline.lanes if lane.started is not None and lane.started <= failure.time}
        again = [lane.started for lane in timeline.lanes if lane.worker in before and lane.started is not None
                 and failure.time < lane.started < until]
        if again:
            out.append((failure, max(again) - failure.time))
    return out


def failures_lost(timeline: Timeline) -> tuple[int, float, int]:
    """(failures, seconds they lost, steps re-run) so far: ``elastic-run status``'s figures."""
    failed = [loss for loss in losses(timeline) if loss.kind == "failure"]
    return (len(failed) + len(_unrecovered(timeline)), sum(loss.total_s for loss in failed),
            sum(loss.rerun_steps for loss in failed))


def summarize(timeline: Timeline, *, job_id: str = "", log_dir: Optional[str] = None) -> str:
    """The end-of-run block: steps and wall time, each failure and join with what it
    cost, where the timeline is."""
    runs = losses(timeline)
    failed = [loss for loss in runs if loss.kind == "failure"]
    unrecovered = _unrecovered(timeline)
    ending = timeline.outcome or "ended"
    worlds = [size for _, size in timeline.world] or [timeline.initial_world]
    world = f"world {worlds[0]}" + (f" -> {worlds[-1]}" if worlds[-1] != worlds[0] else "")
    # Not "elastic-run: job J failed: ...": that is the one line saying why a job failed.
    job = f"job {job_id} " if job_id else "job "
    # Steps are commits: a torchrun-style script makes none, and its steps are its own.
    committed = any(span for lane in timeline.lanes for span in lane.spans)
    steps = f" after {steps_done(timeline)} steps" if committed else ""
    lines = [f"elastic-run: summary: {job}{ending}{steps} in {duration(timeline.end)}, {world}"]
    counts = []
    if failed or unrecovered:
        n = len(failed) + len(unrecovered)
        counts.append(f"{n} failure{'s' * (n != 1)}")
    for kind in ("join", "leave", "switch"):
        n = sum(loss.kind == kind for loss in runs)
        if n:
            counts.append(f"{n} {kind}{'s' * (n != 1)}")
    if counts and runs:
        lost = sum(loss.total_s for loss in runs)
        share = f" ({100 * lost / timeline.end:.0f}% of the wall time)" if timeline.end > 0 else ""
        rerun = sum(loss.rerun_steps for loss in runs)
        lines.append(f"  {', '.join(counts)}: {duration(lost)} lost{share}"
                     + (f", {rerun} steps re-run" if rerun else ""))
    elif counts:
        lines.append(f"  {', '.join(counts)}")
    else:
        lines.append("  no failures, joins or leaves")
    for loss in runs[:MAX_LISTED]:
        again = (f"every worker restarted (torchrun-style) in {duration(loss.recovery_s)}" if loss.restarted
                 else f"{duration(loss.recovery_s)} to train again")
        text = f"    at {clock(loss.at)}  {loss.kind}: {loss.what}, {again}"
        if loss.rerun_steps:
            text += f" + {loss.rerun_steps} steps re-run ({duration(loss.rerun_s)})"
        lines.append(text)
    if len(runs) > MAX_LISTED:
        lines.append(f"    ... {len(runs) - MAX_LISTED} more (see the timeline)")
    for failure in unrecovered[:MAX_LISTED]:
        lines.append(f"    at {clock(failure.time)}  failure: {_who_failed(timeline, failure)}, not recovered")
    if log_dir:
        lines.append(f"  timeline: elastic-run timeline {log_dir} -o timeline.png")
    else:
        lines.append("  timeline: not kept (run with --log-dir to keep events.jsonl and draw it)")
    return "\n".join(lines)


def duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds:.2f} s"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds // 60:.0f} min {seconds % 60:02.0f} s"
    return f"{seconds / 3600:.1f} h"


def clock(seconds: float) -> str:
    """Seconds since the start as m:ss (h:mm:ss past an hour)."""
    whole = int(max(0.0, seconds))
    h, rest = divmod(whole, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def _unrecovered(timeline: Timeline) -> list[Failure]:
    restarted = {id(failure) for failure, _ in restarts(timeline)}
    return [f for f in timeline.failures if timeline.recovery_of(f) is None and id(f) not in restarted]


def _who_failed(timeline: Timeline, failure: Optional[Failure]) -> str:
    if failure is None:
        return "the ring broke (a failure on another host)"
    lane = next((lane for lane in timeline.lanes if lane.worker == failure.worker), None)
    who = f"rank {lane.ranks[-1]}" if lane is not None and lane.ranks else (failure.worker or "a worker")
    return f"{who} {_VERBS.get(failure.kind, failure.kind)}"


def _switch_kind(timeline: Timeline, reform: Reformation) -> tuple[str, int]:
    """A planned switch grew the world (a join), shrank it (a leave), or neither; and the world before."""
    before = [size for t, size in timeline.world if t < reform.end]
    if not before or reform.world_size == before[-1]:
        return "switch", before[-1] if before else reform.world_size
    return ("join" if reform.world_size > before[-1] else "leave"), before[-1]

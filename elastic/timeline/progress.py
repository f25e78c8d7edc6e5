"""How far a running job has got: the record ``elastic-run status`` shows, and how it is computed.

The agent whose worker is rank 0 reads that worker's ``steps`` events (one per
second at most: ``elastic/worker/step_log.py``), computes a ``JobProgress`` with
``progress_of`` and publishes it in etcd every few seconds
(``elastic/agent/run_watch.py``). Nothing of it costs a step anything.

* rate: commits per second over the recent spans of the current round (a
  re-formation starts the window again);
* samples per second: the sampler's processed count over the same spans, else the
  rate times ``samples_per_step`` (``elastic.report``);
* time left: ``total_steps`` (``elastic.report``) at that rate; without it, the
  end of the sampler's epoch at its samples per second.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Optional, Sequence

from .summary import duration

WINDOW_S = 30.0  # seconds of recent spans the rates are taken over


@dataclass(frozen=True)
class JobProgress:
    step: int  # the newest commit number
    at: float  # its wall time
    world_size: int = 0
    steps_per_s: Optional[float] = None
    samples_per_s: Optional[float] = None
    total_steps: Optional[int] = None
    epoch: Optional[int] = None
    samples: Optional[int] = None  # processed this epoch (ElasticSampler)
    epoch_samples: Optional[int] = None
    failures: int = 0
    lost_s: float = 0.0  # time failures lost so far (recovery and steps re-run)
    rerun_steps: int = 0

    def eta_s(self) -> Optional[float]:
        """Seconds to ``total_steps``; None when unknown."""
        if self.total_steps is None or not self.steps_per_s:
            return None
        return max(0, self.total_steps - self.step) / self.steps_per_s

    def epoch_eta_s(self) -> Optional[float]:
        if self.samples is None or not self.epoch_samples or not self.samples_per_s:
            return None
        return max(0, self.epoch_samples - self.samples) / self.samples_per_s

    def to_json(self) -> bytes:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "JobProgress":
        """ValueError when ``raw`` is no progress record."""
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, ValueError):
            raise ValueError("not JSON") from None
        if not isinstance(data, dict) or not isinstance(data.get("step"), int) or \
                not isinstance(data.get("at"), (int, float)):
            raise ValueError("no step")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for k, v in values.items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"bad {k}")
        return cls(**values)

    def lines(self, now: float) -> list[str]:
        """``elastic-run status``'s progress lines."""
        step = f"step {self.step}"
        if self.total_steps:
            step += f" of {self.total_steps} ({100 * min(self.step, self.total_steps) / self.total_steps:.0f}%)"
        age = max(0.0, now - self.at)
        rates = []
        if self.steps_per_s:
            rates.append(f"{self.steps_per_s:.3g} steps/s")
        if self.samples_per_s:
            rates.append(f"{self.samples_per_s:.4g} samples/s")
        head = f"progress: {step}" + (f", {', '.join(rates)}" if rates else "") + \
            f"; last commit {duration(age)} ago"
        out = [head]
        eta, epoch_eta = self.eta_s(), self.epoch_eta_s()
        if eta is not None:
            out.append(f"time left: about {duration(eta)} at this rate")
        elif epoch_eta is not None:
            out.append(f"time left in epoch {self.epoch}: about {duration(epoch_eta)} "
                       f"({self.samples} of {self.epoch_samples} samples)")
        lost = f"lost to failures: {duration(self.lost_s)}" if self.failures else "lost to failures: none so far"
        if self.failures:
            lost += f" ({self.failures} failure{'s' * (self.failures != 1)}" + \
                (f", {self.rerun_steps} steps re-run)" if self.rerun_steps else ")")
        out.append(lost)
        return out


def progress_of(spans: Sequence[dict], *, failures: int = 0, lost_s: float = 0.0,
                rerun_steps: int = 0) -> Optional[JobProgress]:
    """From one worker's ``steps`` events, oldest first; None before the first."""
    if not spans:
        return None
    last = spans[-1]
    current = [s for s in spans if s.get("round") == last.get("round") and s["end"] >= last["end"] - WINDOW_S]
    steps = sum(s["last"] - s["first"] + 1 for s in current)
    seconds = sum(max(0.0, s["end"] - s["start"]) for s in current)
    steps_per_s = steps / seconds if steps and seconds > 0 else None
    samples_per_s = _samples_per_s(current)
    if samples_per_s is None and steps_per_s and last.get("samples_per_step"):
        samples_per_s = steps_per_s * last["samples_per_step"]
    return JobProgress(
        step=int(last["last"]), at=float(last["end"]), world_size=int(last.get("world_size") or 0),
        steps_per_s=steps_per_s, samples_per_s=samples_per_s, total_steps=last.get("total_steps"),
        epoch=last.get("epoch"), samples=last.get("samples"), epoch_samples=last.get("epoch_samples"),
        failures=failures, lost_s=lost_s, rerun_steps=rerun_steps,
    )


def _samples_per_s(spans: Sequence[dict]) -> Optional[float]:
    """The sampler's processed count between the first and the last span of one epoch."""
    counted = [s for s in spans if isinstance(s.get("samples"), int)]
    if len(counted) < 2:
        return None
    first, last = counted[0], counted[-1]
    if first.get("epoch") != last.get("epoch") or last["samples"] < first["samples"] or last["end"] <= first["end"]:
        return None
    return (last["samples"] - first["samples"]) / (last["end"] - first["end"])

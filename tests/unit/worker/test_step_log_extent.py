"""Step records carry how long the run is (elastic.report) and the sampler's counts, read per record."""

from __future__ import annotations

import pytest

import elastic
from elastic.worker import step_log
from elastic.worker.step_log import StepLog


class _Events:
    def __init__(self):
        self.emitted = []

    def emit(self, event, **fields):
        self.emitted.append((event, fields))


class _Sampler:
    processed_count, length, epoch = 96, 240, 1


@pytest.fixture(autouse=True)
def _no_report(monkeypatch):
    monkeypatch.setattr(step_log, "_reported", {})


def test_a_record_carries_the_reported_total_and_the_samplers_counts():
    events = _Events()
    log = StepLog(events, "h.w0")
    elastic.report(total_steps=500, samples_per_step=32)
    log.sampler = _Sampler()
    log.commit(1, 2)
    log.close()
    [(kind, fields)] = events.emitted
    assert kind == "steps" and fields["first"] == fields["last"] == 1
    assert (fields["total_steps"], fields["samples_per_step"]) == (500, 32)
    assert (fields["samples"], fields["epoch_samples"], fields["epoch"]) == (96, 240, 1)


def test_without_a_report_or_a_sampler_the_record_is_as_before():
    events = _Events()
    log = StepLog(events, "h.w0")
    log.sampler = object()  # not an ElasticSampler
    log.commit(1, 1)
    log.close()
    assert set(events.emitted[0][1]) == {"worker", "first", "last", "start", "end", "world_size"}


@pytest.mark.parametrize("kwargs", [{"total_steps": 0}, {"total_steps": 1.5}, {"samples_per_step": True},
                                    {"samples_per_step": -3}])
def test_report_refuses_what_is_no_positive_integer(kwargs):
    with pytest.raises(ValueError, match="elastic.report: "):
        elastic.report(**kwargs)

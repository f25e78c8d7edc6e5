"""A world-of-one runtime to commit through (no ring, no agent), as tests/unit/api's."""

import types

import pytest

from elastic.worker import lifecycle
from elastic.worker.commit_gate import commit_alone


@pytest.fixture
def runtime():
    stand_in = types.SimpleNamespace(round=1, rank=0, world_size=1, config=None, backend="gloo",
                                     commit=lambda capture: commit_alone(capture, 1),
                                     events=types.SimpleNamespace(emit=lambda *a, **k: None),
                                     steps=types.SimpleNamespace(sampler=None))
    lifecycle.install(stand_in)
    yield stand_in
    lifecycle.install(None)

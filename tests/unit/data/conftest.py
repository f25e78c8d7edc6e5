"""The ring the data tests commit on: a world of one (no agent), as tests/unit/api's."""

import pytest

from tests.fakes.ring import FakeRing, installed


@pytest.fixture
def ring():
    with installed(FakeRing(round=1)) as fake:
        yield fake

"""The ring the state tests commit and sync on: a world of one (no agent), as a test's ``FakeRing``."""

import pytest

from tests.fakes.ring import FakeRing, installed


@pytest.fixture
def ring():
    with installed(FakeRing(round=1)) as fake:
        yield fake

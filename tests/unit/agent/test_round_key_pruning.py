"""The agent's pruning of old rounds' keys reads round numbers from keys that anyone who
reaches the store can write (security review 2, H2): a 5,000-digit one made ``int()``
raise past Python's 4,300-digit limit and ended the agent at the next round."""

from __future__ import annotations

import pytest

from elastic.agent.plain_store import prune_round_keys, round_number


@pytest.mark.parametrize("text, expected", [
    ("0", 0), ("17", 17), ("000000000042", 42), ("9" * 12, 10 ** 12 - 1),
    ("9" * 13, None), ("9" * 5000, None), ("", None), ("-1", None), ("+1", None), (" 1", None), ("1 ", None),
    ("١٢", None),  # Arabic-Indic digits: str.isdigit() says yes, the runtime never writes them
    ("1e3", None), ("0x10", None),
])
def test_round_number(text, expected):
    assert round_number(text) == expected


class FakeStore:
    def __init__(self, keys, fail_on=None):
        self.keys, self.fail_on = list(keys), fail_on

    def list_keys(self):
        return list(self.keys)

    def delete_key(self, key):
        if key == self.fail_on:
            raise RuntimeError("the store went away")
        self.keys.remove(key)
        return True


def test_pruning_skips_keys_that_name_no_round_and_never_raises(caplog):
    planted = "/round/" + "9" * 5000 + "/x"
    store = FakeStore(["/round/1/pg/rank_0", "/round/7/switch_at", "/round/8/a", planted, "/round/١/x", "/job"])
    prune_round_keys(store, 8)
    assert store.keys == ["/round/7/switch_at", "/round/8/a", planted, "/round/١/x", "/job"]
    failing = FakeStore(["/round/1/a"], fail_on="/round/1/a")
    prune_round_keys(failing, 9)  # housekeeping: logged, the agent goes on
    assert "pruning the round store failed (RuntimeError: the store went away)" in caplog.text

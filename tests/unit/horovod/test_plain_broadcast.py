"""hvd.broadcast_optimizer_state takes the root's layout as checked plain data, not a pickle."""

import pytest
import torch

from elastic.contract.errors import PeerDataInvalid
from elastic.horovod.functions import _checked_layout
from elastic.worker import wire


def _round_trip(layout):
    return wire.loads(wire.dumps(layout, tensors=True), "test", limit=1 << 20, tensors=True)


def test_an_optimizers_layout_travels_and_passes():
    layout = ([{"lr": 0.1, "betas": (0.9, 0.999), "foreach": None, "weight_decay": torch.tensor(0.01)}],
              [[("step", "tensor", (), "torch.float32"), ("exp_avg", "tensor", (3, 2), "torch.float32")],
               [("count", "value", 4)]])
    options, states = _checked_layout(_round_trip(layout))
    assert states == layout[1] and options[0]["betas"] == (0.9, 0.999)


@pytest.mark.parametrize("layout", [
    [[], []],  # a list where the tuple belongs
    ([1], []),
    ([], [[("exp_avg", "tensor", (-1,), "torch.float32")]]),
    ([], [[("exp_avg", "tensor", "3", "torch.float32")]]),
    ([], [[("x", "code", "print")]]),
])
def test_a_malformed_layout_is_refused(layout):
    with pytest.raises(PeerDataInvalid):
        _checked_layout(_round_trip(layout))

"""A reset request is one bounded try (control.request_reset): its callers post it again
when refused, and a worker waiting for its next round must not sit in a put for the whole
call timeout while etcd re-elects its leader."""

from elastic.rendezvous.control import REQUEST_DEADLINE_S, ControlChannel
from elastic.rendezvous.keys import JobKeys
from tests.fakes.kv import MemoryKv


class _Recording(MemoryKv):
    def __init__(self):
        super().__init__()
        self.deadlines = []

    def put(self, key, value, lease=None, **kwargs):
        self.deadlines.append(kwargs.get("retry_deadline"))
        return super().put(key, value, lease)


def test_a_reset_request_is_tried_for_a_second_at_most():
    kv = _Recording()
    try:
        ControlChannel(kv, JobKeys("unit")).request_reset("w0", 3, "gloo: connection reset")
        assert kv.deadlines == [REQUEST_DEADLINE_S] and REQUEST_DEADLINE_S <= 1.0
        assert kv.get(JobKeys("unit").request("w0")) is not None
    finally:
        kv.close()

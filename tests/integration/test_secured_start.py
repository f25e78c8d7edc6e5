"""A job secured by its secret says nothing at start about an etcd with auth disabled:
the job's own etcd is health-checked without the job's user until auth is on (it printed
"etcd at ... has auth disabled; ignoring the configured user" as a secured job's first line)."""

from __future__ import annotations

import logging

from elastic.rendezvous import EmbeddedEtcd
from elastic.rendezvous.job_secret import JobSecret, new_secret

from ..conftest import etcd_binary_or_skip


def test_a_secured_etcd_starts_without_an_auth_disabled_line(caplog):
    with caplog.at_level(logging.DEBUG):
        server = EmbeddedEtcd(binary=etcd_binary_or_skip(), security=JobSecret(new_secret())).start()
        server.stop()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert not [line for line in said if "auth disabled" in line], said

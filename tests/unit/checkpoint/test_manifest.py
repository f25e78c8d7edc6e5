"""Manifest: names, parsing, checksum verification, policy validation."""
import hashlib
import json
import re

import pytest

from elastic.checkpoint import CheckpointPolicy
from elastic.checkpoint import manifest as mf


def test_step_dirnames_round_trip_and_reject_other_names():
    assert mf.step_dirname(123) == "step-000000123"
    assert mf.parse_step_dirname("step-000000123") == 123
    for name in (".tmp-step-000000123-ab12", "step-12a", "step-", "state.pt", "step-000000001-replaced",
                 "step-000000001.", "step-000000001.x", ".tmp-step-000000001-ab@host:12"):
        assert mf.parse_step_dirname(name) is None
        assert mf.parse_checkpoint_dirname(name) is None
    assert mf.checkpoint_dirname(123) == "step-000000123"
    assert mf.checkpoint_dirname(123, 2) == "step-000000123.2"
    assert mf.parse_checkpoint_dirname("step-000000123.2") == (123, 2)
    assert mf.parse_checkpoint_dirname("step-000000123") == (123, 0)
    assert mf.parse_step_dirname("step-000000123.2") == 123


def _write_checkpoint(tmp_path, payload=b"hello tensors"):
    (tmp_path / mf.STATE_NAME).write_bytes(payload)
    files = {mf.STATE_NAME: {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}}
    manifest = mf.build_manifest(step=5, files=files, created=1.0e9, epoch=1, round=2, world_size=4, meta={"k": "v"})
    mf.write_manifest(str(tmp_path), manifest)
    return manifest


def test_written_manifest_reads_back_and_verifies(tmp_path):
    manifest = _write_checkpoint(tmp_path)
    assert mf.read_manifest(str(tmp_path)) == manifest
    assert manifest["format"] == 1 and manifest["world_size"] == 4 and manifest["meta"] == {"k": "v"}
    assert mf.verify_files(str(tmp_path), manifest) is None
    assert mf.file_digest(str(tmp_path / mf.STATE_NAME)) == (13, hashlib.sha256(b"hello tensors").hexdigest())


def test_flipped_byte_truncation_and_missing_file_are_reported(tmp_path):
    manifest = _write_checkpoint(tmp_path)
    state = tmp_path / mf.STATE_NAME
    state.write_bytes(b"hello tensorz")
    assert "sha256 mismatch" in mf.verify_files(str(tmp_path), manifest)
    state.write_bytes(b"hello")
    assert "5 bytes" in mf.verify_files(str(tmp_path), manifest)
    state.unlink()
    assert mf.verify_files(str(tmp_path), manifest) == f"missing {mf.STATE_NAME}"


@pytest.mark.parametrize(
    "content, reason",
    [
        (None, "missing manifest.json"),
        (b"{not json", "unparsable"),
        (b"\xff\xfe", "unparsable"),
        (b"[1, 2]", "not a JSON object"),
        (json.dumps({"format": 2, "step": 1}).encode(), "unsupported manifest format 2"),
        (json.dumps({"format": 1, "step": -1, "files": {}}).encode(), "bad step"),
        (json.dumps({"format": 1, "step": 1, "files": {}}).encode(), "does not list state.pt"),
        (json.dumps({"format": 1, "step": 1, "files": {"state.pt": {"size": "1"}}}).encode(), "bad entry"),
        (json.dumps({"format": 1, "step": 1, "files": {
            "state.pt": {"size": 1, "sha256": "x"}, "../x": {"size": 1, "sha256": "x"}}}).encode(), "bad file name"),
    ],
)
def test_bad_manifests_are_rejected_with_a_reason(tmp_path, content, reason):
    if content is not None:
        (tmp_path / mf.MANIFEST_NAME).write_bytes(content)
    with pytest.raises(mf.ManifestError, match=reason) as info:
        mf.read_manifest(str(tmp_path))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"keep": 0}, "keep must be an integer >= 1, got 0"),
        ({"keep": 2.5}, "got 2.5"),
        ({"every_commits": 0}, "every_commits must be a positive integer or None, got 0"),
        ({"every_commits": True}, "got True"),
        ({"every_seconds": -1.0}, "every_seconds must be a positive number or None, got -1.0"),
        ({"every_seconds": float("nan")}, "got nan"),
    ],
)
def test_policy_validation_names_the_value(tmp_path, kwargs, needle):
    with pytest.raises(ValueError, match=re.escape(needle)) as info:
        CheckpointPolicy(str(tmp_path), **kwargs)
    assert "\n" not in str(info.value)


def test_policy_rejects_urls_and_empty_paths():
    with pytest.raises(ValueError, match="only local paths"):
        CheckpointPolicy("s3://bucket/ckpt")
    with pytest.raises(ValueError, match="non-empty path"):
        CheckpointPolicy("")
    assert CheckpointPolicy("/ckpt", every_commits=10, every_seconds=60).keep == 3

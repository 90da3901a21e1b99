"""Writers never touch a user's OUT.tmp: temporaries are fresh names, removed on failure."""

import os

import pytest

from bapo_megatron.common.batch import RolloutBatch
from bapo_megatron.fsutil import atomic_directory, write_text_atomic
from tests.helpers import make_batch


def test_a_users_tmp_beside_the_target_survives(tmp_path):
    for name in ("out.tmp", "b.safetensors.tmp", "latest.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine").write_text("keep")
    with atomic_directory(tmp_path / "out") as tmp:
        (tmp / "f").write_text("x")
    make_batch(0).save(tmp_path / "b.safetensors")
    write_text_atomic(tmp_path / "latest", "step_00000001\n")
    assert (tmp_path / "out" / "f").read_text() == "x" and len(RolloutBatch.load(tmp_path / "b.safetensors")) == 16
    for name in ("out.tmp", "b.safetensors.tmp", "latest.tmp"):
        assert (tmp_path / name / "mine").read_text() == "keep"
    with pytest.raises(RuntimeError), atomic_directory(tmp_path / "failed") as tmp:
        raise RuntimeError("the write failed")
    assert not (tmp_path / "failed").exists() and not tmp.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "b.safetensors",
        "b.safetensors.tmp",
        "latest",
        "latest.tmp",
        "out",
        "out.tmp",
    ]
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask  # a plain mkdir's mode, not tempfile's

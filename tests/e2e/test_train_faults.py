"""`python -m bapo_megatron.train` on unusable input: one `error:` line naming the file and what is
wrong, exit 2, no traceback, and nothing on disk changed.

Replay batches (a NaN behaviour log-prob; a token id inside the padded embedding rows but past
the vocabulary, which used to train silently) are checked before any model is built; so is the
checkpoint to resume from (a truncated .distcp, a `latest` that is a symbolic link, with its
target's content never echoed), and a run that would start afresh over existing checkpoints.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import make_batch

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def _train(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "bapo_megatron.train", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def _snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(directory)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in directory.rglob("*")}


def _fails_with(proc: subprocess.CompletedProcess, *phrases: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for phrase in phrases:
        assert phrase in lines[-1], (phrase, lines[-1])


def _common(root: Path, replay: Path, ckpt: str) -> list[str]:
    return [
        f"rollout.replay={replay}",
        f"checkpoint.dir={root / ckpt}",
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "parallel.max_tokens_per_microbatch=64",
        "logging.backends=[jsonl]",
        f"logging.jsonl_path={root / 'log.jsonl'}",
    ]


def test_bad_replay_batches_fail_before_any_model(tmp_path):
    nan, outside = make_batch(0), make_batch(1)
    nan.samples[3].behaviour_logprobs[0] = math.nan
    outside.samples[5].response_ids[0] = 251  # vocabulary 250, embedding padded to 256
    nan.save(tmp_path / "nan.safetensors")
    outside.save(tmp_path / "outside.safetensors")
    _fails_with(
        _train(*_common(tmp_path, tmp_path / "nan.safetensors", "ckpt")),
        "nan.safetensors",
        "sample 3",
        "behaviour log-prob nan",
    )
    _fails_with(
        _train(*_common(tmp_path, tmp_path / "outside.safetensors", "ckpt")),
        "outside.safetensors",
        "token id 251 outside the model's vocabulary [0, 250)",
    )
    assert not (tmp_path / "ckpt").exists()


def test_unusable_checkpoints_and_fresh_starts_fail_before_any_model(tmp_path):
    (tmp_path / "replay").mkdir()
    make_batch(0).save(tmp_path / "replay" / "b0.safetensors")
    args = _common(tmp_path, tmp_path / "replay", "ckpt")
    done = _train(*args, "steps=1")
    assert done.returncode == 0, done.stderr[-2000:]
    ckpt = tmp_path / "ckpt"
    step = ckpt / "step_00000001"
    assert (ckpt / "latest").read_text().strip() == step.name
    before = _snapshot(ckpt)
    _fails_with(
        _train(*args, "steps=2", "checkpoint.resume=false"),
        "checkpoint.resume=False",
        "holds checkpoints",
        "new directory",
    )
    assert _snapshot(ckpt) == before
    shard = sorted(step.glob("*.distcp"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    before = _snapshot(ckpt)
    _fails_with(_train(*args, "steps=2"), str(step), shard.name, "truncated")
    assert _snapshot(ckpt) == before
    # a pointer that is a link, in a directory with no complete checkpoint: its target is not echoed
    empty = tmp_path / "linked"
    empty.mkdir()
    (tmp_path / "secret").write_text("do-not-print-me")
    (empty / "latest").symlink_to(tmp_path / "secret")
    _fails_with(_train(*_common(tmp_path, tmp_path / "replay", "linked"), "steps=1"), "is a symbolic link")
    assert "do-not-print-me" not in _train(*_common(tmp_path, tmp_path / "replay", "linked"), "steps=1").stderr


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB file system (tmpfs; needs root, else the test is skipped)."""
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _convert(*argv: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), *argv, "--no-progress"]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_a_full_disk_is_one_error_line_and_leaves_nothing_partial(tmp_path, small_disk):
    """The trainer's checkpoint, hf-to-mcore's and mcore-to-hf's outputs on a disk too small for
    them: one error line naming the directory and the space needed, before anything is written."""
    from tests.helpers import make_hf_model

    replay = tmp_path / "batch.safetensors"
    make_batch(0).save(replay)
    proc = _train(*_common(tmp_path, replay, "small/ckpt"), "steps=1")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].startswith(f"error: no space for checkpoint {small_disk / 'ckpt' / 'step_00000001'}: it needs")
    assert "MiB free" in lines[-1]

    make_hf_model(tmp_path, "qwen2-gqa2")
    hf, mcore = str(tmp_path / "qwen2-gqa2"), str(tmp_path / "mcore")
    for argv, phrase in [
        (("hf-to-mcore", "--hf", hf, "--out", str(small_disk / "mcore")), f"checkpoint {small_disk / 'mcore'}"),
        (("mcore-to-hf", "--mcore", mcore, "--out", str(small_disk / "hf")), f"the HF model {small_disk / 'hf'}"),
    ]:
        if argv[0] == "mcore-to-hf":
            assert _convert("hf-to-mcore", "--hf", hf, "--out", mcore).returncode == 0
        out = _convert(*argv)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert out.stderr.strip().splitlines()[-1].startswith(f"error: no space for {phrase}: it needs")
    left = [p for p in small_disk.rglob("*") if not p.is_dir()]
    assert left == [], f"something partial was left: {left}"

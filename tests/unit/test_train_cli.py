"""The driver rejects bad input before any process group starts (and before importing Megatron)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bapo_megatron.config import load_config
from bapo_megatron.errors import ConfigError
from bapo_megatron.models.spec import tiny_spec
from bapo_megatron.preflight import validate
from bapo_megatron.sources import ReplaySource
from bapo_megatron.train import split_groups
from tests.helpers import make_batch

ROOT = Path(__file__).resolve().parents[2]


def _cfg(*overrides):
    return load_config(None, ["rollout.replay=x.safetensors", *overrides])


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (["parallel.tensor=4"], 4, "parallel.tensor=4: must divide the 2 query groups"),
        (["parallel.tensor=3"], 3, "parallel.tensor=3: must divide the 4 attention heads"),
        (["parallel.pipeline=3"], 3, "parallel.pipeline=3: pipeline x virtual stages (3) must divide the 4 layers"),
        (["parallel.tensor=2"], 3, "does not divide the world size 3"),
        (
            ["rollout.prompts_per_step=3", "rollout.samples_per_prompt=3"],
            2,
            "9 samples per optimizer step do not split over 2 data-parallel ranks",
        ),
        (["model.precision=fp8", "model.transformer_impl=transformer_engine"], 1, "model.transformer_impl"),
        (
            [
                "parallel.pipeline=2",
                "parallel.virtual_pipeline=2",
                "rollout.prompts_per_step=2",
                "rollout.samples_per_prompt=2",
                "algo.updates_per_batch=2",
            ],
            4,
            "1 samples per data-parallel rank and optimizer step cannot fill the interleaved schedule's groups of 2",
        ),
    ],
)
def test_validate_names_the_problem(overrides, world, message):
    with pytest.raises(ConfigError) as err:
        validate(_cfg(*overrides), tiny_spec(), world)
    assert message in str(err.value)


def test_cli_fails_fast_with_the_message(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bapo_megatron.train", "parallel.tensor=3", f"rollout.replay={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip() == "error: parallel.tensor=3: must divide the 4 attention heads"


def _replay(path, *overrides):
    return ReplaySource(_cfg(f"rollout.replay={path}", *overrides), tiny_spec())


def test_replay_source_and_group_split(tmp_path):
    with pytest.raises(ConfigError, match="no rollout batch"):
        _replay(tmp_path)
    for i in range(2):
        make_batch(i).save(tmp_path / f"b{i}.safetensors")
    source = _replay(tmp_path)
    first, _ = source.next_batch(0)
    source.next_batch(1)
    assert source.next_batch(2)[0].samples[0].response_ids == first.samples[0].response_ids  # cycles
    restored = _replay(tmp_path)
    restored.load_state_dict(source.state_dict())
    assert restored.index == 3
    parts = split_groups(first, 2)
    assert [len(p) for p in parts] == [8, 8]
    assert {s.group for s in parts[0].samples} == {0, 1} and {s.group for s in parts[1].samples} == {2, 3}
    with pytest.raises(ValueError, match="4 groups, not divisible into 3"):
        split_groups(first, 3)


def _rewritten(src, dst, change_tensors=None, change_meta=None):
    """A copy of a saved batch with some tensors or metadata changed (as another tool might write it)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    (change_tensors or (lambda t: None))(tensors)
    (change_meta or (lambda m: None))(meta)
    save_file(tensors, str(dst), metadata=meta)
    return dst


@pytest.mark.parametrize(
    ("case", "overrides", "message"),
    [
        ("float ids", (), "response_ids has dtype torch.float32; it must hold integers"),
        ("no temperature", (), "no sampling temperature in its metadata"),
        ("unequal groups", (), "its groups have [3, 4] samples: every group needs the same number"),
        (
            "updates",
            ("rollout.prompts_per_step=6", "algo.updates_per_batch=3"),
            "4 groups do not split into algo.updates_per_batch=3 updates",
        ),
        ("micro-batch", ("parallel.max_tokens_per_microbatch=8",), "exceeds parallel.max_tokens_per_microbatch=8"),
    ],
)
def test_a_replay_batch_the_job_cannot_train_is_refused_before_any_model(tmp_path, case, overrides, message):
    from bapo_megatron.errors import BadInputError

    good = tmp_path / "good.safetensors"
    make_batch(0).save(good)
    bad = tmp_path / "bad" / "b.safetensors"
    bad.parent.mkdir()
    if case == "float ids":
        _rewritten(good, bad, lambda t: t.update(response_ids=t["response_ids"].float() + 0.5))
    elif case == "no temperature":
        _rewritten(good, bad, change_meta=lambda m: m.pop("temperature"))
    elif case == "unequal groups":
        batch = make_batch(0)
        batch.samples = batch.samples[1:]
        batch.save(bad)
    else:
        bad = good
    with pytest.raises(BadInputError, match=re.escape(message)):
        _replay(bad, *overrides)


def test_a_checkpoint_dir_that_cannot_hold_checkpoints_is_refused_before_any_model(tmp_path):
    from bapo_megatron.config import CheckpointConfig
    from bapo_megatron.errors import BadInputError
    from bapo_megatron.trainer.checkpoint import CheckpointManager

    (tmp_path / "a_file").write_text("x")
    for where, message in [("a_file", "is a file, not a directory"), ("a_file/sub", "lies under .*a_file, which is")]:
        with pytest.raises(ConfigError, match=f"checkpoint.dir=.*{message}"):
            CheckpointManager(CheckpointConfig(dir=str(tmp_path / where))).check_start(resume=True)
    (tmp_path / "run" / "latest").mkdir(parents=True)
    with pytest.raises(BadInputError, match="checkpoint pointer .*latest is a directory"):
        CheckpointManager(CheckpointConfig(dir=str(tmp_path / "run"))).check_start(resume=True)

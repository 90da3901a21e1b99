"""The driver rejects bad input before any process group starts (and before importing Megatron)."""

import subprocess
import sys
from pathlib import Path

import pytest

from bapo_megatron.common.model_spec import tiny_spec
from bapo_megatron.config import load_config
from bapo_megatron.errors import ConfigError
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


def test_replay_source_and_group_split(tmp_path):
    with pytest.raises(ConfigError, match="no rollout batch"):
        ReplaySource(str(tmp_path), 250)
    for i in range(2):
        make_batch(i).save(tmp_path / f"b{i}.safetensors")
    source = ReplaySource(str(tmp_path), 250)
    first, _ = source.next_batch(0)
    source.next_batch(1)
    assert source.next_batch(2)[0].samples[0].response_ids == first.samples[0].response_ids  # cycles
    restored = ReplaySource(str(tmp_path), 250)
    restored.load_state_dict(source.state_dict())
    assert restored.index == 3
    parts = split_groups(first, 2)
    assert [len(p) for p in parts] == [8, 8]
    assert {s.group for s in parts[0].samples} == {0, 1} and {s.group for s in parts[1].samples} == {2, 3}
    with pytest.raises(ValueError, match="4 groups, not divisible into 3"):
        split_groups(first, 3)

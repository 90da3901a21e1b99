"""checkpoint.dir naming one step's directory (verl's trainer.resume_from_path habit) is refused by
the run and the dry run alike, before anything loads: else the run starts over inside it."""

import argparse

import pytest

from bapo_megatron.cli.dry_run import dry_run_command
from bapo_megatron.config import CheckpointConfig, load_config
from bapo_megatron.errors import ConfigError
from bapo_megatron.trainer.checkpoint import CheckpointManager


@pytest.fixture
def step_dir(tmp_path):
    """A run's checkpoint.dir with one complete step (a dist checkpoint: metadata.json) and `latest`."""
    step = tmp_path / "ckpt" / "step_00000006"
    step.mkdir(parents=True)
    (step / "metadata.json").write_text("{}")
    (tmp_path / "ckpt" / "latest").write_text("step_00000006\n")
    return step


def _says_what_to_do(err, step):
    text = str(err.value)
    assert text.startswith(f"checkpoint.dir={str(step)!r}: is one step's checkpoint directory")
    assert f"point checkpoint.dir at its parent {step.parent}" in text
    assert f"model.mcore_path={step}" in text


@pytest.mark.parametrize("resume", [True, False])
def test_the_run_refuses_a_step_directory(step_dir, resume):
    with pytest.raises(ConfigError) as err:
        CheckpointManager(CheckpointConfig(dir=str(step_dir))).check_start(resume=resume)
    _says_what_to_do(err, step_dir)
    assert list(step_dir.iterdir()) == [step_dir / "metadata.json"]  # nothing written there


def test_the_dry_run_refuses_it_too(step_dir):
    cfg = load_config(None, ["rollout.replay=x.safetensors", f"checkpoint.dir={step_dir}", "checkpoint.resume=true"])
    args = argparse.Namespace(config=None, world_size=1, gpus_per_node=8, gpu_memory_gib=80)
    with pytest.raises(ConfigError) as err:
        dry_run_command(args, cfg)
    _says_what_to_do(err, step_dir)


def test_its_parent_resumes(step_dir):
    manager = CheckpointManager(CheckpointConfig(dir=str(step_dir.parent)))
    manager.check_start(resume=True)
    assert manager.latest() == step_dir

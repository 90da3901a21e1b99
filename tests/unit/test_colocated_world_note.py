"""The dry run's first note, for a preset its Slurm script runs: colocated engines (COLOCATE=1) use
no rollout nodes, so the note does not count the script's."""

import argparse
from pathlib import Path

import pytest

from bapo_megatron.cli.dry_run import planned_world
from bapo_megatron.cli.slurm import find_slurm_plan
from bapo_megatron.config import load_config

PRESET = "examples/qwen3-8b/config.yaml"  # slurm/bapo_qwen3_8b.sh: 1 trainer node, 1 rollout node


@pytest.mark.parametrize("colocate", [False, True])
def test_the_note_says_where_the_engines_go(colocate, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("BAPO_HOME", raising=False)
    script = find_slurm_plan(Path(PRESET)).plan
    assert script is not None and script.rollout_nodes > 0
    overrides = ["rollout.mode=sync", "rollout.engines.colocate=true"] if colocate else []
    args = argparse.Namespace(config=PRESET, world_size=None)
    (note,) = planned_world(args, load_config(PRESET, overrides)).notes
    nodes = f"{script.train_nodes} trainer node(s) x {script.gpus_per_node} GPUs"
    if colocate:
        assert note.endswith(f"{nodes}, engines colocated on the {script.train_nodes} trainer node(s), no rollout node")
        assert "rollout node(s)" not in note
    else:
        assert note.endswith(f"{nodes}, {script.rollout_nodes} rollout node(s)")

"""A config mistake under torchrun is said once, not once a rank (cli/rank_errors.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

from bapo_megatron.cli.rank_errors import says_it

ROOT = Path(__file__).resolve().parents[2]


def test_a_config_error_under_torchrun_is_said_once(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "bapo_megatron.train", str(ROOT / "examples" / "tiny_verl.yaml")]
    command += ["logging.backends=[console,tensorbord]", f"run_dir={tmp_path / 'run'}"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    both = done.stdout + done.stderr
    assert done.returncode != 0
    assert both.count("error: logging.backends[1]='tensorbord'") == 1, both
    assert not (tmp_path / "run").exists()  # refused before anything was made


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({}, True),  # one process
        ({"WORLD_SIZE": "8", "LOCAL_RANK": "0", "RANK": "8"}, True),  # torchrun, a second node's first rank
        ({"WORLD_SIZE": "8", "LOCAL_RANK": "3", "RANK": "3"}, False),
        ({"SLURM_STEP_NUM_TASKS": "16", "SLURM_LOCALID": "1"}, False),  # srun, before RANK is set from it
        ({"SLURM_STEP_NUM_TASKS": "16", "SLURM_LOCALID": "0"}, True),
        ({"WORLD_SIZE": "1", "LOCAL_RANK": "0"}, True),
    ],
)
def test_each_nodes_first_rank_says_an_error_every_rank_makes(monkeypatch, env, says):
    for name in ("WORLD_SIZE", "LOCAL_RANK", "RANK", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert says_it() is says

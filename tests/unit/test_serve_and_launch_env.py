"""bapo-serve (an engine of a job on a node of its own) and bapo-train's rendezvous under srun."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bapo_megatron.config import load_config
from bapo_megatron.serve import engine_server, wait_for_engines
from bapo_megatron.trainer.parallel import single_process_env

ROOT = Path(__file__).resolve().parents[2]


def test_engine_server_is_the_drivers_engine_at_port_plus_index(tmp_path):
    key = tmp_path / "key"
    key.write_text("k" * 32)
    os.chmod(key, 0o600)
    overrides = [
        f"model.hf_path={tmp_path}",
        "rollout.engines.servers=3",
        "rollout.engines.port=31000",
        "rollout.engines.host=0.0.0.0",
    ]
    cfg = load_config(None, [*overrides, f"rollout.engines.admin_key_file={key}", "seed=7"])
    server = engine_server(cfg, 2, tmp_path / "engines")
    assert server.url == "http://0.0.0.0:31002"
    command = server.command
    assert command[1:3] == ["-m", "bapo_megatron.engines.embedded"]
    assert command[command.index("--port") + 1] == "31002" and command[command.index("--seed") + 1] == "9"
    assert server.env["BAPO_ADMIN_API_KEY"] == "k" * 32  # the job's shared key, never on the command line
    with pytest.raises(ValueError, match="--index 3: the job has rollout.engines.servers=3"):
        engine_server(cfg, 3, tmp_path)


def test_engine_server_refuses_what_cannot_be_served(tmp_path):
    with pytest.raises(ValueError, match="model.hf_path"):
        engine_server(load_config(None, []), 0, tmp_path)
    colocated = load_config(
        None, [f"model.hf_path={tmp_path}", "rollout.engines.colocate=true", "rollout.engines.kind=sglang"]
    )
    with pytest.raises(ValueError, match="colocated engines are started by the trainer"):
        engine_server(colocated, 0, tmp_path)
    beyond_loopback = load_config(None, [f"model.hf_path={tmp_path}", "rollout.engines.host=0.0.0.0"])
    server = engine_server(beyond_loopback, 0, tmp_path / "engines")  # no key given: one is made, 0600
    assert (tmp_path / "engines" / "admin_api_key").stat().st_mode & 0o077 == 0
    assert len(server.env["BAPO_ADMIN_API_KEY"]) >= 32


def test_wait_names_the_engines_that_never_answered(capsys):
    from bapo_megatron.engines.launcher import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert wait_for_engines((url,), timeout_s=0.2, poll_s=0.05) == 2
    assert f"no answer from {url}" in capsys.readouterr().err


def test_cli_errors_are_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "bapo_megatron.serve", "rollout.engines.servers=1", "--index", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.strip().startswith("error: ") and len(done.stderr.splitlines()) == 1


SLURM_TASK = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "16", "SLURM_LOCALID": "1"}


@pytest.fixture(autouse=True)
def private_environ(monkeypatch):
    """single_process_env writes os.environ itself: a copy, so that RANK=5 of 16 never reaches the
    processes later tests start."""
    monkeypatch.setattr(os, "environ", os.environ.copy())


def test_srun_tasks_map_to_ranks(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**SLURM_TASK, "MASTER_ADDR": "node001", "MASTER_PORT": "23456"}.items():
        monkeypatch.setenv(name, value)
    single_process_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("5", "16", "1")
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("node001", "23456")


def test_srun_tasks_know_how_many_trainer_ranks_share_their_node(monkeypatch):
    import torch

    from bapo_megatron.trainer.parallel import local_world_size, tasks_on_node

    assert [tasks_on_node("8(x2),4", node) for node in range(3)] == [8, 8, 4]
    assert tasks_on_node("2", 0) == 2
    with pytest.raises(ValueError, match="names 3 nodes"):
        tasks_on_node("8(x2),4", 3)
    with pytest.raises(ValueError, match="not Slurm's"):
        tasks_on_node("8x2", 0)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    task = {**SLURM_TASK, "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_NODEID": "0"}
    for name, value in {**task, "MASTER_ADDR": "node001", "MASTER_PORT": "23456"}.items():
        monkeypatch.setenv(name, value)
    single_process_env()
    assert local_world_size() == 8  # the driver places its SGLang servers beside them
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's, when it is there
    assert local_world_size() == 4
    for name in ("LOCAL_WORLD_SIZE", "SLURM_STEP_TASKS_PER_NODE"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("WORLD_SIZE", "16")  # another launcher: the world, at most this node's GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert local_world_size() == 8


def test_srun_tasks_without_a_rendezvous_are_refused(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in SLURM_TASK.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError, match="export MASTER_ADDR and MASTER_PORT in the job script"):
        single_process_env()


def test_torchrun_variables_win(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    for name, value in SLURM_TASK.items():
        monkeypatch.setenv(name, value)
    single_process_env()
    assert os.environ["RANK"] == "3" and os.environ["WORLD_SIZE"] == "4"

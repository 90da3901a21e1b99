"""examples/launch_nemo_run.py: the tiny job runs to the end through NeMo-Run's LocalExecutor, and
the Slurm and Docker executors' jobs are built (not submitted) and checked as NeMo-Run renders them."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bapo_megatron.engines.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "launch_nemo_run.py"


def _launch(tmp_path: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "4000", "NEMORUN_HOME": str(tmp_path / "nemo_run_home")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"  # NeMo-Run's `python`: this one
    command = [sys.executable, str(SCRIPT), "--job-dir", str(tmp_path / "jobs"), *args]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_local_executor_runs_the_tiny_job(tmp_path):
    run_dir = tmp_path / "run"
    done = _launch(
        tmp_path,
        "--executor=local",
        "steps=2",
        f"run_dir={run_dir}",
        f"checkpoint.dir={run_dir / 'ckpt'}",
        f"rollout.engines.port={free_port()}",
        "logging.progress=false",
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    steps = [json.loads(line).get("step") for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps if s is not None] == [1, 2]
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"


def _rendered(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return "\n".join(line.rstrip() for line in done.stdout.splitlines())


def test_slurm_executor_builds_the_sbatch_script(tmp_path):
    out = _rendered(
        _launch(
            tmp_path,
            "--executor=slurm",
            "--preset=qwen2.5-32b",
            "--nodes=4",
            "--account=acct",
            "--partition=h100",
            "--container-image=nvcr.io/example/bapo-megatron:0.1",
            "--mount=/data:/data",
            "--model-dir=/data/Qwen2.5-32B",
            "--data=/data/math.jsonl",
            "--dryrun",
        )
    )
    for directive in ("--nodes=4", "--ntasks-per-node=8", "--gpus-per-node=8", "--partition=h100", "--account=acct"):
        assert f"#SBATCH {directive}" in out, directive
    assert 'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"' in out
    srun = next(line for line in out.splitlines() if line.strip().startswith("srun") and "bapo_megatron" in line)
    assert "--container-image nvcr.io/example/bapo-megatron:0.1" in srun and "/data:/data" in srun
    command = srun[srun.index("python -m bapo_megatron.train") :].split()
    assert command[3:] == [
        "/opt/bapo-megatron/examples/qwen2.5-32b/config.yaml",
        "model.hf_path=/opt/bapo-megatron/examples/qwen2.5-32b/shape",  # the image's checkout
        "rollout.mode=sync",  # colocated: the engines wait while the trainer trains
        "rollout.engines.colocate=true",
        "rollout.engines.servers=2",  # 8 GPUs / the preset's engine TP 4
        "model.hf_path=/data/Qwen2.5-32B",  # the last word: the user's model
        "data.path=/data/math.jsonl",
    ]
    assert "torchrun" not in srun  # one srun task a GPU: Slurm's warning signal reaches bapo-train itself


def test_docker_executor_builds_the_container(tmp_path):
    out = _rendered(
        _launch(
            tmp_path,
            "--executor=docker",
            "--preset=qwen2.5-7b",
            "--container-image=bapo-megatron:0.1",
            "--mount=/data:/data",
            "--dryrun",
        )
    )
    command = re.search(r"command:\n((?:\s+- .*\n)+)", out + "\n").group(1)
    words = [line.strip()[2:].strip("'") for line in command.splitlines()]
    assert words[0] == "torchrun" and words[words.index("--nproc-per-node") + 1] == "8"
    assert words[words.index("-m") + 1 :] == [
        "bapo_megatron.train",
        "/opt/bapo-megatron/examples/qwen2.5-7b/config.yaml",
        "model.hf_path=/opt/bapo-megatron/examples/qwen2.5-7b/shape",
        "rollout.mode=sync",
        "rollout.engines.colocate=true",
        "rollout.engines.servers=4",  # 8 GPUs / the preset's engine TP 2
    ]
    for setting in ("container_image: bapo-megatron:0.1", "runtime: nvidia", "ipc_mode: host", "- /data:/data"):
        assert setting in out, setting

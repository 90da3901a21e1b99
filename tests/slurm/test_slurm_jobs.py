"""The job scripts under a real Slurm (tests/slurm/localslurm.py: Debian's slurm-wlm and munge,
installed here when missing; the test is skipped, saying why, only where they cannot be).

- slurm/bapo_tiny_cpu.sh gets the time-limit warning (USR1 to the batch shell, as
  #SBATCH --signal=B:USR1 sends it) after its first checkpoints: the trainer saves, the job
  requeues itself, the requeued run resumes from the checkpoint and runs to the end: every step
  in metrics.jsonl exactly once, the last checkpoint, status.json "finished", every command
  echoed, and a Hugging Face export that transformers loads.
- slurm/bapo_7b.sh, slurm/bapo_32b.sh and the Qwen3 ones pass bash -n, shellcheck and sbatch --test-only against
  fake 8-GPU H100 nodes; a request those nodes cannot meet is refused, so the check can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm.localslurm import LocalSlurm, install_packages

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
TINY = ["eval.max_prompts=20", "eval.interval=0", "rollout.prompts_per_step=8", "logging.progress=false"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = install_packages()
    if why is not None:
        pytest.skip(why)
    with LocalSlurm(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def _env(slurm: LocalSlurm, run_dir: Path, **extra: str) -> dict[str, str]:
    env = {**slurm.env, "PYTHON": sys.executable, "RUN_DIR": str(run_dir), "BAPO_HOME": str(ROOT), **extra}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


def _submit(slurm: LocalSlurm, script: str, env: dict[str, str], *args: str) -> int:
    Path(env["RUN_DIR"]).mkdir(parents=True, exist_ok=True)  # where Slurm opens the job's output
    done = subprocess.run(
        ["sbatch", "--parsable", f"--output={env['RUN_DIR']}/slurm-%j.out", str(ROOT / script), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().split(";")[0])


def _finished(fields: dict[str, str]) -> bool:
    return fields["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def _requeued(fields: dict[str, str]) -> bool:
    return int(fields.get("Restarts", "0")) >= 1


def _steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").is_file() else []
    return [int(r["step"]) for r in map(json.loads, lines) if "loss/pg" in r]


def _job_output(run_dir: Path, job: int) -> str:
    paths = [run_dir / f"slurm-{job}.out", *sorted((run_dir / "logs").glob("job-*/*.log"))]
    return "".join(f"--- {p.name}\n{p.read_text(errors='replace')}" for p in paths if p.is_file())


def test_time_limit_warning_saves_requeues_and_resumes(slurm, tmp_path):
    """The tiny CPU job under a real Slurm, to its HF export: Slurm's warning before the time limit
    (USR1 to the batch shell) saves the run at a checkpoint and requeues the job, which resumes and
    finishes; every command is echoed, and transformers loads the export. (One job covers what a
    plain run to the export and the requeue each checked before.)"""
    run_dir = tmp_path / "run"
    env = _env(slurm, run_dir, STEPS="6")
    job = _submit(slurm, "slurm/bapo_tiny_cpu.sh", env, *TINY)
    deadline = time.monotonic() + 600
    while len(_steps(run_dir)) < 2:  # two steps done and checkpointed (checkpoint.interval=1)
        assert time.monotonic() < deadline, _job_output(run_dir, job)[-3000:]
        assert slurm.job_state(job)["JobState"] in ("PENDING", "RUNNING"), slurm.job_state(job)
        time.sleep(1)
    # what #SBATCH --signal=B:USR1@60 does near the time limit: USR1 to the batch shell
    subprocess.run(["scancel", "--signal=USR1", "--batch", str(job)], env=slurm.env, check=True, timeout=60)
    requeued = slurm.wait_job(job, lambda f: _finished(f) or (_requeued(f) and f["JobState"] == "PENDING"), 600)
    if not _finished(requeued):
        # Slurm holds a requeued job back for two minutes (its begin time, a fixed delay); lifting
        # that, as an admin may, leaves the requeue and the resume as they are
        slurm.scontrol("update", f"JobId={job}", "StartTime=now")
    fields = slurm.wait_job(job, lambda f: _finished(f) and _requeued(f), timeout_s=900)
    output = _job_output(run_dir, job)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", output[-3000:]
    assert "the run stopped at a checkpoint (signal USR1): requeue job" in output
    assert "saved step" in output  # the trainer's own word that it checkpointed on the signal
    assert _steps(run_dir) == [1, 2, 3, 4, 5, 6]  # the resumed run went on from its checkpoint
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    assert (run_dir / "ckpt" / "latest").read_text().strip() == "step_00000006"
    assert "+ srun" in output and "bapo_megatron.train" in output  # every command echoed
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf")  # the job's last act: its HF export
    assert model.config.vocab_size == 16 and sum(p.numel() for p in model.parameters()) > 0


GPU_SCRIPTS = {  # script: nodes
    "slurm/bapo_7b.sh": 2,
    "slurm/bapo_32b.sh": 6,
    "slurm/bapo_qwen3_8b.sh": 2,
    "slurm/bapo_qwen3_30b_a3b.sh": 6,
}


@pytest.mark.parametrize("script", [*GPU_SCRIPTS, "slurm/bapo_tiny_cpu.sh"])
def test_scripts_pass_bash_n_and_shellcheck(script):
    subprocess.run(["bash", "-n", str(ROOT / script)], check=True, timeout=60)
    done = subprocess.run(["shellcheck", "-x", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    if done.returncode and "command not found" in done.stderr:
        pytest.skip("shellcheck is not installed")
    assert done.returncode == 0, done.stdout


@pytest.mark.parametrize(("script", "nodes"), GPU_SCRIPTS.items())
def test_gpu_scripts_fit_8_gpu_h100_nodes(slurm, tmp_path, script, nodes):
    env = _env(slurm, tmp_path, MODEL_DIR=str(tmp_path / "model"), DATA=str(tmp_path / "data.jsonl"))
    test_only = ["sbatch", "--test-only", "--partition=h100", str(ROOT / script)]
    done = subprocess.run(test_only, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"using {nodes * 128} processors on nodes h100-" in done.stderr  # whole 128-CPU nodes (--exclusive)
    # more nodes or GPUs than the partition has: refused, so the check above can fail
    for too_much in ("--nodes=9", "--gpus-per-node=9"):
        done = subprocess.run(
            [*test_only[:3], too_much, *test_only[3:]], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert done.returncode != 0 and "Requested node configuration is not available" in done.stderr, too_much


def test_the_daemons_are_ours_and_stop(tmp_path):
    """Everything LocalSlurm starts is stopped by PID (checked on a cluster of its own)."""
    why = install_packages()
    if why is not None:
        pytest.skip(why)
    cluster = LocalSlurm(tmp_path, fake_gpu_nodes=0)
    with cluster:
        pids = dict(cluster.pids)
        assert set(pids) == {"munged", "slurmctld", "slurmd"}
    for name, pid in pids.items():
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text(), name
    assert os.environ.get("SLURM_CONF") != str(cluster.conf)  # the client tools were pointed at it per call

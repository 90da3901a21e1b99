"""slurm/common.sh's bapo_gpu_job, under bash without Slurm (its srun steps stubbed): the prompts
come from DATA or from a data.path=... argument (the recipes' documented launch), and a job with
neither stops before any engine starts."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUBS = """
job_nodes() { printf 'n1\\nn2\\n'; }
shared_admin_key() { echo KEY; }
start_engines() { ENGINE_URLS='["http://n2:30000"]'; echo started >>"$OUT/engines"; }
run_trainer() { while [[ $1 != -- ]]; do shift; done; shift; printf '%s\\n' "$@" >"$OUT/trainer"; }
requeue_or_finish() { :; }
export_hf() { :; }
"""


def _job(tmp_path: Path, data: str | None, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    env = {"PATH": "/usr/bin:/bin", "BAPO_HOME": str(ROOT), "RUN_DIR": str(tmp_path / "run"), "OUT": str(tmp_path)}
    env |= {"SLURM_JOB_NAME": "t", "SLURM_CPUS_ON_NODE": "8", "MODEL_DIR": "/models/m"}
    if data is not None:
        env["DATA"] = data
    script = f'source "$BAPO_HOME/slurm/common.sh"\n{STUBS}\nCONFIG=c.yaml\nbapo_gpu_job 1 4 2 "$@"\n'
    done = subprocess.run(["bash", "-c", script, "job", *args], env=env, capture_output=True, text=True, timeout=60)
    return done, tmp_path / "trainer"


def test_data_path_as_an_argument_stands_for_data(tmp_path):
    done, trainer = _job(tmp_path, None, "data.path=/data/dapo.parquet", "eval.sets.aime24.path=/data/a.parquet")
    assert done.returncode == 0, done.stderr
    args = trainer.read_text().splitlines()
    assert [a for a in args if a.startswith("data.path=")] == ["data.path=/data/dapo.parquet"]
    assert "rollout.engines.urls=" + '["http://n2:30000"]' in args


def test_data_from_the_environment_and_neither(tmp_path):
    done, trainer = _job(tmp_path, "/data/math.jsonl")
    assert done.returncode == 0, done.stderr
    assert "data.path=/data/math.jsonl" in trainer.read_text().splitlines()
    trainer.unlink()
    (tmp_path / "engines").unlink()
    done, trainer = _job(tmp_path, None, "steps=3")
    assert done.returncode == 2 and "set DATA to the prompts" in done.stderr and "or pass data.path=" in done.stderr
    assert not trainer.exists() and not (tmp_path / "engines").exists()  # stopped before the engines

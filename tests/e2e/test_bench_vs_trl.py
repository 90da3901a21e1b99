"""benchmarks/bench_vs_trl.py runs and prints its tables (tiny arguments, CPU): the project's half and the
generation-only comparison always; TRL's half only where a Python with trl is named (BAPO_TRL_PYTHON)
or this one has it, since TRL is an optional benchmark extra, never a test dependency."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--prompts", "4", "--samples", "2", "--max-new", "6"]
TRL_PYTHON = os.environ.get("BAPO_TRL_PYTHON") or (sys.executable if importlib.util.find_spec("trl") else None)


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> Path:
    """A two-step warm start (the demo's phases 1-2), made once by the benchmark itself."""
    directory = tmp_path_factory.mktemp("bench_vs_trl") / "warm"
    _run("--warm", str(directory), "--sft-steps", "2", "--sft-target", "0", "--engine-only", "--repeats", "1", *SMALL)
    return directory


def _run(*args: str) -> list[str]:
    """The benchmark's output lines under its dashed rule."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_vs_trl.py"), *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert done.returncode == 0, f"bench_vs_trl.py failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    lines = done.stdout.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith("---"))
    assert "nan" not in done.stdout.lower(), done.stdout
    return [line for line in lines[rule + 1 :] if line.strip()]


def _cell(text: str) -> tuple[float, float, float]:
    """'median(low-high)' as three numbers, checked to be ordered."""
    median, bounds = text.rstrip(")").split("(")
    low, high = map(float, bounds.split("-"))
    assert low <= float(median) <= high, text
    return float(median), low, high


def test_generation_alone_compares_the_engine_with_generate(warm):
    rows = _run("--warm", str(warm), "--engine-only", "--repeats", "2", "--threads", "1", *SMALL)
    names = [row.rsplit(maxsplit=3)[0].strip() for row in rows]
    assert names == [
        "transformers generate",
        "engine core (in process)",
        "engine over HTTP, a call a group",
        "engine over HTTP, a call a sample",
    ]
    for row in rows:
        seconds, rate, ratio = row.rsplit(maxsplit=3)[1:]
        assert _cell(seconds)[0] > 0 and _cell(rate)[0] > 0 and ratio.endswith("x")
    assert rows[0].endswith("1.00x")


def test_project_half_reports_the_split_memory_and_accuracy(warm, tmp_path):
    args = ["--warm", str(warm), "--stacks", "project", "--pairs", "1", "--steps", "3", "--warmup", "1", *SMALL]
    rows = _run(*args, "--eval-prompts", "20", "--out", str(tmp_path))
    (stack, step, generate, reward, train, sync, tokens_per_s, rss, pss, accuracy), *rest = (r.split() for r in rows)
    assert stack == "project" and rest[0][0] == "held-out"  # then the warm start's accuracy
    assert _cell(step)[0] >= _cell(generate)[0] + _cell(train)[0] > 0  # the split is within the step
    assert _cell(reward)[0] >= 0 and _cell(sync)[0] >= 0 and _cell(tokens_per_s)[0] > 0
    assert 0.1 < _cell(rss)[0] < 64  # GiB: the trainer's, the engine's and the reward workers' together
    assert 0.05 < _cell(pss)[0] <= _cell(rss)[0]  # shared pages split among the processes, not counted in each
    assert 0 <= _cell(accuracy)[0] <= 1
    assert (tmp_path / "project-0" / "metrics.jsonl").exists()


@pytest.mark.skipif(TRL_PYTHON is None, reason="no Python with trl (set BAPO_TRL_PYTHON; pip install '.[bench]')")
def test_trl_half_runs_beside_the_project(warm, tmp_path):
    args = ["--warm", str(warm), "--pairs", "1", "--steps", "2", "--warmup", "1", "--eval-prompts", "0", *SMALL]
    rows = _run(*args, "--trl-python", TRL_PYTHON, "--out", str(tmp_path))
    assert [r.split()[0] for r in rows[:2]] == ["project", "trl"]
    assert rows[2].startswith("vs TRL: step ")

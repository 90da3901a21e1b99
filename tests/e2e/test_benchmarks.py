"""Every benchmark script runs and prints its table (small arguments, CPU): the GPU figures of
bench_train_step and the rollout comparison come from these same scripts, so they must not rot."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def _table(script: str, *args: str) -> list[list[str]]:
    """Run benchmarks/SCRIPT; the rows under its dashed rule, split on runs of spaces."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stderr[-3000:]}"
    lines = done.stdout.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith("---"))
    rows = [line.split() for line in lines[rule + 1 :] if line.strip() and not line.startswith(("vs ", "fp8 "))]
    assert rows, done.stdout
    assert "nan" not in done.stdout.lower(), done.stdout
    return rows


def test_bapo_search_benchmark():
    rows = _table("bench_bapo_search.py", "--tokens", "1e4", "3e4", "--repeats", "1")
    assert [r[0] for r in rows] == ["1e+04", "3e+04"] and all(r[4].endswith("x") for r in rows)


def test_train_step_benchmark():
    rows = _table(
        "bench_train_step.py", "--shape", "tiny", "--precision", "fp32", "--seq", "32", "--prompts", "2", "--steps", "1"
    )
    ((precision, tokens, seconds, per_s, tflops, mfu, memory),) = rows
    assert float(tflops) >= 0 and float(memory) > 0
    assert precision == "fp32" and int(tokens) == 2 * 4 * 32 and float(seconds) > 0 and float(per_s) > 0
    assert mfu == "-"  # no peak figure for a CPU


def test_rollout_benchmark():
    rows = _table(
        "bench_rollout.py",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--prompts",
        "2",
        "--samples",
        "2",
        "--max-new",
        "24",
        "--budget",
        "8",
        "--oversample",
        "2",
        "3",
    )
    full, *partial = rows
    assert full[0] == "full-length" and full[4] == "1.00x" and float(full[2]) > 0
    assert [r[:3] for r in partial] == [["partial,", "oversample", "2"], ["partial,", "oversample", "3"]]
    assert all(float(r[4]) > 0 and r[6].endswith("x") for r in partial)


def test_weights_benchmark(tmp_path):
    rows = _table("bench_weights.py", "--size-gb", "0.02", "--repeat", "1", "--dir", str(tmp_path))
    names = [" ".join(r) for r in rows]
    assert any(n.startswith("hf-to-mcore") for n in names) and any(n.startswith("live export, TP=2") for n in names)

"""benchmarks/bench_rollout_corr.py runs and prints its table (two modes, one repeat): the rollout
correction's share of the demo's step in benchmarks/RESULTS.md comes from it, so it must not rot."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_the_rollout_correction_benchmark_prints_each_modes_share_of_the_demo_step():
    args = ("--modes", "token_tis", "--repeats", "1", "--step-repeats", "1")
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_rollout_corr.py", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith("---"))
    rows = {line.split()[0]: line.split()[1:] for line in lines[rule + 1 :]}
    assert list(rows) == ["alone(bapo)", "off", "token_tis"], done.stdout
    assert "(128, 13) positions and 640 counted tokens" in lines[0], lines[0]  # the demo's update
    for mode in ("off", "token_tis"):
        loss, extra, prepass, per_step, share, step, spread, vs_off = rows[mode]
        assert float(loss) > 0 and float(per_step) == pytest.approx(2 * (float(extra) + float(prepass)), abs=0.03)
        low, high = map(float, spread.strip("()").split("-"))
        assert share.endswith("%") and low <= float(step) <= high and vs_off.endswith("%")

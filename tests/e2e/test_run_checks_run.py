"""logging.checks stops a run at the step that fails one: exit 1, one error line naming the check,
the step, the metric, its value and the bound, status.json "failed" with that line, the step's line
in metrics.jsonl, nothing saved after it and nothing left running. Every run tests/online.args
makes has the checks on (its CHECKS): this run breaks one on purpose."""

import json
import re

import pytest

from tests.online import MODEL, args, metrics, no_engine_left, start, write_task

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_failed_check_stops_an_async_run_with_one_line_and_status_json(tmp_path, hf_model):
    """Async with staleness 1 and a KL loss: step 1's KL to the reference (the starting weights) is 0,
    as the check holds it; a mismatch bound of 0 on every token's log-prob gap (stale tokens are
    measured by moved weights) cannot hold, and the run stops at the first step over it."""
    task = write_task(tmp_path / "task", 32, hf_model(*MODEL))
    run = tmp_path / "run"
    extra = (
        "rollout.mode=async",
        "rollout.partial.enabled=false",
        "rollout.partial.token_budget=null",
        "rollout.max_staleness=1",
        "rollout.oversample=2",
        "algo.kl_coef=0.05",
        "checkpoint.interval=1",
        "logging.checks.mismatch_metrics=[rollout_corr/train_rollout_logprob_abs_diff]",
        "logging.checks.max_logprob_mismatch=0",
    )
    proc = start(args(task, run, 6, *extra))
    out, _ = proc.communicate(timeout=600)
    last = out.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in out, out[-3000:]
    said = re.fullmatch(
        r"error: check max_logprob_mismatch failed at step (\d+): "
        r"rollout_corr/train_rollout_logprob_abs_diff=(\S+), max 0 .*",
        last,
    )
    assert said, last
    step, value = int(said[1]), float(said[2])
    status = json.loads((run / "status.json").read_text())
    assert status == {"state": "failed", "reason": "error", "step": step, "steps": 6, "signal": None, "error": last[7:]}
    got = metrics(run)
    assert [m["step"] for m in got] == list(range(1, step + 1))  # the failing step's line is written
    assert got[-1]["rollout_corr/train_rollout_logprob_abs_diff"] == pytest.approx(value, rel=1e-5) and value > 0
    assert abs(got[0]["loss/kl"]) <= 1e-6, got[0]  # the reference is the policy step 1 measured
    saved = sorted(p.name for p in (run / "ckpt").glob("step_*"))
    assert saved == [f"step_{s:08d}" for s in range(1, step)][-2:], saved  # the failing step is not saved
    no_engine_left(run)

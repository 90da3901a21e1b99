"""Ctrl-C as people use it, on a real run (replayed batches: no engines to wait for): interrupted
before its first checkpoint, the run says that nothing was saved and what the same command will do,
status.json says "interrupted" with no checkpoint; the same command then starts over and keeps the
interrupted start's logs in previous/1 (its banner says where), and an interrupt while it starts up
is recorded too."""

import json
import signal

import pytest

from tests.helpers import make_batch
from tests.online import metrics, start, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_ctrl_c_before_a_checkpoint_then_the_same_command_keeps_the_logs(tmp_path):
    (tmp_path / "replay").mkdir()
    make_batch(0).save(tmp_path / "replay" / "step_000.safetensors")
    run = tmp_path / "run"
    argv = [
        f"rollout.replay={tmp_path / 'replay'}",
        "steps=50",
        f"run_dir={run}",
        "logging.backends=[jsonl]",
        "parallel.max_tokens_per_microbatch=64",
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
    ]
    proc = start(argv)
    wait_for(lambda: (run / "metrics.jsonl").is_file() and metrics(run), proc, "the first step")
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-3000:]
    logged = metrics(run)
    step = len(logged)  # every step trained has its line
    assert out.strip().splitlines()[-1] == (
        f"interrupted at step {step} of 50: nothing was saved (checkpoint.interval=0: a checkpoint only at the "
        f"end); the same command starts over from random weights, in {run} (this start's logs then kept in "
        f"{run}/previous/)"
    )
    status = {"state": "interrupted", "reason": "signal", "step": step, "steps": 50, "signal": 2, "checkpoint": None}
    assert json.loads((run / "status.json").read_text()) == status

    proc = start(argv)  # the same command: it starts over, and is interrupted while it starts up
    for line in proc.stdout:
        if line.startswith("  earlier logs"):
            break
    proc.send_signal(signal.SIGINT)
    out = line + proc.communicate(timeout=300)[0]
    assert proc.returncode == 130, out[-3000:]
    kept = run / "previous" / "1"
    assert f"earlier logs   kept in {kept}" in out
    assert metrics(kept) == logged  # whole, not cut back
    assert json.loads((kept / "status.json").read_text()) == status
    again = json.loads((run / "status.json").read_text())
    assert again["state"] == "interrupted" and again["step"] == 0 and again["checkpoint"] is None

"""rollout.filter_groups.on_shortfall=error stops a run as verl stops when max_num_gen_batches runs
out: exit 1, one error line naming the step, the flat share and the config key, status.json
"failed" with that line, nothing left running."""

import json

import pytest

from tests.online import MODEL, args, no_engine_left, start, write_task

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ONE_SPREAD = """
def first_only(text, ids, record):
    # only the first record's group has rewards that differ: every other group is flat
    return float(sum(ids)) if record["answer"] == "0" else 0.0
"""


def test_a_step_short_of_groups_whose_rewards_differ_stops_the_run_with_on_shortfall_error(tmp_path, hf_model):
    task = write_task(tmp_path / "task", 16, hf_model(*MODEL))
    (task / "flat.py").write_text(ONE_SPREAD)
    run = tmp_path / "run"
    argv = args(task, run, 3, f"reward.function={task / 'flat.py'}:first_only", "data.shuffle=false")
    argv += ["rollout.filter_groups.enabled=true", "rollout.filter_groups.max_extra_rounds=1"]
    proc = start([*argv, "rollout.filter_groups.on_shortfall=error"])
    out, _ = proc.communicate(timeout=600)
    last = out.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in out, out[-3000:]
    assert last.startswith("error: rollout.filter_groups: step 1 has 1 of its 4 groups with rewards that differ"), last
    assert "flat share" in last and "on_shortfall=error" in last and "max_num_gen_batches" in last, last
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and "on_shortfall=error" in status["error"], status
    no_engine_left(run)

"""What decides, step by step, that a run ends: stop_when, and a run that has stopped training."""

import pytest

from bapo_megatron.config import load_config
from bapo_megatron.errors import RunStopped
from bapo_megatron.job import Job, StopWhen


def test_a_run_whose_every_update_is_skipped_stops_after_max_skipped_steps():
    cfg = load_config(None, ["optimizer.max_skipped_steps=3", "algo.updates_per_batch=2"])
    job = Job(cfg, 0, source=None, checkpointer=None, stop=None, until=StopWhen(None, 10))
    for step, skipped in enumerate([2, 2, 1, 2, 2], start=1):  # a step with one good update breaks the run of them
        job.watch(step, {"train/skipped": float(skipped)})
    with pytest.raises(RunStopped, match=r"the last 3 steps \(to step 6\) skipped every update .* optimizer.lr=1e-06"):
        job.watch(6, {"train/skipped": 2.0})

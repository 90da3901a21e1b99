"""What decides, step by step, that a run ends (stop_when, a run that stopped training), and its status.json."""

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


def test_status_json_says_how_the_job_ended(tmp_path, capsys):
    """status.json, one RunStatus: "stopped" after a signal (slurm/common.sh requeues the job), "failed"
    with the error, "finished" at the last step."""
    from types import SimpleNamespace

    from bapo_megatron.runinfo import RunStatus

    cfg = load_config(None, [f"run_dir={tmp_path}", "steps=5", "checkpoint.save=false", "logging.backends=[]"])
    checkpointer = SimpleNamespace(due=lambda step: True, manager=None)  # nothing to save at the end
    log = SimpleNamespace(flush=lambda **kwargs: None, step=3)
    stop = SimpleNamespace(received=10)
    job = Job(cfg, 0, source=None, checkpointer=checkpointer, stop=stop, until=StopWhen(None, 10), log=log)
    job.ended = "signal"
    job.finish(3)
    assert RunStatus.read(tmp_path) == RunStatus("stopped", "signal", 3, 5, signal=10)
    job.failed(RuntimeError("boom"))
    assert RunStatus.read(tmp_path) == RunStatus("failed", "error", 3, 5, error="boom")
    job.stop.received, job.ended = None, None
    job.finish(5)
    assert RunStatus.read(tmp_path) == RunStatus("finished", "steps", 5, 5)
    assert "finished at step 5 of 5" in capsys.readouterr().out

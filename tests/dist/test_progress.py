"""Progress bars: the update's bar counts every micro-batch of the schedule (one forward step a
micro-batch and virtual stage) on the rank that logs, and no other rank draws one."""

import io
import sys

from tests.dist.launch import run_workers
from tests.helpers import make_batch


def _worker(rank: int, world: int, progress: str) -> None:
    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    activate_cpu_shim()
    overrides = ["parallel.pipeline=2", "parallel.virtual_pipeline=2", "parallel.max_tokens_per_microbatch=48"]
    cfg = load_config(None, [*overrides, "algo.loss=bapo", f"logging.progress={progress}"])
    trainer = PolicyTrainer(tiny_spec(), cfg, init_model_parallel(cfg.parallel, cfg.seed))
    batch = make_batch(3)
    mbs, _ = trainer.microbatches(batch)
    shown, sys.stderr = sys.stderr, io.StringIO()
    try:
        trainer.train_step(batch)
        drawn = sys.stderr.getvalue()
    finally:
        sys.stderr = shown
    total = 2 * len(mbs)  # two virtual stages on each rank
    assert len(mbs) >= 2
    if progress == "true" and rank == 0:
        assert "bounds: 100%" in drawn and "update: 100%" in drawn, drawn
        assert f"{total}/{total}" in drawn and f"{total + 1}/{total}" not in drawn, drawn
    else:
        assert drawn == "", drawn


def test_update_bars_count_the_schedule_on_the_logging_rank_only():
    run_workers(_worker, 2, "true")


def test_no_bars_when_progress_is_off():
    run_workers(_worker, 2, "false")

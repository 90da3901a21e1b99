"""On a GPU, with CUDA's own detection (torch.cuda.set_sync_debug_mode): no operation of this
package makes the host wait for the device while the micro-batch schedule runs, and the step's
waits happen only where tests/dist/test_host_syncs.py lists them (STEP_READS). This also sees
what the CPU count cannot: a tensor made from host data on the device, a blocking copy."""

import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.dist.launch import run_workers
from tests.dist.test_host_syncs import PACKAGE, STEP_READS, watching_schedule
from tests.helpers import make_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SKIPPED = (str(Path(torch.__file__).parent), str(Path(warnings.__file__)), __file__)


def _site() -> str | None:
    """file:function of the innermost caller outside torch, warnings and this file, if it is ours."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(SKIPPED):
            return f"{Path(name).relative_to(PACKAGE)}:{frame.f_code.co_name}" if name.startswith(PACKAGE) else None
        frame = frame.f_back
    return None


def _worker(rank: int, world: int, loss: str) -> None:
    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    cfg = load_config(None, ["parallel.max_tokens_per_microbatch=48", "model.precision=bf16", f"algo.loss={loss}"])
    trainer = PolicyTrainer(tiny_spec(), cfg, init_model_parallel(cfg.parallel, cfg.seed))
    batch = make_batch(3)
    trainer.train_step(batch)  # compilation, first allocations
    step, scheduled = [], []

    def seen(message, category, filename, lineno, file=None, line=None):
        site = _site()
        if site is not None and "synchronizing" in str(message):
            (scheduled if in_schedule[0] else step).append(site)

    # catch_warnings restores showwarning and the filters afterwards
    with watching_schedule(trainer) as in_schedule, warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = seen
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_step(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not scheduled, f"the host waits for the GPU inside the schedule at {sorted(set(scheduled))}"
    assert set(step) <= STEP_READS.keys(), f"new waits in the step: {set(step) - STEP_READS.keys()}"


@pytest.mark.parametrize("loss", ["bapo", "gspo", "sft"])
def test_the_schedule_never_waits_for_the_gpu(loss):
    run_workers(_worker, 1, loss, device="cuda")

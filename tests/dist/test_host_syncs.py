"""The training step's host reads of tensor values: on a GPU each one (.item(), bool() or float()
of a tensor, .tolist(), a boolean-mask index, nonzero) stops the host until the device has
caught up, so one inside the micro-batch schedule would keep the host from queueing the next
forward or backward while the GPU runs this one.

On the CPU the same aten ops run, so they can be counted: a TorchDispatchMode sees every
`_local_scalar_dense` (item, bool, float, int of a tensor), `nonzero`, `masked_select`, the
unique family, `repeat_interleave` by tensor, `bincount`, `equal` and boolean index, and a
wrapper every `Tensor.tolist`, each attributed to the innermost frame of this package
(Megatron's own reads are Megatron's). A tensor made from host data on the device (a
blocking copy on CUDA) looks like any CPU tensor here: tests/gpu/test_host_syncs_cuda.py
checks the same on a GPU with CUDA's own sync detection. Checked: none while the schedule runs (the
loss callbacks of the bound pre-pass and of the update), and the step's count does not grow with
its number of micro-batches, also with two pipeline stages."""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.dist.launch import run_workers
from tests.helpers import make_batch

PACKAGE = str(Path(__file__).resolve().parents[2] / "bapo_megatron")
TORCH = str(Path(torch.__file__).parent)


def _site() -> str | None:
    """file:function of the innermost caller that is neither torch nor this file nor the CPU shim:
    this package's (a read of ours) or None (Megatron's, or anyone else's)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(TORCH) or name == __file__ or name.endswith("cpu_shim.py")):
            inside = name.startswith(PACKAGE)
            return f"{Path(name).relative_to(PACKAGE)}:{frame.f_code.co_name}" if inside else None
        frame = frame.f_back
    return None


def _count_reads(trainer, batch) -> tuple[collections.Counter, collections.Counter]:
    """(reads during the schedule, reads of the whole step) of one train_step, by call site."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    reads = {  # ops whose output size or value the host must know: CUDA makes it wait
        aten._local_scalar_dense.default,
        aten.nonzero.default,
        aten.masked_select.default,
        aten._unique2.default,
        aten.unique_dim.default,
        aten.unique_consecutive.default,
        aten.repeat_interleave.Tensor,
        aten.bincount.default,
        aten.equal.default,
    }
    indexing = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}
    step, scheduled = collections.Counter(), collections.Counter()

    def record() -> None:
        site = _site()
        if site is not None:
            step[site] += 1
            if in_schedule[0]:
                scheduled[site] += 1

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            masks = args[1] if func in indexing else ()
            if func in reads or any(getattr(i, "dtype", None) == torch.bool for i in masks):
                record()
            return func(*args, **(kwargs or {}))

    tolist = torch.Tensor.tolist

    inside_tolist = [False]

    def counted_tolist(self, *args, **kwargs):
        if inside_tolist[0]:  # the CPU shim's torch function mode calls Tensor.tolist again
            return tolist(self, *args, **kwargs)
        record()
        inside_tolist[0] = True
        try:
            return tolist(self, *args, **kwargs)
        finally:
            inside_tolist[0] = False

    torch.Tensor.tolist = counted_tolist
    try:
        with watching_schedule(trainer) as in_schedule, Reads():
            trainer.train_step(batch)
    finally:
        torch.Tensor.tolist = tolist
    return scheduled, step


@contextlib.contextmanager
def watching_schedule(trainer) -> Iterator[list[bool]]:
    """A flag whose [0] is true while the trainer runs a schedule (its _run, wrapped meanwhile)."""
    flag, run = [False], trainer._run

    @functools.wraps(run)
    def schedule(*args, **kwargs):
        flag[0] = True
        try:
            return run(*args, **kwargs)
        finally:
            flag[0] = False

    trainer._run = schedule
    try:
        yield flag
    finally:
        del trainer._run


def _worker(rank: int, world: int, pipeline: int, overrides: list[str]) -> None:
    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    activate_cpu_shim()
    counts = {}
    for budget in (4096, 48):  # every sample in one micro-batch, then one or two a micro-batch
        parallel = [f"parallel.pipeline={pipeline}", f"parallel.max_tokens_per_microbatch={budget}"]
        cfg = load_config(None, [*parallel, *overrides])
        trainer = PolicyTrainer(tiny_spec(), cfg, init_model_parallel(cfg.parallel, cfg.seed))
        batch = make_batch(3)
        mbs, _ = trainer.microbatches(batch)
        trainer.train_step(batch)  # the first step's one-off work (grids on the device, buffers)
        scheduled, step = _count_reads(trainer, batch)
        # one micro-batch a rank: the prepass rides on the training forward, its one search read with it
        folded = {"algo/bapo.py:select": 1} if len(mbs) == 1 and "algo/bapo.py:select" in step else {}
        assert dict(scheduled) == folded, f"host reads inside the schedule ({len(mbs)} micro-batches): {scheduled}"
        counts[len(mbs)] = step
    (one, few), (many, per_step) = sorted(counts.items())
    assert one == 1 and many >= 4, counts.keys()
    assert per_step == few, f"{one} micro-batch: {dict(few)}; {many}: {dict(per_step)}"
    assert set(per_step) <= STEP_READS.keys(), f"new host reads in the step: {set(per_step) - STEP_READS.keys()}"
    assert per_step["trainer/policy_trainer.py:_nonfinite"] == 1  # the count sees this package's reads


STEP_READS = {
    "algo/advantages.py:group_advantages": "the rewards' statistics (host tensors)",
    "trainer/policy_trainer.py:microbatches": "the advantages into the packed micro-batches (host tensors)",
    "algo/bapo.py:select": "the chosen bounds and the search's error counts, once (last stage)",
    "trainer/policy_trainer.py:_nonfinite": "one flag: any rank's loss or gradient not finite",
    "algo/metrics.py:reduce_metrics": "the step's metrics, once (last stage)",
    "trainer/policy_trainer.py:_metrics": "the metrics to the other pipeline stages, once (the object's size)",
}
"""Where a training step reads tensor values on the host, and why: three device reads a step
(four with pipeline stages), after the schedule, however many micro-batches it has."""


@pytest.mark.parametrize(
    "overrides",
    [[], ["algo.loss=gspo"], ["algo.loss=cispo"], ["algo.loss=sft"], ["algo.tis_cap=2.0"]],
    ids=["bapo", "gspo", "cispo", "sft", "tis"],
)
def test_no_host_reads_in_the_schedule_and_a_fixed_number_a_step(overrides):
    run_workers(_worker, 1, 1, overrides)


def test_the_same_with_two_pipeline_stages():
    run_workers(_worker, 2, 2, [])


def _per_microbatch_worker(rank: int, world: int) -> None:
    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    activate_cpu_shim()
    cfg = load_config(None, ["parallel.max_tokens_per_microbatch=48", "algo.bapo.bound_scope=microbatch"])
    trainer = PolicyTrainer(tiny_spec(), cfg, init_model_parallel(cfg.parallel, cfg.seed))
    batch = make_batch(3)
    mbs, _ = trainer.microbatches(batch)
    trainer.train_step(batch)
    scheduled, _ = _count_reads(trainer, batch)
    assert dict(scheduled) == {"algo/bapo.py:select": len(mbs)}, dict(scheduled)


def test_microbatch_bounds_read_once_a_microbatch():
    """bound_scope=microbatch: each micro-batch's loss needs its own bounds first, so its search's
    one read happens in the schedule, once a micro-batch and nowhere else (the step scope, the
    default, searches once before the schedule)."""
    run_workers(_per_microbatch_worker, 1)

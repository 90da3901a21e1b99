"""A run's plan: its model, its recompute fitted to the GPU, its config checked, its layout.

    plan = plan_run(cfg, world_size, gpu_bytes)                  # job.py: the launcher's world, this GPU
    plan = plan_run(cfg, world_size, gpu_bytes, machine=False)   # --dry-run: the world and GPU it plans for
    plan.cfg, plan.spec, plan.data_parallel, plan.layout, plan.recompute_line

The run and the dry run plan through this one function, in one order: the model's shape, then
parallel.recompute fitted to the GPU (trainer/memory/fit.py), then every check of
preflight.validate on the fitted config. So what one accepts the other accepts, and the layout
both print is written here.
"""

from __future__ import annotations

from dataclasses import dataclass

from bapo_megatron.config import JobConfig, ParallelConfig
from bapo_megatron.models.spec import ModelSpec


@dataclass(frozen=True)
class RunPlan:
    """A job planned for its trainer processes and their GPUs, before anything is built."""

    cfg: JobConfig
    """The job, parallel.recompute concrete (never "auto"), every check passed."""
    spec: ModelSpec
    """The model's shape (model.hf_path's config.json, or the built-in tiny model)."""
    world_size: int
    """The trainer processes, one a GPU."""
    recompute_line: str
    """The recompute, why, and what it costs (the dry run prints it; the run, when auto chose it)."""
    fits: bool
    """Whether the estimated peak fits the GPU (False only for a recompute set by hand with
    parallel.over_memory=true)."""

    @property
    def data_parallel(self) -> int:
        return self.cfg.parallel.data_parallel_size(self.world_size)

    @property
    def layout(self) -> str:
        return layout(self.cfg.parallel, self.world_size)


def layout(parallel: ParallelConfig, world_size: int) -> str:
    """The trainer's layout in one line, 'TP 4 x PP 2 x DP 2': the virtual pipeline, context and
    expert parallel sizes only where they are set."""
    p = parallel
    parts = [f"TP {p.tensor}", f"PP {p.pipeline}"]
    if p.virtual_pipeline:
        parts.append(f"VPP {p.virtual_pipeline}")
    if p.context > 1:
        parts.append(f"CP {p.context}")
    if p.expert > 1:
        parts.append(f"EP {p.expert}")
    return " x ".join([*parts, f"DP {p.data_parallel_size(world_size)}"])


def plan_run(cfg: JobConfig, world_size: int, gpu_bytes: int | None, machine: bool = True) -> RunPlan:
    """`cfg` planned for `world_size` processes on GPUs of gpu_bytes (None: no GPU, nothing to fit);
    ConfigError for what the run refuses: a layout the model or the world does not divide, a peak
    over the GPU, a batch or sample the layout cannot take, inputs the job cannot read. machine=False
    leaves this machine's precision support unchecked (a dry run plans another machine)."""
    from bapo_megatron.preflight import model_spec, validate
    from bapo_megatron.trainer.checkpoint import refuse_step_dir
    from bapo_megatron.trainer.memory.fit import fit_to_gpu

    if cfg.checkpoint_path is not None:  # verl's trainer.resume_from_path names one step's directory
        refuse_step_dir(cfg.checkpoint_path)
    spec = model_spec(cfg)
    fitted = fit_to_gpu(cfg, spec, world_size, gpu_bytes)
    validate(fitted.cfg, spec, world_size, machine=machine)
    return RunPlan(fitted.cfg, spec, world_size, fitted.line, fitted.fits)

"""The BAPO training driver: rollout, advantages, Megatron update, checkpoint, log.

    bapo-train CONFIG.yaml key=value ...                                # one process (CPU)
    torchrun --nproc-per-node 8 -m bapo_megatron.train CONFIG.yaml ...  # a parallel job
    bapo-train --help-config; bapo-train CONFIG.yaml --dry-run          # every field; what would run

Today the rollout comes from saved batches (`rollout.replay=PATH`); generation through
SGLang or the embedded engine plugs in at `next_batch` (issue 5).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist

from bapo_megatron.config import JobConfig, dump_config, load_config, to_dict
from bapo_megatron.errors import BadInputError, ConfigError
from bapo_megatron.logger import MetricLogger
from bapo_megatron.rollout.batch import RolloutBatch
from bapo_megatron.trainer.model_spec import ModelSpec, check_layout, tiny_spec


class ReplaySource:
    """Saved rollout batches, one per step, cycling; its cursor is checkpointed. Every file is
    read and checked against the model when the source is made, before any model is built."""

    def __init__(self, path: str, vocab_size: int) -> None:
        root = Path(path)
        self.files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
        if not self.files or not all(f.is_file() for f in self.files):
            raise ConfigError("rollout.replay", path, "no rollout batch (.safetensors) found there")
        for f in self.files:
            try:
                problem = RolloutBatch.load(f).problem(vocab_size)
            except ValueError as err:
                raise BadInputError(str(err)) from None
            if problem:
                raise BadInputError(f"rollout batch {f}: {problem}")
        self.index = 0

    def next_batch(self) -> RolloutBatch:
        batch = RolloutBatch.load(self.files[self.index % len(self.files)])
        self.index += 1
        return batch

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = state["index"]


def model_spec(cfg: JobConfig) -> ModelSpec:
    return ModelSpec.from_hf_dir(cfg.model.hf_path) if cfg.model.hf_path else tiny_spec()


def validate(cfg: JobConfig, spec: ModelSpec, world_size: int) -> None:
    """Every check that needs no process group, so bad input fails before expensive work starts."""
    from bapo_megatron.trainer.megatron_config import check_precision_support

    check_layout(spec, cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.virtual_pipeline)
    dp = cfg.parallel.data_parallel_size(world_size)
    per_update = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt // cfg.algo.updates_per_batch
    if per_update % dp:
        raise ConfigError(
            "rollout.prompts_per_step",
            cfg.rollout.prompts_per_step,
            f"{per_update} samples per optimizer step do not split over {dp} data-parallel ranks",
        )
    check_precision_support(cfg.model)
    if cfg.rollout.replay is None:
        raise ConfigError(
            "rollout.replay",
            None,
            "generation is not built yet (issue 5): train from saved rollout batches with rollout.replay=PATH",
        )


def check_starting_weights(cfg: JobConfig, spec: ModelSpec) -> bool:
    """Whether model.hf_path's safetensors are the starting weights; their files (or mcore_path's)
    checked before any model is built. A config without weights: random ones, loudly."""
    import warnings

    from bapo_megatron.trainer.integrity import verify
    from bapo_megatron.weights.hf_io import HFCheckpoint

    if cfg.model.mcore_path:
        verify(cfg.model.mcore_path, check_contents=False)
        return False
    if not cfg.model.hf_path:
        return False
    if not any(Path(cfg.model.hf_path).glob("*.safetensors")):
        warnings.warn(
            f"model.hf_path={cfg.model.hf_path} has a config.json but no *.safetensors: training starts from "
            "RANDOM weights (set model.mcore_path, or put the model's safetensors there)",
            stacklevel=2,
        )
        return False
    try:
        HFCheckpoint(cfg.model.hf_path)  # shapes against config.json, every tensor accounted for
    except ValueError as err:
        raise BadInputError(str(err)) from None
    return True


def split_groups(batch: RolloutBatch, parts: int) -> list[RolloutBatch]:
    """`parts` mini-batches of whole prompt groups, in order."""
    groups: dict[int, list] = {}
    for s in batch.samples:
        groups.setdefault(s.group, []).append(s)
    if len(groups) % parts:
        raise ValueError(f"rollout batch has {len(groups)} groups, not divisible into {parts} updates")
    keys = list(groups)
    size = len(keys) // parts
    return [
        RolloutBatch(
            samples=[s for g in keys[i * size : (i + 1) * size] for s in groups[g]],
            temperature=batch.temperature,
            metadata=batch.metadata,
        )
        for i in range(parts)
    ]


def run(cfg: JobConfig) -> list[dict[str, float]]:
    """Train for cfg.steps steps (resuming from cfg.checkpoint.dir when it holds one)."""
    import torch

    from bapo_megatron.trainer.checkpoint import CheckpointManager
    from bapo_megatron.trainer.integrity import verify
    from bapo_megatron.trainer.parallel import init_distributed, init_model_parallel, single_process_env
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    spec = model_spec(cfg)
    single_process_env()
    validate(cfg, spec, int(os.environ["WORLD_SIZE"]))
    source = ReplaySource(cfg.rollout.replay, spec.vocab_size)
    starting_weights = check_starting_weights(cfg, spec)
    ckpt = CheckpointManager(cfg.checkpoint, dump_config(cfg)) if cfg.checkpoint.dir else None
    if ckpt is not None:  # before any process group or model: a wrong start fails in seconds
        ckpt.check_start(cfg.checkpoint.resume)
        resume_from = ckpt.latest() if cfg.checkpoint.resume else None
        if resume_from is not None:
            verify(resume_from, check_contents=False)
    init_distributed()
    if not torch.cuda.is_available():
        from bapo_megatron.trainer.cpu_shim import activate_cpu_shim

        activate_cpu_shim()
    trainer = PolicyTrainer(spec, cfg, init_model_parallel(cfg.parallel, cfg.seed))
    if ckpt is not None:
        ckpt.register("replay", source)
    start = ckpt.load(trainer) if ckpt and cfg.checkpoint.resume else None
    if start is None:  # a new run: its starting weights
        start = 0
        if cfg.model.mcore_path:
            trainer.load_weights(cfg.model.mcore_path)
        elif starting_weights:
            trainer.load_hf_weights(cfg.model.hf_path)
    step = start
    logger = MetricLogger(cfg.logging, job_name=cfg.name, config=to_dict(cfg), enabled=dist.get_rank() == 0)
    history = []
    try:
        while step < cfg.steps:
            batch = source.next_batch()
            for k, part in enumerate(split_groups(batch, cfg.algo.updates_per_batch)):
                result = trainer.train_step(part, first_update=k == 0)
                logger.log(trainer.step, result.metrics)
                history.append(result.metrics)
            step += 1
            if ckpt and cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0:
                ckpt.save(trainer, step)
        if ckpt and (not cfg.checkpoint.interval or step % cfg.checkpoint.interval) and step > start:
            ckpt.save(trainer, step)
    finally:
        logger.close()
    return history


def main(argv: list[str] | None = None) -> None:
    """`bapo-train` (and python -m bapo_megatron.train): see bapo_megatron/cli.py for the options."""
    from bapo_megatron import cli

    args = cli.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.help_config:
        print(cli.help_config())
        return
    try:
        cfg = load_config(args.config, args.overrides)
        if args.dry_run:
            print(cli.dry_run(cfg, cli.world_size(args), int(args.gpu_memory_gib * cli.GIB)))
            return
        run(cfg)  # run validates before any process group starts
    except (ConfigError, BadInputError) as err:
        # A config mistake or an unusable file is the user's to fix: say what, without a traceback.
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()

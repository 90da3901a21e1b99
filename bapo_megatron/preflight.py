"""Every check of a job that needs no process group and no model: bad input fails in seconds.

`bapo-train` runs them before it starts anything expensive, `--dry-run` runs them to print what
would run.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from bapo_megatron.config import JobConfig
from bapo_megatron.errors import BadInputError, ConfigError
from bapo_megatron.models import family_of
from bapo_megatron.models.spec import ModelSpec, check_layout, tiny_spec


def model_spec(cfg: JobConfig) -> ModelSpec:
    return ModelSpec.from_hf_dir(cfg.model.hf_path) if cfg.model.hf_path else tiny_spec()


def validate(cfg: JobConfig, spec: ModelSpec, world_size: int, machine: bool = True) -> None:
    """The layout against the model and the world, the batch against the data-parallel ranks, a
    sample against the micro-batch, the precision against this machine (machine=False: not, for a
    dry run planning another machine), and what the job's sources need; of a job fitted to its GPUs
    first (trainer/memory/fit.py: parallel.recompute=auto resolved, context parallel refused). The run and
    the dry run both call it: what one refuses the other refuses."""
    from bapo_megatron.trainer.megatron_config import check_precision_support, recompute_settings
    from bapo_megatron.trainer.packing import packs

    check_layout(
        spec,
        cfg.parallel.tensor,
        cfg.parallel.pipeline,
        cfg.parallel.virtual_pipeline,
        cfg.parallel.expert,
        cfg.parallel.sequence_parallel,
    )
    if cfg.algo.routing_replay and spec.moe is None:
        raise ConfigError(
            "algo.routing_replay", True, f"replays a mixture-of-experts model's routes; {spec.architecture} is dense"
        )
    recompute_settings(spec, cfg.parallel)  # recompute_layers within a stage's layers
    packs(spec, cfg.model, cfg.parallel)  # parallel.packing=packed of a model whose layers would mix a row's samples
    family_of(spec).check_impl(spec, cfg.model.transformer_impl == "transformer_engine")  # as layer_spec refuses it
    if cfg.rollout.record_routes and spec.moe is None:
        raise ConfigError(
            "rollout.record_routes", True, f"records a mixture-of-experts model's routes; {spec.architecture} is dense"
        )
    dp = cfg.parallel.data_parallel_size(world_size)
    per_update = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt // cfg.algo.updates_per_batch
    if per_update % dp:
        raise ConfigError(
            "rollout.prompts_per_step",
            cfg.rollout.prompts_per_step,
            f"{per_update} samples per optimizer step do not split over {dp} data-parallel ranks",
        )
    if cfg.parallel.virtual_pipeline and per_update // dp < cfg.parallel.pipeline:
        raise ConfigError(
            "rollout.prompts_per_step",
            cfg.rollout.prompts_per_step,
            f"{per_update // dp} samples per data-parallel rank and optimizer step cannot fill the interleaved "
            f"schedule's groups of {cfg.parallel.pipeline} micro-batches (parallel.virtual_pipeline)",
        )
    check_response_fits(cfg)
    check_context(cfg, spec)
    if cfg.algo.loss == "sft" and cfg.rollout.replay is not None:
        raise ConfigError("rollout.replay", cfg.rollout.replay, "algo.loss=sft trains on data.path; unset one")
    if cfg.algo.loss != "sft" and cfg.rollout.replay is None:
        for name, held in cfg.eval.sets.items():  # a preset's set left for the user's file
            if held.path is None:
                raise ConfigError(
                    f"eval.sets.{name}.path",
                    None,
                    f"is not set: the set's prompts (file, shards, glob): set eval.sets.{name}.path=FILE, or leave "
                    f"the set out (eval.sets={{NAME: {{path: FILE}}}} names the sets to keep)",
                )
    if machine:
        check_precision_support(cfg.model)


def check_response_fits(cfg: JobConfig) -> None:
    """A generated sample (its prompt, then up to rollout.sampling.max_new_tokens) must fit one
    micro-batch: ConfigError when not even a one-token prompt leaves room (the run would refuse
    every prompt of data.path, rollout/inputs.py)."""
    new, budget = cfg.rollout.sampling.max_new_tokens, cfg.parallel.max_tokens_per_microbatch
    if cfg.rollout.replay is not None or cfg.algo.loss == "sft" or new < budget:
        return
    prompt = cfg.data.max_prompt_tokens
    room = (
        f"={new + prompt} (a response and a prompt of up to data.max_prompt_tokens={prompt})"
        if prompt
        else f" to {new} plus the longest prompt (data.max_prompt_tokens caps them)"
    )
    raise ConfigError(
        "parallel.max_tokens_per_microbatch",
        budget,
        f"leaves no room for a prompt beside responses of up to rollout.sampling.max_new_tokens={new} "
        f"tokens: a sample must fit one micro-batch; set parallel.max_tokens_per_microbatch{room} "
        "or lower rollout.sampling.max_new_tokens",
    )


def check_context(cfg: JobConfig, spec: ModelSpec) -> None:
    """A prompt and its response must fit the model's context (max_position_embeddings: SGLang refuses
    a request beyond it, and RoPE was not trained past it): ConfigError naming both fields and the
    model's figure when data.max_prompt_tokens + rollout.sampling.max_new_tokens exceed it (without
    a prompt cap: when the responses alone leave no room for a prompt)."""
    if cfg.rollout.replay is not None or cfg.algo.loss == "sft":
        return
    new, prompt, context = cfg.rollout.sampling.max_new_tokens, cfg.data.max_prompt_tokens, spec.max_position_embeddings
    if (new + prompt if prompt else new + 1) <= context:
        return
    source = f"{cfg.model.hf_path}/config.json" if cfg.model.hf_path else "the built-in tiny model"
    reach = (
        f"with data.max_prompt_tokens={prompt} a sample reaches {new + prompt:,} tokens, beyond"
        if prompt
        else ("leaves no room for a prompt in")
    )
    raise ConfigError(
        "rollout.sampling.max_new_tokens",
        new,
        f"{reach} the model's context, max_position_embeddings={context:,} ({source}); lower "
        "rollout.sampling.max_new_tokens or data.max_prompt_tokens",
    )


def check_starting_weights(cfg: JobConfig) -> bool:
    """Whether model.hf_path's safetensors are the starting weights; their files (or mcore_path's)
    checked before any model is built. A config without weights: random ones, loudly."""
    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.trainer.checkpoint import weights_dir
    from bapo_megatron.trainer.integrity import verify_integrity

    if cfg.model.mcore_path:
        verify_integrity(weights_dir(cfg.model.mcore_path), check_contents=False)
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

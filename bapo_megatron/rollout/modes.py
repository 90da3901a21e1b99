"""The rollout a job's config asks for: a core over the engines' pool, and its mode's strategy over it.

    strategy = make_strategy(cfg, rollout_core(cfg, pool, buffer, inputs, rewards))

The strategy is picked by rollout.mode, rollout.deterministic and rollout.partial (rollout/strategies.py),
with rollout.filter_groups' sieve (rollout/filtering.py) and how requests share calls (rollout.calls).
"""

from __future__ import annotations

from bapo_megatron.common.protocol import SamplingParams
from bapo_megatron.config import JobConfig
from bapo_megatron.engines.pool import EnginePool
from bapo_megatron.rewards.workers import RewardWorkers
from bapo_megatron.rollout.adapters import ServedAdapter
from bapo_megatron.rollout.buffer import RolloutBuffer
from bapo_megatron.rollout.core import RolloutCore
from bapo_megatron.rollout.filtering import DropEqualRewards, KeepAll
from bapo_megatron.rollout.inputs import RolloutInputs
from bapo_megatron.rollout.strategies import AbortSteps, AsyncStream, DeterministicRounds, RetractSteps, Strategy


def rollout_core(
    cfg: JobConfig,
    pool: EnginePool,
    buffer: RolloutBuffer,
    inputs: RolloutInputs,
    rewards: RewardWorkers,
    adapters: ServedAdapter | None = None,
) -> RolloutCore:
    """Generation on the engines of `pool` into `buffer`: the training prompts in order, sampled with
    rollout.sampling, scored by `rewards` (seeded by the job's seed with rollout.deterministic), each
    request naming the LoRA adapter `adapters` serves (model.lora.sync adapter)."""
    ro, s = cfg.rollout, cfg.rollout.sampling
    return RolloutCore(
        pool,
        buffer,
        inputs.prompts.next,
        rewards,
        SamplingParams(s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k),
        decode=inputs.decode,
        deterministic_seed=cfg.seed if ro.deterministic else None,
        adapters=adapters,
    )


def make_strategy(cfg: JobConfig, core: RolloutCore) -> Strategy:
    """The rollout mode's strategy."""
    ro = cfg.rollout
    f = ro.filter_groups
    sieve = DropEqualRewards(f.max_extra_rounds, f.on_shortfall) if f.enabled else KeepAll()
    if ro.mode == "async":
        return AsyncStream(core, ro.prompts_per_step, ro.oversample, ro.pause_mode, sieve)
    if ro.deterministic:
        return DeterministicRounds(core, ro.prompts_per_step, ro.oversample, sieve, round_calls=ro.round_calls)
    if ro.partial.enabled and ro.partial.mode == "retract":
        return RetractSteps(core, ro.prompts_per_step, ro.oversample, sieve)
    return AbortSteps(
        core, ro.prompts_per_step, ro.oversample, ro.partial.enabled, filter_groups=sieve, round_calls=ro.round_calls
    )

"""What generation reads, checked before any engine or model: the tokenizer, the reward, the
training prompts and the held-out sets.

    inputs = RolloutInputs(cfg, spec)   # ConfigError / BadInputError naming the field or the record
    inputs.prompts.next(); inputs.eval_sets; inputs.reward (the name the reward workers load)

Checked now: the first data.check_records training records (read, rendered, with room for
rollout.sampling.max_new_tokens in the model's context and in one micro-batch), the others when
drawn; every record of every evaluation set (they are all read now); with reward.by, every training
record's route (one read of that field). An error names the field that gave the path (data.path,
eval.path, eval.sets.NAME.path) and the record.
"""

from __future__ import annotations

import dataclasses

from bapo_megatron.common.model_spec import ModelSpec
from bapo_megatron.config import DataConfig, JobConfig
from bapo_megatron.data.prompts import PromptLimits, PromptSource, load_tokenizer
from bapo_megatron.errors import BadInputError, ConfigError
from bapo_megatron.rewards.functions import load_reward, reward_spec
from bapo_megatron.rollout.evaluation import EvalSet


class RolloutInputs:
    def __init__(self, cfg: JobConfig, spec: ModelSpec) -> None:
        self.cfg, self.spec = cfg, spec
        if cfg.data.path is None:
            raise ConfigError("data.path", None, "generation needs prompts: a jsonl or parquet file")
        self.tokenizer = load_tokenizer(cfg.model.hf_path)
        if self.tokenizer is not None and len(self.tokenizer) > spec.vocab_size:
            raise BadInputError(
                f"model.hf_path={cfg.model.hf_path}: the tokenizer has {len(self.tokenizer)} tokens, more than "
                f"the model's vocabulary of {spec.vocab_size}"
            )
        r = cfg.reward
        self.reward = reward_spec(
            r.function,
            r.by,
            r.routes,
            r.overlong_buffer,
            r.overlong_penalty_factor,
            cfg.rollout.sampling.max_new_tokens,
        )
        field, value = ("reward.routes", r.routes) if r.by else ("reward.function", r.function)
        try:
            self._loaded = load_reward(self.reward)
        except ValueError as err:
            raise ConfigError(field, value, str(err)) from None
        self.prompts = self._prompts("data.path", cfg.data)
        self.eval_sets = self._eval_sets()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _eval_sets(self) -> list[EvalSet]:
        """eval.path (metrics eval/*) and every eval.sets entry (eval/NAME/*), read with data's field
        map and checked as data.path is (the micro-batch aside: no gradient)."""
        e, sets = self.cfg.eval, []
        named = [("eval.path", "eval/", e.path, e.samples, e.max_prompts, e.greedy)] if e.path is not None else []
        for name, one in e.sets.items():
            samples = e.samples if one.samples is None else one.samples
            most = e.max_prompts if one.max_prompts is None else one.max_prompts
            greedy = e.greedy if one.greedy is None else one.greedy
            named.append((f"eval.sets.{name}.path", f"eval/{name}/", one.path, samples, most, greedy))
        for field, prefix, path, samples, most, greedy in named:
            if path is None:
                raise ConfigError(field, None, "is not set: the set's prompts (file, shards, glob)")
            if not samples and not greedy:
                raise ConfigError(field.removesuffix(".path"), path, "0 samples and greedy off evaluate nothing")
            source = self._prompts(field, dataclasses.replace(self.cfg.data, path=path, shuffle=False))
            try:
                prompts = source.first(most)  # every record evaluated, read and checked now
            except ValueError as err:
                raise BadInputError(str(err)) from None
            sets.append(EvalSet(prefix, prompts, samples, greedy))
        return sets

    def _prompts(self, field: str, data: DataConfig) -> PromptSource:
        """data.path's prompts (or an evaluation set's), the first data.check_records checked now,
        and for training every record's reward route (an evaluation set's are checked as `first`
        reads them: its records past max_prompts are never scored)."""
        new, context = self.cfg.rollout.sampling.max_new_tokens, self.spec.max_position_embeddings
        limit = context - new
        reason = f"+ rollout.sampling.max_new_tokens ({new}) exceed the model's context of {context} tokens"
        microbatch = self.cfg.parallel.max_tokens_per_microbatch if field == "data.path" else None
        if microbatch is not None and microbatch - new < limit:
            limit = microbatch - new
            reason = (
                f"+ rollout.sampling.max_new_tokens ({new}) exceed parallel.max_tokens_per_microbatch={microbatch}: "
                "a sample must fit one micro-batch (data.max_prompt_tokens drops longer prompts)"
            )
        limits = PromptLimits(vocab_size=self.spec.vocab_size, max_tokens=limit, reason=reason)
        by = self.cfg.reward.by if field == "data.path" else None
        try:
            return PromptSource(
                data, tokenizer=self.tokenizer, limits=limits, field=field, check=self._route_check(), check_field=by
            )
        except ConfigError:
            raise
        except ValueError as err:
            raise BadInputError(str(err)) from None

    def _route_check(self):
        """With reward.by, a check that a record's value has a reward (None without it)."""
        if self.cfg.reward.by is None:
            return None
        router = self._loaded

        def route(meta: dict) -> None:
            try:
                router.route(meta)
            except KeyError as err:
                raise ValueError(f"{err.args[0]} (reward.by)") from None

        return route

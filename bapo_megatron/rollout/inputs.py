"""What generation reads, checked before any engine or model: the tokenizer, the reward, the
training prompts and the held-out sets.

    inputs = RolloutInputs(cfg, spec)   # ConfigError / BadInputError naming the field or the record
    inputs.prompts.next(); inputs.eval_sets; inputs.reward (the name the reward workers load)

Checked now: the first data.check_records training records (read, rendered, with room for
rollout.sampling.max_new_tokens in the model's context and in one micro-batch), the others when
drawn; every record of every evaluation set (they are all read now); with reward.by, every training
record's route (one read of that field). In each record checked, what its reward reads: a built-in's
answer (data.answer_field) present, as text or a number; for a function of verl's form, the answer
and data_source present; a user function's signature (the call it takes: rewards/functions.py's
called_as_declared, as the workers call it), and one call of it on each set's first record (an
empty response, in a worker bounded as the run's are), whose KeyError for a field the record lacks
is an error. An error names the field that gave the path (data.path, eval.path,
eval.sets.NAME.path), the record, the field path and the record's fields.

    lines = dry_run_check(cfg, spec)     # the dry run's call: the same checks, where the data is here
"""

from __future__ import annotations

import dataclasses

from bapo_megatron.common.fields import get_field, has_field
from bapo_megatron.config import DataConfig, JobConfig
from bapo_megatron.data.prompts import PromptLimits, PromptSource, load_tokenizer, missing_field
from bapo_megatron.data.records import data_files
from bapo_megatron.errors import BadInputError, ConfigError
from bapo_megatron.models.spec import ModelSpec
from bapo_megatron.rewards.functions import load_reward, reward_spec
from bapo_megatron.rewards.workers import dry_calls, reads, takes_verl_call, value_problem
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
            r.table,
            r.overlong_buffer,
            r.overlong_penalty_factor,
            cfg.rollout.sampling.max_new_tokens,
        )
        field, value = ("reward.table", r.table) if r.by else ("reward.function", r.function)
        try:  # a function of yours imported, and its parameters read for the call they take, as the workers will
            self._loaded = load_reward(self.reward)
        except ValueError as err:
            raise ConfigError(field, value, str(err)) from None
        self.sources: dict[str, PromptSource] = {}  # the config key that gave each path -> its records
        self._first: dict[tuple[str, str], dict] = {}  # (user reward, key): the first record it scores
        self.prompts = self._prompts("data.path", cfg.data)
        self.eval_sets = self._eval_sets()
        self._dry_calls()

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
                "a sample must fit one micro-batch: raise parallel.max_tokens_per_microbatch or lower "
                "rollout.sampling.max_new_tokens (data.max_prompt_tokens with overlong_prompts=drop leaves such "
                "prompts out)"
            )
        limits = PromptLimits(vocab_size=self.spec.vocab_size, max_tokens=limit, reason=reason)
        by = self.cfg.reward.by if field == "data.path" else None
        try:
            source = PromptSource(
                data, tokenizer=self.tokenizer, limits=limits, field=field, check=self._check(field), check_field=by
            )
        except ConfigError:
            raise
        except ValueError as err:
            raise BadInputError(str(err)) from None
        self.sources[field] = source
        return source

    def _check(self, key: str):
        """What a record of `key`'s set must hold for its reward (its route with reward.by): a
        built-in's field, of a type it reads; a user function's first record kept for a dry call."""
        r, d = self.cfg.reward, self.cfg.data
        prompt, shown = d.prompt_field, self._shown  # (the record's fields listed only in an error)

        def check(meta: dict) -> None:
            name = r.function
            if r.by is not None:
                try:
                    self._loaded.route(meta)
                except KeyError:
                    raise ValueError(missing_field(shown(meta), r.by, "reward.by", extra=[prompt])) from None
                name = r.table[str(get_field(meta, r.by))]
            field, verl = reads(name), takes_verl_call(name)
            if (field == "answer" or verl) and not has_field(meta, d.answer_field):
                needed = f"which reward {name!r} {'takes as ground_truth' if verl else 'scores against'}"
                raise ValueError(missing_field(shown(meta), d.answer_field, "data.answer_field", needed, [prompt]))
            if verl and "data_source" not in meta:
                needed = f"which reward {name!r} takes as data_source, as verl gives it"
                raise ValueError(missing_field(shown(meta), "data_source", None, needed, [prompt]))
            if field is not None and field not in meta:
                raise ValueError(missing_field(shown(meta), field, None, f"which reward {name!r} reads", [prompt]))
            if problem := value_problem(name, meta):
                raise ValueError(f"{problem} (data.answer_field={d.answer_field})" if field == "answer" else problem)
            if field is None:
                self._first.setdefault((name, key), meta)

        return check

    def _dry_calls(self) -> None:
        """Each user reward called once on the first record it scores in each set (an empty
        response, in a worker bounded as the run's): a KeyError naming a field the record lacks is
        a BadInputError naming the set, the record and the field."""
        r, d = self.cfg.reward, self.cfg.data
        for name in dict.fromkeys(name for name, _ in self._first):
            firsts = [(key, meta) for (each, key), meta in self._first.items() if each == name]
            missing = dry_calls(name, [meta for _, meta in firsts], r.timeout_s, r.memory_mb)
            for (key, meta), field in zip(firsts, missing, strict=True):
                if field is None:
                    continue
                where = self.sources[key].records.where(meta["index"])
                path, named = (d.answer_field, "data.answer_field") if field == "answer" else (field, None)
                why = missing_field(self._shown(meta), path, named, extra=[d.prompt_field])
                raise BadInputError(
                    f"{key}: {where}: reward {name!r} raised KeyError: {field!r} on it (one call before the run, "
                    f"with an empty response): {why}"
                )

    def _shown(self, meta: dict) -> dict:
        """The record as an error lists its fields: without the index the reward is handed, nor the
        copy of data.answer_field's value it gets as "answer"."""
        copied = {"index"} if self.cfg.data.answer_field == "answer" else {"index", "answer"}
        return {k: v for k, v in meta.items() if k not in copied}


def dry_run_check(cfg: JobConfig, spec: ModelSpec) -> list[str]:
    """What `bapo-train --dry-run` says of the data: the run's own checks (RolloutInputs) where
    every data set is on this machine, so that what the dry run accepts the run accepts; else the
    set that is not here (the run checks it before any engine starts). Parquet files are decoded
    into data.cache_dir, as the run would."""
    if cfg.rollout.replay is not None or cfg.algo.loss == "sft":
        return ["data: read by the run's source (rollout.replay or algo.loss=sft), not by the dry run"]
    e = cfg.eval
    paths = [("data.path", cfg.data.path), ("eval.path", e.path)]
    paths += [(f"eval.sets.{name}.path", one.path) for name, one in e.sets.items()]
    for key, path in paths:
        if path is None:
            if key == "data.path":
                return ["data: data.path is not set: not checked (the run needs it)"]
            continue
        try:
            data_files(path, cfg.data.format, key)
        except ValueError as err:
            return [f"data: not checked here ({err}): the run checks every set before any engine starts"]
    inputs = RolloutInputs(cfg, spec)
    out = []
    for key, source in inputs.sources.items():
        read = "every record" if key != "data.path" else f"the first {source.checked_ahead}"
        out.append(
            f"data: {key}={source.config.path}: {len(source)} records, {read} read, rendered and checked "
            f"against reward {cfg.reward.function if cfg.reward.by is None else f'by {cfg.reward.by}'!r}"
        )
    return out

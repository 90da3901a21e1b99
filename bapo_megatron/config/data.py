"""data: the prompt records, where they are and which fields hold what."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from bapo_megatron.errors import ConfigError, check

RENDERER_ARGUMENTS = ("add_generation_prompt", "tokenize", "conversation", "messages")
"""apply_chat_template's arguments that the prompt renderer sets itself: not chat_template_kwargs'."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Prompts: a jsonl or parquet file and which fields hold what; None: the synthetic task."""

    path: str | None = None
    """Prompts, one record each (needed unless rollout.replay is set): a file, a directory of
    shards, or a glob pattern ("data/train-*.parquet")."""
    format: Literal["auto", "jsonl", "json", "parquet"] = "auto"
    """auto: from each file's suffix (.jsonl, .json, .parquet)."""
    prompt_field: str = "prompt"
    """The record's prompt, a dotted path: text (tokenised with the model directory's tokenizer),
    token ids, or a list of chat messages [{"role": ..., "content": ...}] (verl's layout)."""
    answer_field: str = "answer"
    """The record's reference answer, a dotted path ("reward_model.ground_truth"), handed to the
    reward (reward.function) as record["answer"] beside the whole record. Where the reward reads it
    (every built-in does, as text or a number), a record without it is an error before any engine starts."""
    system_prompt: str | None = None
    """A system turn put before chat prompts that have none (text prompts need chat_template)."""
    max_prompt_tokens: int | None = None
    """Prompts longer than this many tokens are dropped, or refused (overlong_prompts)."""
    overlong_prompts: Literal["drop", "error"] = "drop"
    """drop: left out, counted (data/prompts_dropped); error: the run stops naming the record."""
    check_records: int = 1000
    """Training records read, rendered and checked before anything starts (the prompt, and the answer
    and any route the reward reads); the rest when drawn. (An evaluation set's records are all checked
    at the start, and with reward.by every training record's route, by one read of that field.)"""
    cache_dir: str | None = None
    """Where parquet files are kept decoded (Arrow, read a batch at a time; checked against the parquet
    file's size, time and footer hash at every start, decoded again when stale or damaged); None:
    $BAPO_DATA_CACHE, else ~/.cache/bapo-megatron/data. It must be writable with room for the decoded
    file unless it holds a valid cache already: one that cannot be used is an error naming it."""
    shuffle: bool = True
    """Read the prompts in a new random order every epoch (false: in file order)."""
    seed: int = 0
    """Seeds the prompt order (with the epoch): the same seed, the same prompts each step."""
    chat_template: bool = False
    """Wrap each text prompt in the tokenizer's chat template (one user turn, generation prompt)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """More variables for the chat template, wherever prompts are rendered (the loop, evaluate, the
    dry run): {enable_thinking: false} renders Qwen3's prompts with thinking off (the template's
    default is on). verl's data.apply_chat_template_kwargs, read by that name too. Values are
    JSON-like (text, numbers, true/false, null, lists, mappings)."""

    def __post_init__(self) -> None:
        for name in ("prompt_field", "answer_field"):
            value = getattr(self, name)
            check(bool(value) and "" not in value.split("."), name, value, "must be a field name or a dotted path")
        if self.max_prompt_tokens is not None:
            check(self.max_prompt_tokens >= 1, "max_prompt_tokens", self.max_prompt_tokens, "must be >= 1")
        check(self.check_records >= 1, "check_records", self.check_records, "must be >= 1")
        self._check_template_kwargs()

    def _check_template_kwargs(self) -> None:
        """A mapping of variable names to JSON-like values, none of them the renderer's own arguments."""
        options, what = self.chat_template_kwargs, "chat_template_kwargs"
        check(isinstance(options, dict), what, options, "must be a mapping of the template's variables")
        for key, value in options.items():
            check(isinstance(key, str) and key.isidentifier(), what, key, "keys must be variable names")
            if key in RENDERER_ARGUMENTS:
                said = ", ".join(RENDERER_ARGUMENTS)
                raise ConfigError(f"{what}.{key}", value, f"set by the prompt renderer itself ({said})")
            check(
                _json_like(value), f"{what}.{key}", value, "must be text, a number, true/false, null, a list or mapping"
            )

    def template_options(self) -> str:
        """chat_template_kwargs as the start banner says them ("enable_thinking=False"), or "its defaults"."""
        return ", ".join(f"{key}={value!r}" for key, value in self.chat_template_kwargs.items()) or "its defaults"


def _json_like(value: Any) -> bool:
    """Whether `value` is what a JSON document holds (as a chat template's variables are, in verl's configs too)."""
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_json_like(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_like(v) for k, v in value.items())
    return False

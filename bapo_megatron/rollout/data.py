"""Prompts from jsonl or parquet, with a field map and a checkpointed cursor.

Each record gives a prompt (text, tokenized with the model's tokenizer, or a list of token
ids) and the fields a reward needs (the answer). Records are read and checked once, up
front: a missing field or an empty prompt is an error naming the file and line before any
generation starts. Order: shuffled per epoch with (seed, epoch), so a run resumed from its
cursor (epoch, position) sees exactly the prompts the uninterrupted run would have.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bapo_megatron.common.model_spec import ModelSpec
from bapo_megatron.config import DataConfig
from bapo_megatron.errors import BadInputError
from bapo_megatron.fsutil import read_jsonl

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def load_tokenizer(model_dir: str | Path | None):
    """The model directory's tokenizer, or None when it has none. tokenizer.json is read as it is
    (transformers' PreTrainedTokenizerFast), with the chat template and special tokens that
    tokenizer_config.json (or chat_template.jinja) names: AutoTokenizer would pick a class from
    config.json's model type and may rebuild the tokenizer its own way."""
    if model_dir is None:
        return None
    root = Path(model_dir)
    import transformers

    if (root / "tokenizer.json").is_file():
        config_file = root / "tokenizer_config.json"
        extra = json.loads(config_file.read_text()) if config_file.is_file() else {}
        kwargs = {k: v for k, v in extra.items() if k in SPECIAL_TOKENS and isinstance(v, str)}
        if isinstance(extra.get("chat_template"), str):
            kwargs["chat_template"] = extra["chat_template"]
        elif (root / "chat_template.jinja").is_file():
            kwargs["chat_template"] = (root / "chat_template.jinja").read_text()
        return transformers.PreTrainedTokenizerFast(tokenizer_file=str(root / "tokenizer.json"), **kwargs)
    if (root / "tokenizer_config.json").is_file():  # a tokenizer of vocabulary files only
        return transformers.AutoTokenizer.from_pretrained(str(root))
    return None


def check_prompts(
    name: str,
    path: str,
    items: list[tuple[list[int], dict[str, Any]]],
    spec: ModelSpec,
    max_new_tokens: int,
    microbatch_tokens: int | None = None,
) -> None:
    """Every prompt leaves room for max_new_tokens (in the model's context, and in one micro-batch
    of the trainer's) and holds only the model's token ids (BadInputError)."""
    too_long = [i for i, (ids, _) in enumerate(items) if len(ids) + max_new_tokens > spec.max_position_embeddings]
    if too_long:
        raise BadInputError(
            f"{name}={path} record {too_long[0] + 1}: prompt + rollout.sampling.max_new_tokens exceed the "
            f"model's context of {spec.max_position_embeddings} tokens"
        )
    if microbatch_tokens is not None:
        over = [i for i, (ids, _) in enumerate(items) if len(ids) + max_new_tokens > microbatch_tokens]
        if over:
            ids = items[over[0]][0]
            raise BadInputError(
                f"{name}={path} record {over[0] + 1}: its prompt ({len(ids)} tokens) + rollout.sampling."
                f"max_new_tokens ({max_new_tokens}) exceed parallel.max_tokens_per_microbatch={microbatch_tokens}: "
                f"a sample must fit one micro-batch ({len(over)} records are too long)"
            )
    bad_ids = [i for i, (ids, _) in enumerate(items) if any(not 0 <= t < spec.vocab_size for t in ids)]
    if bad_ids:
        raise BadInputError(
            f"{name}={path} record {bad_ids[0] + 1}: a token id outside the model's vocabulary [0, {spec.vocab_size})"
        )


def read_records(path: str | Path, fmt: str) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data.path={path}: no such file")
    if fmt == "jsonl":
        return read_jsonl(path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(f"data.format={fmt!r}: expected jsonl or parquet")


class PromptSource:
    """Prompts in a seeded per-epoch order; `state_dict` is the cursor."""

    def __init__(self, config: DataConfig, tokenize: Callable[[str], list[int]] | None = None) -> None:
        if config.path is None:
            raise ValueError("data.path is not set")
        self.config = config
        self.items: list[tuple[list[int], dict[str, Any]]] = []
        for n, record in enumerate(read_records(config.path, config.format), 1):
            where = f"{config.path} record {n}"
            if config.prompt_field not in record:
                raise ValueError(f"{where}: no field {config.prompt_field!r} (data.prompt_field)")
            prompt = record[config.prompt_field]
            if isinstance(prompt, str):
                if tokenize is None:
                    raise ValueError(f"{where}: the prompt is text and no tokenizer was given")
                ids = tokenize(prompt)
            elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                ids = list(prompt)
            else:
                raise ValueError(f"{where}: {config.prompt_field!r} must be text or a list of token ids")
            if not ids:
                raise ValueError(f"{where}: empty prompt")
            meta = {k: v for k, v in record.items() if k != config.prompt_field}
            if config.answer_field in record:
                meta["answer"] = record[config.answer_field]
            meta["index"] = n - 1
            self.items.append((ids, meta))
        if not self.items:
            raise ValueError(f"data.path={config.path}: no records")
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.config.shuffle:
            return list(range(len(self.items)))
        g = torch.Generator().manual_seed(self.config.seed * 100_003 + epoch)
        return torch.randperm(len(self.items), generator=g).tolist()

    def next(self) -> tuple[str, list[int], dict[str, Any]]:
        """(a unique prompt uid, token ids, metadata); epochs roll over."""
        if self.position == len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        index = self._order[self.position]
        self.position += 1
        ids, meta = self.items[index]
        return f"e{self.epoch}-{index}", list(ids), dict(meta)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "records": len(self.items)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["records"] != len(self.items):
            raise ValueError(
                f"data cursor saved over {state['records']} records, {self.config.path} has "
                f"{len(self.items)}: not the same data"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)

"""Prompts from the records of a data set (data/records.py), with a field map and a
checkpointed cursor.

A record's prompt (data.prompt_field, a dotted path) is text, a list of token ids, or a list
of chat messages ({"role", "content"}); text and messages are rendered with the model
directory's tokenizer (messages, and text under data.chat_template, through its chat template,
with data.system_prompt as the first turn when given and data.chat_template_kwargs as its
variables) and tokenized when the record is drawn. Every reader of prompts (the loop, evaluate,
the dry run) renders them here.
The whole record goes to the reward, with the answer (data.answer_field) as record["answer"].

The first data.check_records records (in file order) are read, rendered and checked before
anything else starts, so a field map, a template or a layout that cannot work is one error
naming the record; the rest are checked as they are drawn. A prompt longer than
data.max_prompt_tokens is dropped (counted) or refused (data.overlong_prompts); one that cannot
fit the model's context or a micro-batch with rollout.sampling.max_new_tokens is refused.
Order: shuffled per epoch with (seed, epoch), so a run resumed from its cursor (epoch,
position) sees exactly the prompts the uninterrupted run would have.
"""

from __future__ import annotations

import difflib
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bapo_megatron.common.fields import MissingField, get_field, has_field
from bapo_megatron.common.hf_io import refuse_remote_code_in
from bapo_megatron.config import DataConfig
from bapo_megatron.data.records import open_records
from bapo_megatron.errors import BadInputError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def load_tokenizer(model_dir: str | Path | None):
    """The model directory's tokenizer, or None when it has none. tokenizer.json is read as it is
    (transformers' PreTrainedTokenizerFast), with the chat template and special tokens that
    tokenizer_config.json (or chat_template.jinja) names: AutoTokenizer would pick a class from
    config.json's model type and may rebuild the tokenizer its own way."""
    if model_dir is None:
        return None
    root = Path(model_dir)
    refuse_remote_code_in(root)  # auto_map: code of the directory that transformers would import
    import transformers

    if (root / "tokenizer.json").is_file():
        config_file = root / "tokenizer_config.json"
        extra = json.loads(config_file.read_text()) if config_file.is_file() else {}
        kwargs = {k: v for k, v in extra.items() if k in SPECIAL_TOKENS and isinstance(v, str)}
        if isinstance(extra.get("chat_template"), str):
            kwargs["chat_template"] = extra["chat_template"]
        elif (root / "chat_template.jinja").is_file():
            kwargs["chat_template"] = (root / "chat_template.jinja").read_text()
        # name_or_path: the directory, as from_pretrained records it; template_file reads it for errors
        return transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(root / "tokenizer.json"), name_or_path=str(root), **kwargs
        )
    if (root / "tokenizer_config.json").is_file():  # a tokenizer of vocabulary files only
        return transformers.AutoTokenizer.from_pretrained(str(root), trust_remote_code=False)
    return None


def template_file(tokenizer) -> str:
    """Where `tokenizer`'s chat template was read from, for errors: its model directory's
    tokenizer_config.json (a chat_template in it) or chat_template.jinja, as load_tokenizer reads
    them; else the tokenizer's name."""
    name = str(getattr(tokenizer, "name_or_path", "") or "")
    root = Path(name)
    if name and root.is_dir():
        config = root / "tokenizer_config.json"
        try:
            if isinstance(json.loads(config.read_text()).get("chat_template"), str):
                return str(config)
        except (OSError, ValueError, AttributeError):
            pass
        if (root / "chat_template.jinja").is_file():
            return str(root / "chat_template.jinja")
    return f"the chat template of tokenizer {name!r}" if name else "the tokenizer's chat template"


@dataclass(frozen=True)
class PromptLimits:
    """What every prompt must satisfy beyond data.max_prompt_tokens: ids in the vocabulary, and a
    hard length (the model's context, a micro-batch, less the new tokens), with its reason."""

    vocab_size: int | None = None
    max_tokens: int | None = None
    reason: str = ""


class Overlong(ValueError):
    """A prompt longer than data.max_prompt_tokens (dropped when data.overlong_prompts is drop)."""


class Renderer:
    """A record's prompt value -> token ids: text, token ids or chat messages."""

    def __init__(self, config: DataConfig, tokenizer=None, tokenize: Callable[[str], list[int]] | None = None) -> None:
        self.config, self.tokenizer, self.tokenize = config, tokenizer, tokenize
        if tokenize is None and tokenizer is not None:
            self.tokenize = lambda text: tokenizer.encode(text, add_special_tokens=False)
        unread = unread_variables(tokenizer, config.chat_template_kwargs)
        if unread:
            warnings.warn(
                f"data.chat_template_kwargs: {template_file(tokenizer)} never reads {', '.join(unread)}: no effect",
                stacklevel=3,
            )

    def __call__(self, prompt: Any) -> list[int]:
        c = self.config
        if isinstance(prompt, str):
            if c.chat_template:
                return self._chat([{"role": "user", "content": prompt}])
            if c.system_prompt is not None:
                raise ValueError("data.system_prompt applies to chat prompts: set data.chat_template=true")
            return self._text(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            return self._chat(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if c.system_prompt is not None:
                raise ValueError("data.system_prompt cannot be added to a prompt of token ids")
            return list(prompt)
        raise ValueError(
            f"{c.prompt_field!r} must be text, a list of token ids or a list of chat messages "
            f"({{'role': ..., 'content': ...}}); got {_kind(prompt)}"
        )

    def _text(self, text: str) -> list[int]:
        if self.tokenize is None:
            raise ValueError(
                "the prompt is text and no tokenizer was given: set model.hf_path to a model directory with "
                "one (tokenizer.json or tokenizer_config.json)"
            )
        return self.tokenize(text)

    def _chat(self, messages: list[dict]) -> list[int]:
        for n, m in enumerate(messages, 1):
            if set(m) - {"role", "content"} - {"name", "tool_calls", "tool_call_id"} or not isinstance(
                m.get("role"), str
            ):
                raise ValueError(f"message {n} must be {{'role': str, 'content': str}}; got keys {sorted(m)}")
            if not isinstance(m.get("content"), str):
                raise ValueError(f"message {n} ({m['role']}) has no text content; got {_kind(m.get('content'))}")
        if self.config.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.config.system_prompt}, *messages]
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "chat messages need the model directory's chat template (tokenizer_config.json's chat_template "
                "or chat_template.jinja), and there is none: set model.hf_path to a model directory that has one "
                "(`python -m bapo_megatron.tasks verl-data DIR` writes a tiny one, DIR/model)"
            )
        options = self.config.chat_template_kwargs
        try:  # the model directory's template: a syntax error, its raise_exception(...), the sandbox's refusal
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **options)
        except Exception as err:
            said = " ".join(str(err).split())
            line = f" (line {err.lineno})" if getattr(err, "lineno", None) else ""
            given = f" with data.chat_template_kwargs {self.config.template_options()}" if options else ""
            raise ValueError(
                f"the chat template ({template_file(self.tokenizer)}) does not render its messages{given}: "
                f"{type(err).__name__}{line}: {said}"
            ) from None
        return self._text(text)  # the template wrote any special tokens itself: encoded as they are


def unread_variables(tokenizer, options: dict[str, Any]) -> list[str]:
    """The keys of `options` (data.chat_template_kwargs) that `tokenizer`'s chat template never reads:
    jinja ignores a variable a template does not name, so such a key changes nothing. None are said
    of a template that does not parse here (rendering it says why)."""
    template = getattr(tokenizer, "chat_template", None)
    if not options or not isinstance(template, str):
        return []
    import jinja2
    import jinja2.meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:  # parsed as transformers compiles chat templates (its sandbox, loop controls)
        parsed = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:
        return []
    return sorted(set(options) - jinja2.meta.find_undeclared_variables(parsed))


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return f"a list of {type(value[0]).__name__}" if value else "an empty list"
    return type(value).__name__


VERL_ANSWER = "reward_model.ground_truth"
"""Where verl's data sets keep the reference answer."""


def field_paths(record: dict[str, Any], prefix: str = "", depth: int = 3) -> list[str]:
    """The dotted paths of a record's fields: nested dicts' leaves, `depth` levels down."""
    out = []
    for key, value in record.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and depth > 1:
            out += field_paths(value, f"{path}.", depth - 1)
        else:
            out.append(path)
    return out


def missing_field(
    record: dict[str, Any], path: str, key: str | None, needed: str = "", extra: Any = (), shown: int = 12
) -> str:
    """Dotted `path` (config key `key`, if any) absent from `record`, said with why it is `needed`,
    the record's fields (and those in `extra`) and the closest one: "no field 'answer'
    (data.answer_field), which reward 'dapo' scores against; the record has prompt,
    reward_model.ground_truth; verl's layout: set data.answer_field=reward_model.ground_truth"."""
    parts, value, detail = path.split("."), record, None
    for i, part in enumerate(parts):
        if not isinstance(value, dict) or part not in value:
            detail = f"{'.'.join(parts[:i])} has no {part!r}" if i else None
            break
        value = value[part]
    said = "; ".join(s for s in (key, detail) if s)
    paths = sorted({*field_paths(record), *extra} - {path})
    listed = ", ".join(paths[:shown]) + (f" and {len(paths) - shown} more" if len(paths) > shown else "")
    text = f"no field {path!r}{f' ({said})' if said else ''}{f', {needed}' if needed else ''}"
    text += f"; the record has {listed or 'no fields'}"
    if key == "data.answer_field" and VERL_ANSWER in paths:
        return f"{text}; verl's layout: set {key}={VERL_ANSWER}"
    close = difflib.get_close_matches(path, paths, n=1, cutoff=0.6)
    if not close:  # the same last part elsewhere ("ground_truth" for "reward_model.ground_truth")
        last = path.rsplit(".", 1)[-1]
        close = [p for p in paths if p.rsplit(".", 1)[-1] == last][:1]
    if not close:
        return text
    return f"{text}; did you mean {key}={close[0]}?" if key else f"{text}; did you mean {close[0]!r}?"


class PromptSource:
    """Prompts in a seeded per-epoch order over the records; `state_dict` is the cursor."""

    def __init__(
        self,
        config: DataConfig,
        tokenize: Callable[[str], list[int]] | None = None,
        *,
        tokenizer=None,
        limits: PromptLimits = PromptLimits(),
        field: str = "data.path",
        check: Callable[[dict[str, Any]], None] | None = None,
        check_field: str | None = None,
    ) -> None:
        """field: the config key that gave config.path, named by every error. check: more to ask of
        each record checked ahead and of each one `first` returns (its reward route): ValueError if
        wanting. check_field: the one field `check` reads; given, every record's value of it is
        checked now too (one read of that field: the first record of each value is checked)."""
        if config.path is None:
            raise ValueError(f"{field} is not set")
        self.config, self.limits, self.field, self.check = config, limits, field, check
        self.render = Renderer(config, tokenizer, tokenize)
        self.records = open_records(config.path, config.format, config.cache_dir, field)
        self.dropped = 0
        """Prompts over data.max_prompt_tokens left out so far (drop mode), checked ahead included."""
        ahead = min(len(self.records), config.check_records)
        checked = 0
        for i in range(ahead):
            try:
                _, meta = self.item(i)
                checked += 1
            except Overlong:
                self.dropped += 1
                continue
            self._check(i, meta)
        if not checked:
            raise ValueError(
                f"{field}={config.path}: every one of the first {ahead} prompts is longer than "
                f"data.max_prompt_tokens={config.max_prompt_tokens}"
            )
        if check_field is not None:
            for i in sorted(self.records.first_of_each(check_field).values()):
                if i >= ahead:
                    self._check(i, self._meta(self._record(i), i))
        self.checked_ahead = ahead
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _check(self, index: int, meta: dict[str, Any]) -> None:
        if self.check is not None:
            try:
                self.check(meta)
            except ValueError as err:
                raise ValueError(f"{self.field}: {self.records.where(index)}: {err}") from None

    def _record(self, index: int) -> dict[str, Any]:
        try:
            return self.records.record(index)
        except ValueError as err:
            raise ValueError(f"{self.field}: {err}") from None

    def _meta(self, record: dict[str, Any], index: int) -> dict[str, Any]:
        """The record as the reward gets it: without the prompt, with the answer and the index."""
        c = self.config
        meta = dict(record)
        if c.prompt_field in meta:
            del meta[c.prompt_field]
        if has_field(record, c.answer_field):
            meta["answer"] = get_field(record, c.answer_field)
        meta["index"] = index
        return meta

    def __len__(self) -> int:
        return len(self.records)

    def item(self, index: int) -> tuple[list[int], dict[str, Any]]:
        """Record `index` (file order) as (token ids, the record for the reward); ValueError naming
        the record, Overlong past data.max_prompt_tokens in drop mode."""
        c = self.config
        where = f"{self.field}: {self.records.where(index)}"
        record = self._record(index)
        try:
            prompt = get_field(record, c.prompt_field)
        except MissingField:
            raise ValueError(f"{where}: {missing_field(record, c.prompt_field, 'data.prompt_field')}") from None
        try:
            ids = self.render(prompt)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        if not ids:
            raise ValueError(f"{where}: empty prompt")
        lim = self.limits
        if lim.vocab_size is not None and any(not 0 <= t < lim.vocab_size for t in ids):
            raise ValueError(f"{where}: a token id outside the model's vocabulary [0, {lim.vocab_size})")
        if c.max_prompt_tokens is not None and len(ids) > c.max_prompt_tokens:
            if c.overlong_prompts == "drop":
                raise Overlong(where)
            raise ValueError(
                f"{where}: its prompt has {len(ids)} tokens, more than data.max_prompt_tokens={c.max_prompt_tokens} "
                "(data.overlong_prompts=drop leaves such prompts out)"
            )
        if lim.max_tokens is not None and len(ids) > lim.max_tokens:
            raise ValueError(f"{where}: its prompt ({len(ids)} tokens) {lim.reason}")
        return ids, self._meta(record, index)

    def first(self, count: int | None = None) -> list[tuple[list[int], dict[str, Any]]]:
        """The first `count` usable records in file order (all: None), overlong ones left out (an
        evaluation set, the probe's prompt), each checked as those checked ahead are: ValueError
        naming the first that cannot work."""
        out = []
        for i in range(len(self.records)):
            if count is not None and len(out) == count:
                break
            try:
                ids, meta = self.item(i)
            except Overlong:
                continue
            if i >= self.checked_ahead:
                self._check(i, meta)
            out.append((ids, meta))
        return out

    def _permutation(self, epoch: int) -> torch.Tensor:
        if not self.config.shuffle:
            return torch.arange(len(self.records))
        g = torch.Generator().manual_seed(self.config.seed * 100_003 + epoch)
        return torch.randperm(len(self.records), generator=g)

    def next(self) -> tuple[str, list[int], dict[str, Any]]:
        """(a unique prompt uid, token ids, metadata); epochs roll over. Prompts over
        data.max_prompt_tokens are passed over (drop mode) and counted in `dropped`."""
        for _ in range(len(self.records) + 1):
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            index = int(self._order[self.position])
            self.position += 1
            try:
                ids, meta = self.item(index)
            except Overlong:
                if self.epoch == 0 and index >= self.checked_ahead:
                    self.dropped += 1
                continue
            except ValueError as err:
                raise BadInputError(str(err)) from None
            return f"e{self.epoch}-{index}", ids, meta
        raise BadInputError(f"{self.field}={self.config.path}: every prompt is over data.max_prompt_tokens")

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "records": len(self.records), "dropped": self.dropped}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["records"] != len(self.records):
            raise ValueError(
                f"data cursor saved over {state['records']} records, {self.config.path} has "
                f"{len(self.records)}: not the same data"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.dropped = int(state.get("dropped", self.dropped))
        self._order = self._permutation(self.epoch)

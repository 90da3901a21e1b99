"""Reading a job config: YAML file plus dotted overrides (`algo.bapo.target_rho=0.4`) into the sections.

    cfg = load_config("examples/tiny_online.yaml", ["parallel.tensor=2", "algo.loss=ppo"])

Every section is a keyword-only dataclass that validates itself; an unknown key is rejected
with the closest valid name (or where a field of an earlier layout went), and an invalid value
raises ConfigError (a ValueError) naming the dotted field and the value.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml

from bapo_megatron.algo.bapo import PRESETS as BAPO_PRESETS
from bapo_megatron.algo.bapo import BAPOConfig
from bapo_megatron.config.job import JobConfig
from bapo_megatron.errors import UNKNOWN_KEY, ConfigError

SECTION_PRESETS: dict[type, dict[str, Any]] = {BAPOConfig: BAPO_PRESETS}
"""Sections that accept a `preset: NAME` key whose fields the other keys override."""


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


MOVED = {
    "rollout.max_new_tokens": "rollout.sampling.max_new_tokens",
    "rollout.temperature": "rollout.sampling.temperature",
    "rollout.top_p": "rollout.sampling.top_p",
    "rollout.top_k": "rollout.sampling.top_k",
    "rollout.token_budget": "rollout.partial.token_budget",
    "rollout.partial_mode": "rollout.partial.mode",
    "rollout.engine": "rollout.engines.kind",
    "rollout.engine_urls": "rollout.engines.urls",
    "rollout.engine_max_batch": "rollout.engines.max_batch",
    "rollout.servers": "rollout.engines.servers",
    "rollout.tensor_parallel": "rollout.engines.tensor_parallel",
    "rollout.host": "rollout.engines.host",
    "rollout.port": "rollout.engines.port",
    "rollout.colocate": "rollout.engines.colocate",
    "rollout.mem_fraction_static": "rollout.engines.mem_fraction_static",
    "rollout.admin_key_file": "rollout.engines.admin_key_file",
    "rollout.sglang_args": "rollout.engines.sglang_args",
    "rollout.request_timeout_s": "rollout.engines.request_timeout_s",
    "rollout.startup_timeout_s": "rollout.engines.startup_timeout_s",
    "rollout.sync_host": "rollout.sync.host",
    "rollout.sync_bucket_mb": "rollout.sync.bucket_mb",
    "rollout.sync_check_every": "rollout.sync.check_every",
    "rollout.sync_check_max_gap": "rollout.sync.check_max_gap",
    "data.reward": "reward.function",
    "data.reward_by": "reward.by",
    "data.rewards": "reward.table",
    "data.overlong_buffer": "reward.overlong_buffer",
    "data.overlong_penalty_factor": "reward.overlong_penalty_factor",
    "data.reward_workers": "reward.workers",
    "data.reward_timeout_s": "reward.timeout_s",
    "data.reward_memory_mb": "reward.memory_mb",
    "data.reward_range": "reward.range",
    "data.max_reward_failure_share": "reward.max_failure_share",
    "data.reward_failure_steps": "reward.failure_steps",
    "reward.routes": "reward.table",
    "data.apply_chat_template_kwargs": "data.chat_template_kwargs",
}
"""Fields of an earlier layout and where they are now: a config that still names one is told where."""
STILL_READ = frozenset({"reward.routes", "data.apply_chat_template_kwargs"})
"""MOVED fields read into their new place (in the same section), with a warning, not refused:
every config.yaml a run saved before the rename names reward.routes (`evaluate --config` and a
rerun read them)."""
VERL_NAMES = frozenset({"data.apply_chat_template_kwargs"})
"""STILL_READ fields that are verl's names, read without a warning: a verl config's keys work key for key."""


def _new_name(path: str, key: str) -> str | None:
    """The field's name now when `path`.`key` is a STILL_READ one (with a FutureWarning unless it is
    verl's name), else None."""
    dotted = f"{path}.{key}" if path else key
    if dotted not in STILL_READ:
        return None
    if dotted not in VERL_NAMES:
        warnings.warn(f"{dotted} is now called {MOVED[dotted]}: read as that", FutureWarning, stacklevel=3)
    return MOVED[dotted].rpartition(".")[2]


def _unknown_key(path: str, key: str, valid: list[str]) -> ConfigError:
    dotted = f"{path}.{key}" if path else key
    if dotted in MOVED:
        return ConfigError(dotted, UNKNOWN_KEY, f"moved to {MOVED[dotted]}")
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(sorted(valid))}"
    return ConfigError(f"{path}.{key}" if path else key, UNKNOWN_KEY, hint)


def _coerce(value: Any, hint: Any, path: str) -> Any:
    """`value` as type `hint`, or ConfigError naming `path`."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return build(hint, value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _coerce(value, option, path)
            except ConfigError as err:
                errors.append(err.reason)
        raise ConfigError(path, value, " or ".join(errors))
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint_text = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(path, value, f"must be one of {list(args)}{hint_text}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, value, "must be a mapping")
        return {str(k): _coerce(v, args[1] if args else Any, f"{path}.{k}") for k, v in value.items()}
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            value = [value]
        if args and args[-1] is not Ellipsis:  # a fixed length: (low, high)
            if len(value) != len(args):
                raise ConfigError(path, value, f"must be {len(args)} values")
            return tuple(_coerce(v, item, f"{path}[{i}]") for i, (v, item) in enumerate(zip(value, args, strict=True)))
        item = args[0] if args else Any
        return tuple(_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value))
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, value, "must be true or false")
        return value
    if hint in (int, float) and isinstance(value, str):
        value = _number_from_text(value, hint, path)  # YAML 1.1 reads 1e-6 as text
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, value, "must be an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, value, "must be a number")
        if not math.isfinite(value):  # lr=inf, a NaN: no setting of this package means "unbounded" by inf
            raise ConfigError(path, value, "must be a finite number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(path, value, "must be a string")
        return value
    raise TypeError(f"config field {path} has a type the loader does not handle: {hint!r}")


def _number_from_text(text: str, hint: type, path: str) -> Any:
    try:
        number = float(text)
    except ValueError:
        return text  # reported below as not a number
    if hint is int:
        return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else text
    return number


def build(cls: type, data: Any, path: str = "") -> Any:
    """An instance of dataclass `cls` from a mapping, validated, errors naming dotted fields."""
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path or cls.__name__, data, f"must be a mapping of {cls.__name__} fields")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    data = dict(data)
    base: dict[str, Any] = {}
    presets = SECTION_PRESETS.get(cls)
    if presets is not None and "preset" in data:
        preset = data.pop("preset")
        if preset not in presets:
            raise ConfigError(f"{path}.preset" if path else "preset", preset, f"must be one of {sorted(presets)}")
        base = {name: getattr(presets[preset], name) for name in names}
    kwargs = dict(base)
    for key, value in data.items():
        if key not in names and (new := _new_name(path, key)) is not None:
            if new in data:
                said = f"verl's name for {new}" if f"{path}.{key}" in VERL_NAMES else f"{new}'s old name"
                raise ConfigError(f"{path}.{key}" if path else key, value, f"is {said}, and {new} is set too")
            key = new
        if key not in names:
            raise _unknown_key(path, key, names + (["preset"] if presets else []))
        kwargs[key] = _coerce(value, hints[key], f"{path}.{key}" if path else key)
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.within(path) from None


def to_dict(obj: Any) -> Any:
    """Plain data (dicts, lists, scalars) of a config, loadable again by `build`."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    return obj


def dotted(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested plain data as dotted keys ({"a": {"b": 1}} -> {"a.b": 1}), under `prefix` when given;
    an empty mapping is a value of its own (as run.json holds one)."""
    if not isinstance(data, dict) or not data:
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(dotted(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _set_dotted(data: dict, dotted: str, value: Any, cls: type) -> None:
    """Set data[a][b][c] = value for 'a.b.c', checking each name against the dataclass fields; a
    mapping field takes one free key ('rollout.engines.sglang_args.x=1') or, when its values are
    sections, a key and a path into it ('eval.sets.aime24.path=...')."""
    keys = dotted.split(".")
    node, node_cls, path, i = data, cls, "", 0
    while True:
        key = keys[i]
        names = [f.name for f in dataclasses.fields(node_cls)]
        allowed = names + (["preset"] if node_cls in SECTION_PRESETS else [])
        if key not in allowed and (new := _new_name(path, key)) is not None:
            if key in node and new not in node:  # the file's old name and the override's meet under the new one
                node[new] = node.pop(key)
            key = new
        if key not in allowed:
            raise _unknown_key(path, key, allowed)
        path = f"{path}.{key}" if path else key
        if i == len(keys) - 1:
            node[key] = value
            return
        hint = _hints(node_cls).get(key)
        mapping = typing.get_origin(hint) is dict
        sections = mapping and dataclasses.is_dataclass(typing.get_args(hint)[1])
        if not ((mapping and i == len(keys) - 2) or sections or (hint and dataclasses.is_dataclass(hint))):
            raise ConfigError(dotted, value, f"{path!r} is a value, not a section")
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict):
            raise ConfigError(path, child, "must be a mapping")
        if mapping and i == len(keys) - 2:  # one key into a free-form mapping (or a whole section)
            child[keys[-1]] = value
            return
        if sections:  # a named section of the mapping, then its fields
            name = keys[i + 1]
            entry = child.get(name)
            if entry is None:
                entry = child[name] = {}
            elif not isinstance(entry, dict):
                raise ConfigError(f"{path}.{name}", entry, "must be a mapping")
            node, node_cls, path, i = entry, typing.get_args(hint)[1], f"{path}.{name}", i + 2
            continue
        node, node_cls, i = child, hint, i + 1


def parse_override(text: str) -> tuple[str, Any]:
    """'a.b=value' -> ('a.b', value), the value read as YAML (0.4, true, null, [1, 2], text); a
    value that is not YAML (">=0.2") is its text."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError("override", text, "must look like section.field=value")
    try:
        return key.strip(), yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return key.strip(), raw.strip()


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """A JobConfig from an optional YAML file and dotted overrides applied on top."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("config", str(path), "no such file")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise ConfigError("config", str(path), f"not valid YAML: {' '.join(str(err).split())}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError("config", str(path), "the YAML file must hold a mapping at its top level")
        data = loaded or {}
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(data, key, value, JobConfig)
    return build(JobConfig, data)


def dump_config(config: JobConfig) -> str:
    """The resolved config as YAML (saved beside checkpoints and in logs)."""
    return yaml.safe_dump(to_dict(config), sort_keys=False)

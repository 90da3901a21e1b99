"""Dotted field paths into a record (`reward_model.ground_truth`), as data files and rewards name them."""

from __future__ import annotations

from typing import Any


class MissingField(KeyError):
    """A dotted field path that a record does not have."""


def get_field(record: dict[str, Any], path: str) -> Any:
    """The value at dotted `path` ("reward_model.ground_truth"); a key holding the whole dotted
    name is taken first. MissingField naming the first part that is absent."""
    if path in record:
        return record[path]
    value: Any = record
    parts = path.split(".")
    for i, part in enumerate(parts):
        if not isinstance(value, dict) or part not in value:
            if len(parts) == 1:
                raise MissingField(f"no field {path!r}")
            where = ".".join(parts[:i]) or "the record"
            raise MissingField(f"no field {path!r} ({where} has no {part!r})")
        value = value[part]
    return value


def has_field(record: dict[str, Any], path: str) -> bool:
    try:
        get_field(record, path)
    except MissingField:
        return False
    return True

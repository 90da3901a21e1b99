"""`bapo-train --help-config`: every config field with its type, default and docstring.

    print(help_config())
    config_fields(JobConfig)   # (dotted name, type, default, doc) of every field

The list is generated from the dataclasses and the docstring under each field, never kept by hand.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing

from bapo_megatron.config import SECTION_PRESETS, JobConfig


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it in the class body), inherited ones too."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError):
            continue
        for node, following in zip(body, [*body[1:], None], strict=True):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                doc = (
                    following.value.value
                    if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    else ""
                )
                docs[node.target.id] = " ".join(str(doc).split())
    return docs


def _type_name(hint) -> str:
    text = str(hint).replace("typing.", "").replace("NoneType", "None")
    return text if "[" in text or "|" in text else getattr(hint, "__name__", text)


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "(section)" if dataclasses.is_dataclass(value) else repr(value)
    return "(required)"


def config_fields(cls: type = JobConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted name, type, default, doc) of every field, sections expanded; a section that takes a
    `preset: NAME` key lists it first."""
    hints, docs, rows = typing.get_type_hints(cls), field_docs(cls), []
    if cls in SECTION_PRESETS:
        names = ", ".join(sorted(SECTION_PRESETS[cls]))
        doc = f"A named set of this section's fields ({names}), which its other keys override (None: the defaults)."
        rows.append((prefix + "preset", "str | None", "None", doc))
    for f in dataclasses.fields(cls):
        name, hint = prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(hint):
            rows += config_fields(hint, name + ".")
        else:
            rows.append((name, _type_name(hint), _default(f), docs.get(f.name, "")))
    return rows


def help_config() -> str:
    lines = ["Every field (dotted name, type, default), settable in the YAML file or as key=value:", ""]
    for name, type_name, default, doc in config_fields():
        lines.append(f"{name}: {type_name} = {default}")
        if doc:
            lines.extend("    " + line for line in textwrap.wrap(doc, 96))
    return "\n".join(lines)

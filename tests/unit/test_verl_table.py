"""README's "From verl" table: every field its "here" column names is a config field (what
--help-config lists), and every key its "verl" column names is one of verl's own (the generated
trainer config of verl's released wheel; skipped when the registry cannot be reached)."""

import re
import zipfile
from pathlib import Path

import pytest
import yaml

from bapo_megatron.cli import config_fields

ROOT = Path(__file__).resolve().parents[2]
VERL_CONFIG = "verl/trainer/config/_generated_ppo_megatron_trainer.yaml"


def table() -> list[tuple[list[str], list[str]]]:
    """(verl keys, our fields) of each row: the names in backticks of its first and second cells."""
    section = (ROOT / "README.md").read_text().split("\n## From verl\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = line.split("|")
        if line.startswith("| `") and len(cells) == 5:
            rows.append(tuple(re.findall(r"`([^`]+)`", cell) for cell in cells[1:3]))
    return rows


def verl_keys(names: list[str]) -> list[str]:
    """A cell's keys in full: `a_r_r.` is actor_rollout_ref., and a name without a dot is a sibling of
    the key before it (`a_r_r.rollout.temperature`, `top_p`)."""
    full, parent = [], ""
    for name in names:
        name = name.replace("a_r_r.", "actor_rollout_ref.")
        if "." in name:
            parent = name.rpartition(".")[0]
        full.append(name if "." in name else f"{parent}.{name}")
    return full


def test_every_field_the_table_names_is_a_config_field():
    rows = table()
    assert len(rows) >= 40, "the table was not found"
    fields = {name for name, *_ in config_fields()}
    named = {field for _, ours in rows for field in ours}
    missing = sorted(named - fields)
    assert not missing, f"README's From verl table names fields that do not exist: {missing}"


def test_every_verl_key_the_table_names_is_in_verls_config():
    from tests.helpers import VERL_VERSION
    from tests.sglang_wheel import WheelUnavailable, wheel_path

    try:
        wheel = wheel_path("verl", VERL_VERSION)
    except WheelUnavailable as err:
        pytest.skip(str(err))
    with zipfile.ZipFile(wheel) as whl:
        config = yaml.safe_load(whl.read(VERL_CONFIG))

    def leaves(node, prefix: str = ""):
        for key, value in node.items():
            nested = isinstance(value, dict) and value  # an empty mapping ({}: apply_chat_template_kwargs) is a key
            yield from leaves(value, f"{prefix}{key}.") if nested else [prefix + key]

    known = set(leaves(config))
    keys = [key for theirs, _ in table() for key in verl_keys(theirs)]
    unknown = [k for k in keys if not (k in known or (k.endswith(".*") and any(n.startswith(k[:-1]) for n in known)))]
    assert not unknown, f"not keys of verl {VERL_VERSION}: {unknown}"

"""Qwen3.5-MoE's config.json has no dense width: transformers' Qwen3_5MoeTextConfig has no
intermediate_size (every layer routes), and the released config none; the family reads it without
one (the preset's shape is the released layout). Qwen3-Next, whose dense layers use it, still needs it."""

import json
from pathlib import Path

import pytest

from bapo_megatron.errors import ConfigError
from bapo_megatron.models import family_of
from bapo_megatron.models.spec import ModelSpec

SHAPE = Path(__file__).resolve().parents[2] / "examples" / "qwen3.5-35b-a3b" / "shape"


def test_transformers_has_no_dense_width_for_qwen3_5_moe():
    import dataclasses

    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    fields = {f.name for f in dataclasses.fields(Qwen3_5MoeTextConfig)}
    assert "moe_intermediate_size" in fields and "intermediate_size" not in fields


def test_the_released_layout_without_intermediate_size_is_read():
    text = json.loads((SHAPE / "config.json").read_text())["text_config"]
    assert "intermediate_size" not in text
    spec = ModelSpec.from_hf_dir(SHAPE)
    assert spec.moe.ffn_hidden_size == 512 and spec.moe.sparse_layers == tuple(range(40))


def test_qwen3_next_still_needs_its_dense_width():
    family = family_of("qwen3_next")
    hf = family.to_hf(family.tiny())
    del hf["intermediate_size"]
    with pytest.raises(ConfigError, match=r"intermediate_size=None: missing from config.json"):
        family.read(hf)

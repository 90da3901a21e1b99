"""The model families (models/): every family answers every question, nothing outside models/
branches on a family's features, and a new family is one class that the spec reader, the weight
maps and the HF shapes pick up without another edit."""

import ast
import inspect
from pathlib import Path

import pytest
import torch
import transformers

from bapo_megatron.common.hf_io import expected_shapes
from bapo_megatron.errors import ConfigError
from bapo_megatron.models import FAMILIES, Family, family_for_hf, family_of
from bapo_megatron.models.llama import Llama
from bapo_megatron.models.spec import ModelSpec, tiny_spec
from bapo_megatron.tasks import tiny_config
from bapo_megatron.trainer.memory.estimate import layer_params
from bapo_megatron.weights.layout import hf_to_megatron, megatron_recipes, megatron_to_hf

PACKAGE = Path(__file__).resolve().parents[2] / "bapo_megatron"
QUESTIONS = sorted(Family.__abstractmethods__)
FEATURE_FLAGS = {"qk_norm", "qkv_bias", "is_moe_layer"}
"""A family's features: only its family reads them (the rest of the package asks the family)."""


def random_hf(spec: ModelSpec) -> dict[str, torch.Tensor]:
    return {name: torch.randn(shape) for name, shape in expected_shapes(spec).items()}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_answers_every_question(name):
    family = FAMILIES[name]
    assert len(QUESTIONS) >= 14 and not inspect.isabstract(type(family)), type(family).__abstractmethods__
    spec = family.tiny()
    assert spec.architecture == family.name and family_of(spec) is family
    hf = family.to_hf(spec)
    assert family_for_hf(hf) is family and ModelSpec.from_hf_config(hf) == spec
    assert transformers.AutoConfig.for_model(**hf).model_type == family.name  # transformers reads it too
    for layer in range(spec.num_layers):
        shapes = family.hf_layer_shapes(spec, layer)
        held = layer_params(spec, layer)
        assert held.tensor + held.replicated + held.router + held.experts == sum(
            torch.Size(s).numel() for s in shapes.values()
        )
        for impl in ("local", "transformer_engine"):
            read = {n for r in family.layer_recipes(spec, layer, impl, grouped=False).values() for n in r.names}
            assert read == set(shapes), (layer, impl)
        assert family.stored_layer_shapes(spec, layer) and len(family.norm_names(spec, layer, "local")) == 2
        assert isinstance(family.routed(spec, layer), bool)
    fields = family.transformer_fields(spec)
    assert fields["num_layers"] == spec.num_layers and fields["kv_channels"] == spec.head_dim
    assert family.normed_qk_width(spec) >= 0
    task = family.task_model(vocab_size=16, max_positions=64)
    assert family_of(ModelSpec.from_hf_config(tiny_config(name))) is family and task.architecture == name
    hf_tensors = random_hf(spec)
    back = megatron_to_hf(spec, hf_to_megatron(spec, hf_tensors, padded_vocab=256))
    assert back.keys() == hf_tensors.keys() and all(torch.equal(back[k], hf_tensors[k]) for k in back)


def test_the_families_answer_their_own_features():
    """What used to be flags read across the package is each family's answer."""
    assert FAMILIES["qwen2"].transformer_fields(tiny_spec("qwen2"))["add_qkv_bias"]
    assert FAMILIES["qwen3"].transformer_fields(tiny_spec("qwen3"))["qk_layernorm"]
    moe = tiny_spec("qwen3_moe")
    assert [FAMILIES["qwen3_moe"].routed(moe, i) for i in range(4)] == [False, True, True, True]
    assert FAMILIES["qwen3_moe"].transformer_fields(moe)["moe_layer_freq"] == [0, 1, 1, 1]
    with pytest.raises(ValueError, match="mixture-of-experts"):
        FAMILIES["qwen3_moe"].check_sglang_tp(moe, 1)
    FAMILIES["llama"].sglang_layer_shapes(tiny_spec("llama"), 0, 2)


def test_one_error_names_every_supported_architecture_and_model_type_stands_in():
    with pytest.raises(ConfigError, match=r"MistralForCausalLM.*not mapped; supported: \[.*'LlamaForCausalLM', "):
        ModelSpec.from_hf_config({"architectures": ["MistralForCausalLM"]})
    hf = tiny_spec("qwen3").to_hf_config()
    del hf["architectures"]  # a config that names no architecture: its model_type picks the family
    assert ModelSpec.from_hf_config(hf) == tiny_spec("qwen3")


@pytest.mark.parametrize("shape", ["qwen3.5-27b", "qwen3.5-35b-a3b"])
def test_a_multimodal_config_without_architectures_is_read_by_its_text_models_type(shape):
    """A released Qwen3.5 config.json (model_type qwen3_5, its text model's qwen3_5_text nested
    under text_config) that names no architecture is read as the one that names it."""
    import json

    hf = json.loads((PACKAGE.parent / "examples" / shape / "shape" / "config.json").read_text())
    named = ModelSpec.from_hf_config(hf)
    assert ModelSpec.from_hf_config({k: v for k, v in hf.items() if k != "architectures"}) == named


def test_neither_architectures_nor_model_type_mapped_is_one_error_naming_both():
    with pytest.raises(ConfigError, match=r"^architectures=\[\]: not mapped, nor model_type 'mistral'; .*'qwen3'"):
        ModelSpec.from_hf_config({"model_type": "mistral"})
    with pytest.raises(ConfigError, match=r"MyQwen3.*model_type 'qwen3' is Qwen3ForCausalLM's: name that"):
        ModelSpec.from_hf_config({**tiny_spec("qwen3").to_hf_config(), "architectures": ["MyQwen3"]})


def branches_on_features(package: Path = PACKAGE) -> list[str]:
    """'path:line attr' for every read of a family feature, or comparison of an architecture with a
    name, outside models/."""
    found = []
    for file in sorted(package.rglob("*.py")):
        rel = file.relative_to(package)
        if rel.parts[0] == "models":
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in FEATURE_FLAGS:
                found.append(f"{rel}:{node.lineno} {node.attr}")
            elif isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                named = any(isinstance(s, ast.Attribute) and s.attr == "architecture" for s in sides)
                if named and any(isinstance(s, ast.Constant | ast.Tuple | ast.List | ast.Set) for s in sides):
                    found.append(f"{rel}:{node.lineno} architecture")
    return found


def test_nothing_outside_models_branches_on_a_family_feature():
    assert not branches_on_features(), "\n".join(branches_on_features())


def test_the_check_would_catch_the_old_branches(tmp_path):
    """Lines as they were in weights/layout.py, trainer/memory/estimate.py and common/model_spec.py."""
    old = {
        "weights/layout.py": "def f(spec, i):\n    if spec.qk_norm or spec.is_moe_layer(i):\n        pass\n",
        "trainer/estimate.py": "def g(spec):\n    return 1 if spec.qkv_bias else 0\n",
        "common/model_spec.py": "def h(spec):\n    return spec.architecture in ('qwen3', 'qwen3_moe')\n",
        "models/qwen3.py": "def k(self):\n    return self.qk_norm\n",  # the family's own: allowed
    }
    for path, text in old.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    found = branches_on_features(tmp_path)
    assert found == [
        "common/model_spec.py:2 architecture",
        "trainer/estimate.py:2 qkv_bias",
        "weights/layout.py:2 qk_norm",
        "weights/layout.py:2 is_moe_layer",
    ], found


class Toy(Llama):
    """A family that exists nowhere: Llama's decoder with Qwen3's per-head q/k norms."""

    name = "toy"
    architectures = ("ToyForCausalLM",)
    qk_norm = True

    def to_hf(self, spec):
        return {**super().to_hf(spec), "architectures": ["ToyForCausalLM"], "model_type": "toy"}

    def tiny(self):
        return ModelSpec(**{**super().tiny().as_dict(), "architecture": "toy", "qk_norm": True})


def test_a_new_family_is_one_class(monkeypatch):
    """Registered, it is read from its config.json, and the HF shapes, the Megatron names (both ways),
    the TransformerConfig fields, the parameter count and the tasks' tiny model follow, with no other
    edit."""
    monkeypatch.setitem(FAMILIES, "toy", Toy())
    spec = ModelSpec.from_hf_config(Toy().to_hf(Toy().tiny()))
    assert spec.architecture == "toy" and spec.to_hf_config()["architectures"] == ["ToyForCausalLM"]
    assert "model.layers.0.self_attn.q_norm.weight" in expected_shapes(spec)
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in megatron_recipes(spec, 256)
    hf = random_hf(spec)
    back = megatron_to_hf(spec, hf_to_megatron(spec, hf, padded_vocab=256))
    assert all(torch.equal(back[k], hf[k]) for k in hf) and back.keys() == hf.keys()
    assert family_of(spec).transformer_fields(spec)["qk_layernorm"]
    assert layer_params(spec, 0).replicated == layer_params(tiny_spec("llama"), 0).replicated + 2 * spec.head_dim
    assert tiny_config("toy")["architectures"] == ["ToyForCausalLM"]  # python -m bapo_megatron.tasks makes one
    with pytest.raises(ConfigError, match="attention_bias"):  # Llama's refusals are its too
        ModelSpec.from_hf_config({**spec.to_hf_config(), "attention_bias": True})

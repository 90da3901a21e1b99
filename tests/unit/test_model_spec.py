"""HF config parsing, layout checks and precision checks: clear errors before any process group."""

import pytest
import torch
import transformers

from bapo_megatron.config import ModelConfig, ParallelConfig, load_config
from bapo_megatron.errors import ConfigError
from bapo_megatron.models.spec import ModelSpec, check_layout, padded_vocab_size, tiny_spec
from bapo_megatron.trainer.megatron_config import (
    check_precision_support,
    fp8_hardware_problem,
    sequence_multiple,
    transformer_config,
    wgrad_fusion_available,
)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_spec_round_trips_through_a_transformers_config(arch, tmp_path):
    spec = tiny_spec(arch)
    hf = transformers.AutoConfig.for_model(**spec.to_hf_config())
    hf.save_pretrained(tmp_path)
    assert ModelSpec.from_hf_dir(tmp_path) == spec


def test_llama3_rope_scaling_and_unmapped_features():
    hf = tiny_spec("llama").to_hf_config()
    hf["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert ModelSpec.from_hf_config(hf).rope_scaling_factor == 32.0
    hf["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ConfigError, match=r"rope_scaling"):
        ModelSpec.from_hf_config(hf)
    with pytest.raises(ConfigError, match=r"architectures=\['MistralForCausalLM'\]: not mapped"):
        ModelSpec.from_hf_config({**hf, "architectures": ["MistralForCausalLM"]})
    with pytest.raises(ConfigError, match=r"attention_bias=True"):
        ModelSpec.from_hf_config({**tiny_spec("llama").to_hf_config(), "attention_bias": True})
    with pytest.raises(ConfigError, match=r"intermediate_size=None: missing"):
        ModelSpec.from_hf_config({k: v for k, v in hf.items() if k != "intermediate_size"})


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match=r"has no config.json"):
        ModelSpec.from_hf_dir(tmp_path)
    with pytest.raises(ConfigError, match=r"no such directory \(a relative path is taken from the working directory"):
        ModelSpec.from_hf_dir("no/such/model")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"not valid JSON"):
        ModelSpec.from_hf_dir(tmp_path)


def test_layouts_that_cannot_split():
    spec = tiny_spec()  # 4 heads, 2 query groups, 4 layers
    check_layout(spec, tensor=2, pipeline=2)
    with pytest.raises(ConfigError, match=r"parallel.tensor=4: must divide the 2 query groups"):
        check_layout(spec, tensor=4, pipeline=1)
    with pytest.raises(ConfigError, match=r"parallel.tensor=3: must divide the 4 attention heads"):
        check_layout(spec, tensor=3, pipeline=1)
    with pytest.raises(ConfigError, match=r"parallel.pipeline=3: pipeline x virtual stages \(3\)"):
        check_layout(spec, tensor=1, pipeline=3)
    with pytest.raises(ConfigError, match=r"stages \(8\) must divide the 4 layers"):
        check_layout(spec, tensor=1, pipeline=2, virtual_pipeline=4)
    # The translation refuses them too, before building anything.
    with pytest.raises(ConfigError, match=r"query groups"):
        transformer_config(spec, ModelConfig(), ParallelConfig(tensor=4))
    # Sizes below one (the converter's --ep 0 was a ZeroDivisionError) name their field.
    for field, sizes in (("tensor", (0, 1, 1)), ("pipeline", (1, 0, 1)), ("expert", (1, 1, 0))):
        with pytest.raises(ConfigError, match=rf"parallel.{field}=0: must be >= 1"):
            check_layout(tiny_spec("qwen3_moe"), tensor=sizes[0], pipeline=sizes[1], expert=sizes[2])
    with pytest.raises(ConfigError, match=r"parallel.virtual_pipeline=0: must be >= 1"):
        check_layout(spec, tensor=1, pipeline=1, virtual_pipeline=0)


def test_spec_fields_name_differences_by_their_config_json_key():
    """What mcore-to-hf compares a template with a checkpoint's own records by (hf_config.json, run.json)."""
    import dataclasses

    from bapo_megatron.models.spec import first_difference, spec_fields

    moe = tiny_spec("qwen3_moe")
    fields = spec_fields(moe)
    assert fields["moe.top_k"] == 2 and fields["moe.sparse_layers"] == [1, 2, 3]  # as run.json holds them
    assert first_difference(fields, spec_fields(moe)) is None
    top3 = dataclasses.replace(moe, moe=dataclasses.replace(moe.moe, top_k=3))
    assert first_difference(spec_fields(top3), fields) == ("num_experts_per_tok", 3, 2)
    assert first_difference({"vocab_size": 249}, fields) == ("vocab_size", 249, 250)
    assert first_difference({"a_field_of_a_later_version": 1}, fields) is None  # only fields both hold


def test_vocab_padding():
    assert padded_vocab_size(250, 128, 1) == 256
    assert padded_vocab_size(250, 128, 2) == 256
    assert padded_vocab_size(152064, 128, 8) == 152576  # Qwen2.5: 149 x 1024
    assert padded_vocab_size(152064, 128, 4) == 152064
    # Padding as for TP 8 as well makes the size the same at every TP dividing 8.
    # A small vocabulary: the alignment shrinks until one multiple fits in it (the demo's 16 words
    # were 1,024 rows), still the same at every TP dividing 8; a large one is padded as Megatron pads.
    for vocab, padded in ((152064, 152576), (128256, 129024), (1024, 1024), (1000, 1024), (250, 256), (16, 16), (5, 8)):
        assert {padded_vocab_size(vocab, 128, tp, pad_for_tp=8) for tp in (1, 2, 4, 8)} == {padded}
    assert padded_vocab_size(16, 128, 16, pad_for_tp=8) == 16 and padded_vocab_size(40, 100, 2) == 48


def test_fp8_errors_at_config_time():
    with pytest.raises(ConfigError, match=r"fp8 needs transformer_impl='transformer_engine'"):
        load_config(None, ["model.precision=fp8"])
    with pytest.raises(ConfigError, match=r"model.fp8_recipe='delayed': delayed scaling cannot"):
        load_config(
            None, ["model.precision=fp8", "model.transformer_impl=transformer_engine", "model.fp8_recipe=delayed"]
        )
    if not torch.cuda.is_available():
        cfg = ModelConfig(precision="fp8", transformer_impl="transformer_engine")
        with pytest.raises(ConfigError, match=r"Transformer Engine is not importable|needs a CUDA GPU"):
            check_precision_support(cfg)
        with pytest.raises(ConfigError, match=r"model.precision='bf16': needs a CUDA GPU"):
            check_precision_support(ModelConfig(precision="bf16"))
    check_precision_support(ModelConfig())  # fp32 on the local spec works anywhere


RECIPES = ("delayed", "tensorwise", "blockwise")


def _te_accepts(rows: int, recipe: str, all_gathered: bool) -> bool:
    """Transformer Engine's checks on one rank's fp8 GEMM input of `rows` tokens (2.9 to 2.12):
    assert_dim_for_fp8_exec (rows % 8, every recipe) and, for an input all-gathered under
    sequence parallel, Float8BlockQuantizer.is_quantizable (rows % 128, blockwise)."""
    return rows % 8 == 0 and not (recipe == "blockwise" and all_gathered and rows % 128)


@pytest.mark.parametrize("tensor", [1, 2, 4, 8])
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_padding_gives_every_rank_a_slice_te_accepts(tensor, recipe):
    model = ModelConfig(
        precision="fp8",
        transformer_impl="transformer_engine",
        fp8_recipe=recipe,
        fp8_bf16_first_last_layers=recipe != "delayed",
    )
    for sp in [False, True] if tensor > 1 else [False]:
        multiple = sequence_multiple(model, ParallelConfig(tensor=tensor, sequence_parallel=sp))
        for length in range(1, 700, 7):
            padded = -(-length // multiple) * multiple
            for batch in (1, 3):
                rows = batch * padded // (tensor if sp else 1)  # one rank's [s/TP, b] slice
                assert padded % (tensor if sp else 1) == 0
                assert _te_accepts(rows, recipe, all_gathered=sp), (tensor, sp, recipe, length, batch, rows)
    # the old rule, lcm(16, TP), left a TP=4 rank 4 rows of a 16-token sequence
    assert not _te_accepts(16 // 4, recipe, all_gathered=True)


def test_sequence_multiples_without_fp8():
    assert sequence_multiple(ModelConfig(), ParallelConfig()) == 1
    assert sequence_multiple(ModelConfig(), ParallelConfig(tensor=4, sequence_parallel=True)) == 4
    assert sequence_multiple(ModelConfig(), ParallelConfig(tensor=4)) == 1


def test_blockwise_fp8_needs_hopper_and_cuda_12_9():
    assert fp8_hardware_problem("blockwise", (9, 0), "12.9") is None
    assert fp8_hardware_problem("blockwise", (10, 0), "13.0") is None
    assert "CUDA >= 12.9" in fp8_hardware_problem("blockwise", (9, 0), "12.8")
    assert "compute capability >= 9.0" in fp8_hardware_problem("blockwise", (8, 9), "12.9")
    assert fp8_hardware_problem("tensorwise", (8, 9), "12.1") is None
    assert "compute capability >= 8.9" in fp8_hardware_problem("tensorwise", (8, 0), "12.9")


def test_context_parallel_is_refused_until_it_splits_sequences():
    from bapo_megatron.trainer.memory.fit import fit_to_gpu

    cfg = load_config(None, ["parallel.context=2"])  # refused where the model is known (its message has a figure)
    with pytest.raises(ConfigError, match=r"parallel.context=2: context parallel is not supported"):
        fit_to_gpu(cfg, tiny_spec(), 2, None)


def test_gradient_accumulation_fusion_only_where_megatron_finds_apexs_kernel(monkeypatch):
    import sys
    import types

    from megatron.core.tensor_parallel import layers

    from bapo_megatron.trainer.megatron_config import _fusions

    assert wgrad_fusion_available() == layers._grad_accum_fusion_available  # Megatron's own test agrees
    assert _fusions(True)["gradient_accumulation_fusion"] is wgrad_fusion_available()
    assert _fusions(True)["bias_activation_fusion"] and not any(_fusions(False).values())
    name = "fused_weight_gradient_mlp_cuda"
    monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    assert _fusions(True)["gradient_accumulation_fusion"]
    monkeypatch.setitem(sys.modules, name, None)  # present but fails to import
    assert not _fusions(True)["gradient_accumulation_fusion"]

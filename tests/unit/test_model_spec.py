"""HF config parsing, layout checks and precision checks: clear errors before any process group."""

import pytest
import torch
import transformers

from bapo_megatron.config import ModelConfig, ParallelConfig, load_config
from bapo_megatron.errors import ConfigError
from bapo_megatron.trainer.megatron_config import check_precision_support, sequence_multiple, transformer_config
from bapo_megatron.trainer.model_spec import ModelSpec, check_layout, padded_vocab_size, tiny_spec


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_spec_round_trips_through_a_transformers_config(arch, tmp_path):
    spec = tiny_spec(arch)
    hf = transformers.AutoConfig.for_model(**spec.to_hf_config())
    hf.save_pretrained(tmp_path)
    assert ModelSpec.from_hf_dir(tmp_path) == spec


def test_llama3_rope_scaling_and_unmapped_features():
    hf = tiny_spec("llama").to_hf_config()
    hf["rope_scaling"] = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192}
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


def test_vocab_padding():
    assert padded_vocab_size(250, 128, 1) == 256
    assert padded_vocab_size(250, 128, 2) == 256
    assert padded_vocab_size(152064, 128, 8) == 152576  # Qwen2.5: 149 x 1024
    assert padded_vocab_size(152064, 128, 4) == 152064
    # Padding as for TP 8 as well makes the size the same at every TP dividing 8.
    for vocab, padded in ((152064, 152576), (128256, 129024), (250, 1024)):
        assert {padded_vocab_size(vocab, 128, tp, pad_for_tp=8) for tp in (1, 2, 4, 8)} == {padded}


def test_fp8_errors_at_config_time():
    with pytest.raises(ConfigError, match=r"fp8 needs transformer_impl='transformer_engine'"):
        load_config(None, ["model.precision=fp8"])
    with pytest.raises(ConfigError, match=r"model.fp8_recipe='delayed': delayed scaling cannot"):
        load_config(None, ["model.precision=fp8", "model.transformer_impl=transformer_engine",
                           "model.fp8_recipe=delayed"])
    if not torch.cuda.is_available():
        cfg = ModelConfig(precision="fp8", transformer_impl="transformer_engine")
        with pytest.raises(ConfigError, match=r"Transformer Engine is not importable|needs a CUDA GPU"):
            check_precision_support(cfg)
        with pytest.raises(ConfigError, match=r"model.precision='bf16': needs a CUDA GPU"):
            check_precision_support(ModelConfig(precision="bf16"))
    check_precision_support(ModelConfig())  # fp32 on the local spec works anywhere


def test_sequence_multiples():
    fp8 = ModelConfig(precision="fp8", transformer_impl="transformer_engine", fp8_recipe="blockwise")
    assert sequence_multiple(ModelConfig(), ParallelConfig()) == 1
    assert sequence_multiple(fp8, ParallelConfig()) == 128
    assert sequence_multiple(ModelConfig(), ParallelConfig(tensor=2, sequence_parallel=True, context=3)) == 6

"""The weight sync to SGLang engines started from a quantized release sends the release's layout."""

import json

import pytest
import torch

from bapo_megatron.models.quantized import fp8_dequantize, fp8_scale_name


class Outlet:
    def __init__(self):
        self.sent = []

    def publish(self, buckets, version, verify=False):
        self.sent += [pair for bucket in buckets for pair in bucket]
        return {}

    def probe(self, engine):
        return None

    def waiting(self):
        return []

    def revive(self, engines):
        pass


def _release(tmp_path, quantization):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "deepseek_v3", "quantization_config": quantization})
    )
    return tmp_path


FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [2, 4]}
WEIGHT = "model.layers.0.self_attn.o_proj.weight"


@pytest.fixture
def bucket():
    torch.manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(6, 8)),
        (WEIGHT, torch.randn(5, 8)),
        ("model.norm.weight", torch.ones(8)),
    ]


def _publish(monkeypatch, bucket, *overrides):
    from bapo_megatron.config import load_config
    from bapo_megatron.weights import gather, publish

    monkeypatch.setattr(publish, "broadcast", lambda obj=None: obj)
    monkeypatch.setattr(gather, "hf_buckets_to_rank0", lambda trainer, size, part="model": iter([bucket]))
    outlet = Outlet()
    publisher = publish.WeightPublisher(load_config(None, list(overrides)), trainer=None, outlet=outlet)
    publisher.publish(1)
    return dict(outlet.sent)


def test_sglang_engines_on_an_fp8_release_get_codes_and_block_scales(monkeypatch, tmp_path, bucket):
    path = _release(tmp_path, FP8)
    sent = _publish(monkeypatch, bucket, "rollout.engines.kind=sglang", f"model.hf_path={path}")
    assert set(sent) == {"model.embed_tokens.weight", WEIGHT, fp8_scale_name(WEIGHT), "model.norm.weight"}
    assert sent[WEIGHT].dtype == torch.float8_e4m3fn and sent[fp8_scale_name(WEIGHT)].shape == (3, 2)
    back = fp8_dequantize(sent[WEIGHT], sent[fp8_scale_name(WEIGHT)], (2, 4))
    torch.testing.assert_close(back, bucket[1][1], rtol=0.07, atol=0)  # e4m3: 3 mantissa bits
    assert sent["model.embed_tokens.weight"].dtype == torch.float32  # the release keeps them unquantized


def test_embedded_engines_and_unquantized_models_get_the_weights_as_they_are(monkeypatch, tmp_path, bucket):
    fp8, plain = tmp_path / "fp8", tmp_path / "plain"
    fp8.mkdir()
    plain.mkdir()
    _release(fp8, FP8)
    (plain / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    for overrides in (
        [f"model.hf_path={fp8}"],  # embedded: transformers dequantizes the release when it loads it
        ["rollout.engines.kind=sglang", f"model.hf_path={plain}"],
    ):
        sent = _publish(monkeypatch, bucket, *overrides)
        assert all(sent[name] is t for name, t in bucket), overrides


def test_an_unread_quantization_is_refused_when_the_publisher_is_made(monkeypatch, tmp_path, bucket):
    from bapo_megatron.errors import ConfigError

    path = _release(tmp_path, {"quant_method": "awq"})
    with pytest.raises(ConfigError, match="quant_method"):
        _publish(monkeypatch, bucket, "rollout.engines.kind=sglang", f"model.hf_path={path}")

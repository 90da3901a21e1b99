"""fp8 block scales and mxfp4 (models/quantized.py) against transformers' own dequantization, and the
round trip of a release's quantized tensors (dequantize, quantize) bitwise where the math allows."""

import pytest
import torch

from bapo_megatron.errors import ConfigError
from bapo_megatron.models.quantized import (
    Quantization,
    fp8_dequantize,
    fp8_quantize,
    mxfp4_dequantize,
    mxfp4_quantize,
    read_quantization,
)

DEEPSEEK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def release_fp8(rows: int, cols: int, block: tuple[int, int], seed: int = 0, power_of_two: bool = False):
    """(codes, scales) as a release stores them: random codes whose block maxima are 448 (a quantizer
    that scales each block's amax onto fp8's range), random positive float32 scales."""
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(rows, cols, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    for i in range(grid[0]):
        for j in range(grid[1]):  # each block's largest code is 448, as a block-amax quantizer writes it
            codes[i * block[0], j * block[1]] = 448.0
    scales = torch.rand(grid, generator=g) * 2.0 ** torch.randint(-12, 0, grid, generator=g).float()
    if power_of_two:
        scales = torch.exp2(torch.ceil(torch.log2(scales)))
    return codes, scales


@pytest.mark.parametrize("shape", [(256, 384), (576, 200), (40, 64)])  # partial edge blocks in the last two
def test_fp8_dequantization_is_transformers(shape):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    codes, scales = release_fp8(*shape, block=(128, 128))
    ours = fp8_dequantize(codes, scales, (128, 128))
    theirs = _dequantize_fp8_weight(codes, scales, [128, 128], torch.float32)
    assert ours.dtype == torch.float32 and torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_codes_round_trip_bitwise_and_scales_within_one_rounding(dtype):
    """Through the trainer's dtype: the codes come back bitwise, a scale within that dtype's rounding
    of the block's amax and one of the division (float32 2**-23 in all, bfloat16 2**-8 more); with the
    release's own scale, bitwise."""
    codes, scales = release_fp8(576, 300, (128, 128))
    weight = fp8_dequantize(codes, scales, (128, 128)).to(dtype)
    again, fresh = fp8_quantize(weight, (128, 128))
    assert torch.equal(again.view(torch.uint8), codes.view(torch.uint8))
    bound = 2.0**-23 if dtype == torch.float32 else 2.0**-8 + 2.0**-23
    assert ((fresh - scales).abs() / scales).max() <= bound
    own = (weight.float() / torch.repeat_interleave(scales, 128, 0)[:576].repeat_interleave(128, 1)[:, :300]).to(
        torch.float8_e4m3fn
    )
    assert torch.equal(own.view(torch.uint8), codes.view(torch.uint8))


def test_fp8_ue8m0_scales_round_trip_bitwise():
    codes, scales = release_fp8(300, 256, (128, 128), power_of_two=True)
    weight = fp8_dequantize(codes, scales, (128, 128)).to(torch.bfloat16)
    again, fresh = fp8_quantize(weight, (128, 128), power_of_two=True)
    assert torch.equal(again.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(fresh, scales)


def test_fp8_quantization_of_trained_weights_is_within_half_a_code():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 130, generator=g) * 0.02
    weight[:128, :128] = 0.0  # a block of zeros: scale 1, codes 0
    codes, scales = fp8_quantize(weight, (128, 128))
    assert scales[0, 0] == 1.0 and not codes[:128, :128].float().any()
    back = fp8_dequantize(codes, scales, (128, 128))
    assert ((back - weight).abs() <= 2.0**-4 * weight.abs() + 2.0**-9 * scales.max()).all()


def release_mxfp4(lead: tuple[int, ...], rows: int, groups: int, seed: int = 0):
    """(blocks, scales) as gpt-oss stores them: random nibbles, each block's largest code 4 or 6."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*lead, rows, groups, 16), generator=g, dtype=torch.uint8)
    top = torch.where(torch.rand((*lead, rows, groups), generator=g) < 0.5, 6, 7)  # codes of 4 and 6
    blocks[..., 0] = (blocks[..., 0] & 0xF0) | top.to(torch.uint8)
    blocks[..., 1:] = blocks[..., 1:] & 0x66  # the rest at most 3 in magnitude
    scales = torch.randint(110, 135, (*lead, rows, groups), generator=g, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_dequantization_is_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = release_mxfp4((3,), 10, 4)
    ours = mxfp4_dequantize(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert ours.shape == (3, 128, 10) and torch.equal(ours, theirs)


def test_mxfp4_round_trip_is_bitwise_where_blocks_use_their_range():
    blocks, scales = release_mxfp4((2,), 6, 3)
    again, exponents = mxfp4_quantize(mxfp4_dequantize(blocks, scales))
    assert torch.equal(again, blocks) and torch.equal(exponents, scales)
    small = blocks & 0x55  # largest magnitude 1 (codes 0, 1, 4, 5): a smaller exponent, the same values
    again, exponents = mxfp4_quantize(mxfp4_dequantize(small, scales))
    assert not torch.equal(exponents, scales)
    assert torch.equal(mxfp4_dequantize(again, exponents), mxfp4_dequantize(small, scales))


def test_mxfp4_quantization_rounds_to_nearest_ties_to_even():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -6.0] + [0.0] * 24)
    over = torch.tensor([7.0, 0.2, -0.0] + [0.0] * 29)  # 7 needs 2**1 to fit under 6, then ties at 3.5
    blocks, scales = mxfp4_quantize(torch.stack([ties, over], dim=1))  # [in, out]
    assert scales.tolist() == [[127], [128]]
    back = mxfp4_dequantize(blocks, scales).float()
    assert back[:8, 0].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -6.0]
    assert back[:2, 1].tolist() == [8.0, 0.0] and torch.signbit(back[2, 1])  # -0 keeps its code


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"quant_method": "awq"}, "quantization_config.quant_method"),
        ({"fmt": "e5m2"}, "quantization_config.fmt"),
        ({"activation_scheme": "static"}, "quantization_config.activation_scheme"),
        ({"weight_block_size": None}, "quantization_config.weight_block_size"),
        ({"weight_block_size": [128]}, "quantization_config.weight_block_size"),
        ({"scale_fmt": "e4m3"}, "quantization_config.scale_fmt"),
        ({"modules_to_not_convert": "lm_head"}, "quantization_config.modules_to_not_convert"),
    ],
)
def test_what_is_not_read_is_refused_by_name(change, field):
    with pytest.raises(ConfigError) as err:
        read_quantization({"quantization_config": {**DEEPSEEK_FP8, **change}}, "use a bf16 copy")
    assert err.value.field == field


def test_the_releases_configs_are_read():
    assert read_quantization({}) is None
    assert read_quantization({"quantization_config": DEEPSEEK_FP8}) == Quantization("fp8", (128, 128))
    v31 = read_quantization({"quantization_config": {**DEEPSEEK_FP8, "scale_fmt": "ue8m0"}})
    assert v31.power_of_two
    gpt_oss = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "embed_tokens"]}
    assert read_quantization({"quantization_config": gpt_oss}).method == "mxfp4"


def test_the_rule_of_what_is_quantized():
    fp8 = Quantization("fp8", (128, 128), skipped=("lm_head", "layers.0.self_attn.o_proj"))
    assert fp8.quantizes("model.layers.1.self_attn.q_a_proj.weight", 2)
    assert fp8.quantizes("model.layers.3.mlp.experts.7.down_proj.weight", 2)
    assert not fp8.quantizes("model.layers.3.mlp.gate.weight", 2)  # the router
    assert not fp8.quantizes("model.layers.1.self_attn.kv_a_layernorm.weight", 1)
    assert not fp8.quantizes("model.embed_tokens.weight", 2) and not fp8.quantizes("lm_head.weight", 2)
    assert not fp8.quantizes("model.layers.0.self_attn.o_proj.weight", 2)  # modules_to_not_convert
    glob = Quantization("fp8", (128, 128), skipped=("model.layers.*.self_attn", "mlp.shared_experts"))
    assert not glob.quantizes("model.layers.2.self_attn.q_b_proj.weight", 2)
    assert not glob.quantizes("model.layers.2.mlp.shared_experts.up_proj.weight", 2)
    assert glob.quantizes("model.layers.2.mlp.experts.0.up_proj.weight", 2)
    assert Quantization("fp8", (128, 128), skipped=("proj",)).quantizes("model.layers.0.self_attn.o_proj.weight", 2)
    qwen3_5 = Quantization("fp8", (128, 128), skipped=("model.language_model.layers.0.linear_attn.in_proj_a",))
    assert not qwen3_5.quantizes("model.language_model.layers.0.linear_attn.in_proj_a.weight", 2)
    assert qwen3_5.quantizes("model.language_model.layers.0.linear_attn.in_proj_qkv.weight", 2)
    assert not qwen3_5.quantizes("model.language_model.layers.0.linear_attn.conv1d.weight", 3)
    mx = Quantization("mxfp4")
    assert mx.quantizes("model.layers.0.mlp.experts.gate_up_proj", 3)
    assert not mx.quantizes("model.layers.0.mlp.experts.gate_up_proj_bias", 2)
    assert not mx.quantizes("model.layers.0.self_attn.q_proj.weight", 2)

"""The activation estimate of a Gated DeltaNet hybrid (Qwen3.5) and of multi-latent attention
(Moonlight), against counts by hand (Family.attention_memory): a hybrid's full-attention layers keep
no [heads, tokens, tokens] score tensor (torch's fused kernel), their output gate its own tensors;
a linear-attention layer keeps the delta rule's per-token tensors instead (the 27B preset's
layout); MLA its latents and heads of its own widths."""

import dataclasses
from pathlib import Path

from bapo_megatron.config import load_config
from bapo_megatron.models.spec import ModelSpec
from bapo_megatron.trainer.memory.estimate import local_activation_bytes, local_layer_bytes

PRESET = Path(__file__).resolve().parents[2] / "examples" / "qwen3.5-27b"
MOONLIGHT = PRESET.parent / "moonlight-16b-a3b"


def _preset():
    cfg = load_config(PRESET / "config.yaml")
    return ModelSpec.from_hf_dir(PRESET / "shape"), cfg.model, dataclasses.replace(cfg.parallel, recompute="none")


def test_no_layer_keeps_scores():
    """TP 4, PP 2, no recompute, the first stage (layers 0-31: 8 of them full attention, one in four)
    holding 2 micro-batches of padded rows: the full-attention layers run in torch's fused kernel
    (models/local_attention.py), which keeps no [heads, T, T] tensor, and padded rows need no mask,
    so nothing grows as T^2 (with Megatron's softmax: 256 bytes per T^2, the probabilities and causal
    mask of each full layer, 3 score tensors in the running backward and Megatron's global buffer)."""
    spec, model, parallel = _preset()
    assert parallel.tensor == 4 and parallel.pipeline == 2 and spec.num_heads == 24
    tokens = 1024
    one, two = (local_activation_bytes(spec, model, parallel, n, stage=0) for n in (tokens, 2 * tokens))
    assert two == 2 * one  # the linear terms alone


def test_a_linear_attention_layer_per_token():
    """Layer 0 (Gated DeltaNet) at TP 4 under sequence parallel, bf16: q/k width 16 x 128 = 2,048,
    value width 48 x 128 = 6,144, 48 value heads: 3 x (2 x 2,048 + 6,144) + 4 x 2,048 + 17 x 6,144 +
    8 x 48 = 143,744 elements of attention, 5 x 17,408 of the MLP, split over 4: 57,696; the norms and
    residuals 6 x 5,120 / 4 = 7,680; no rotary cos/sin: 65,376 elements, 130,752 bytes. Beside them,
    in fp32, the torch delta rule's chunks of 64 per value head: (64^2 - 1) // 3 + 4 x 64 + 2 x (128 +
    128) = 2,133, 48 heads over 4 ranks: 102,384 bytes (not counted before the fix; with them the
    tiny qwen3_5_text's estimate is within 2% of a measured CPU step at 512 and 1,024 tokens, 1.8x
    under it without)."""
    spec, model, parallel = _preset()
    assert spec.linear_attention.is_linear(0) and not spec.linear_attention.is_linear(3)
    assert local_layer_bytes(spec, model, parallel, 0) == 130_752 + 102_384


def test_a_gated_full_attention_layer_per_token():
    """Layer 3 (gated full attention) at TP 4 under sequence parallel, bf16, 24 query heads over 4
    key/value heads of 256, in torch's fused kernel: v, a view of the q/k/v output, keeps it whole
    (8,192), q and k after rope (6,144 + 1,024), the kernel's output and the context (2 x 6,144);
    the q/k norms' input, x * rsqrt and output (3 x 28 x 256); the gated context (6,144); the MLP
    5 x 17,408: 142,336 split over 4 = 35,584; norms and residuals 7,680; rotary cos/sin 4 x 256:
    44,288 elements, 88,576 bytes; in fp32 the output gate's sigmoid (6,144) and the kernel's
    log-sum-exp a head (24) over 4: 6,168 bytes. 94,744 (Megatron's softmax, k and v repeated to
    every head: 93,184, and its [heads, T, T] scores beside)."""
    spec, model, parallel = _preset()
    assert not spec.linear_attention.is_linear(3) and spec.num_heads * spec.head_dim == 6144
    assert local_layer_bytes(spec, model, parallel, 3) == 94_744


def test_multi_latent_attention_counts_its_own_intermediates():
    """Moonlight's first (dense) layer under Transformer Engine at TP 2 with sequence parallel, bf16:
    16 heads of query and key width 128 + 64 and value 128, a kv latent of 512, no query latent. Per
    head the query and key after rope (2 x 192), the kv up-projection (128 + 128), the context and
    the attention output (2 x 128): 14,336; the MLP 3 x 11,264: 48,128 split over 2 = 24,064; the
    norms and residuals 4 x 2,048 and the latents (the kv down-projection's 512 + 64, the kv latent
    normalised 512) 9,280 over 2 = 4,640: 28,704 elements, 57,408 bytes (the generic formula with
    heads of 192: 57,856)."""
    from bapo_megatron.trainer.memory.estimate import layer_activation_bytes

    cfg = load_config(MOONLIGHT / "config.yaml")
    spec = ModelSpec.from_hf_dir(MOONLIGHT / "shape")
    parallel = dataclasses.replace(cfg.parallel, recompute="none")
    assert (parallel.tensor, parallel.sequence_parallel, cfg.model.transformer_impl) == (2, True, "transformer_engine")
    assert layer_activation_bytes(spec, cfg.model, parallel, 0) == 57_408

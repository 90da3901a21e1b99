"""The local implementation's activation estimate of a Gated DeltaNet hybrid (Qwen3.5), against a
count by hand: only its full-attention layers keep a [heads, tokens, tokens] score tensor; a
linear-attention layer keeps the delta rule's per-token tensors instead (the 27B preset's layout)."""

import dataclasses
from pathlib import Path

from bapo_megatron.config import load_config
from bapo_megatron.models.spec import ModelSpec
from bapo_megatron.trainer.memory.estimate import local_activation_bytes, local_layer_bytes

PRESET = Path(__file__).resolve().parents[2] / "examples" / "qwen3.5-27b"


def _preset():
    cfg = load_config(PRESET / "config.yaml")
    return ModelSpec.from_hf_dir(PRESET / "shape"), cfg.model, dataclasses.replace(cfg.parallel, recompute="none")


def test_only_the_full_attention_layers_keep_scores():
    """TP 4, PP 2, no recompute, the first stage (layers 0-31: 8 of them full attention, one in four)
    holding 2 micro-batches: per micro-batch each full layer keeps its probabilities (24 / 4 heads x
    T^2 x 2 bytes) and its causal mask (T^2 bytes); the running one's core-attention backward adds 3
    score tensors and Megatron's global buffer one: 2 x 8 x 13 + 4 x 12 = 256 bytes per T^2 (with
    every layer's scores counted, as before the fix: 880)."""
    spec, model, parallel = _preset()
    assert parallel.tensor == 4 and parallel.pipeline == 2 and spec.num_heads == 24
    tokens = 1024
    one, two = (local_activation_bytes(spec, model, parallel, n, stage=0) for n in (tokens, 2 * tokens))
    assert (two - 2 * one) / (2 * tokens * tokens) == 256  # the linear terms cancel: what grows as T^2


def test_a_linear_attention_layer_per_token():
    """Layer 0 (Gated DeltaNet) at TP 4 under sequence parallel, bf16: q/k width 16 x 128 = 2,048,
    value width 48 x 128 = 6,144, 48 value heads: 3 x (2 x 2,048 + 6,144) + 4 x 2,048 + 17 x 6,144 +
    8 x 48 = 143,744 elements of attention, 5 x 17,408 of the MLP, split over 4: 57,696; the norms and
    residuals 6 x 5,120 / 4 = 7,680; no rotary cos/sin: 65,376 elements, 130,752 bytes."""
    spec, model, parallel = _preset()
    assert spec.linear_attention.is_linear(0) and not spec.linear_attention.is_linear(3)
    assert local_layer_bytes(spec, model, parallel, 0) == 130_752

"""Megatron-Core 0.16.1's layers made to run gpt-oss (models/gpt_oss.py) on the local spec, applied to
that family's layer specs only (`gpt_oss_layer`), never patched into Megatron:

- WindowedAttention: the local core attention of a sliding-window layer builds its own causal
  window mask in place of the mask it is given, so a packed row's samples would see one another;
  this one masks both (the window and the row's block-diagonal mask). It also marks the sink logits
  (`softmax_offset`, split over TP by heads) as tensor-parallel, which Megatron leaves unmarked:
  gathers and the gradient norm would read rank 0's heads only.
- BiasedExperts: an expert MLP adds its fc2 bias in place into an output its backward still needs
  (the backward, and the training forward, fail at EP 1); its experts add it out of place, the same
  arithmetic. Their fc2 biases are not summed over TP again (see below).
- GptOssConfig: TransformerConfig with the YaRN settings GPTModel reads from its config.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch


def gpt_oss_layer(layer: Any, te: bool) -> Any:
    """A MoE layer spec with BiasedExperts for Megatron's SequentialMLP and, on the local spec,
    WindowedAttention for its core attention."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    subs = layer.submodules
    mlp = subs.mlp
    if mlp.submodules.experts.module is SequentialMLP:
        experts = dataclasses.replace(mlp.submodules.experts, module=biased_experts())
        mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, experts=experts))
    attention = subs.self_attention
    if not te:
        core = windowed_attention()
        attention = dataclasses.replace(
            attention, submodules=dataclasses.replace(attention.submodules, core_attention=core)
        )
    return dataclasses.replace(layer, submodules=dataclasses.replace(subs, self_attention=attention, mlp=mlp))


def window_mask(queries: int, keys: int, window: tuple[int, int], device: Any) -> torch.Tensor:
    """[queries, keys] True where a query may NOT attend (Megatron's convention): keys more than
    window[0] before it or window[1] after it (the last query is the last key)."""
    q = torch.arange(queries, device=device).unsqueeze(1) + (keys - queries)
    k = torch.arange(keys, device=device).unsqueeze(0)
    return (k < q - window[0]) | (k > q + window[1])


@functools.cache
def windowed_attention() -> type:
    """The local core attention class (built on first use: the package imports no Megatron until a
    model is built)."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class WindowedAttention(DotProductAttention):
        """The local core attention with its window masked beside the mask it is given (a packed
        row's), and its sink logits marked as split over TP by heads."""

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.window = self.scale_mask_softmax.window_size
            self.scale_mask_softmax.window_size = None  # it would replace the mask: forward masks both
            if isinstance(self.softmax_offset, torch.nn.Parameter):
                set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)

        def forward(self, query, key, value, attention_mask, *args: Any, **kwargs: Any):
            if self.window is not None:
                window = window_mask(query.size(0), key.size(0), self.window, query.device)
                attention_mask = window if attention_mask is None else attention_mask | window
            return super().forward(query, key, value, attention_mask, *args, **kwargs)

    return WindowedAttention


@functools.cache
def biased_experts() -> type:
    """SequentialMLP whose experts add their fc2 bias out of place (built on first use)."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import SequentialMLP

    class BiasedExpert(MLP):
        """An expert MLP adding its fc2 bias, weighted by the token's probability, out of place."""

        def forward(self, hidden_states, per_token_scale=None, **kwargs: Any):
            bias = self.linear_fc2.bias
            if per_token_scale is None or bias is None:
                return super().forward(hidden_states, per_token_scale, **kwargs)
            self.linear_fc2.bias = None  # MLP.forward would add it in place
            try:
                output, _ = super().forward(hidden_states, per_token_scale, **kwargs)
            finally:
                self.linear_fc2.bias = bias
            return output + bias.unsqueeze(0) * per_token_scale.unsqueeze(-1), None

    class BiasedExperts(SequentialMLP):
        """SequentialMLP whose experts are BiasedExpert, their fc2 biases not summed over TP."""

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            for expert in self.local_experts:
                expert.__class__ = BiasedExpert
                if expert.linear_fc2.bias is not None:
                    # the row-parallel fc2 marks its bias sequence-parallel, so Megatron would sum its
                    # gradient over TP on top of the expert-data-parallel reduction, which already
                    # spans the TP ranks that hold the expert (expert TP 1): twice the gradient
                    expert.linear_fc2.bias.sequence_parallel = False

    return BiasedExperts


@functools.cache
def gpt_oss_config() -> type:
    """TransformerConfig with the YaRN settings (built on first use)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    @dataclasses.dataclass
    class GptOssConfig(TransformerConfig):
        """TransformerConfig with the YaRN settings GPTModel reads from its config (0.16.1 names them
        there, but declares none)."""

        position_embedding_type: str = "rope"
        yarn_rotary_scaling_factor: float = 1.0
        yarn_original_max_position_embeddings: int = 4096
        yarn_beta_fast: float = 32.0
        yarn_beta_slow: float = 1.0
        yarn_mscale: float | None = None
        yarn_mscale_all_dim: float | None = None
        yarn_correction_range_round_to_int: bool = True

    return GptOssConfig

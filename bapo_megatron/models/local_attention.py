"""The local spec's core attention (the CPU's, and a GPU's without Transformer Engine): Megatron-Core
0.16.1's DotProductAttention with softmax(q k^T / sqrt(d)) v computed by torch's
scaled_dot_product_attention, applied to every family's local layer specs in one place
(`with_sdpa_core_attention`, from trainer/megatron_config.layer_spec), never patched into Megatron.

Megatron's own computes the scores into its global buffer (baddbmm), masks and softmaxes them op by
op (building the causal mask anew each call) and keeps the [heads, tokens, tokens] probabilities for
backward; torch's fused kernel keeps none of that (its output and a float32 log-sum-exp a head and
query) and ran a layer's attention forward and backward 1.9-3.8x faster on CPU (the demo's rows of
20 tokens 1.9x, a packed row of 1,024 3.2x). The arithmetic is the same: the scale (Megatron's
softmax_scale, its query-key layer scaling undone as its softmax redoes it), grouped-query heads,
Megatron's masks (True where a query may NOT attend: the packed rows' block-diagonal one,
trainer/packing.py) or the causal mask Megatron builds when it is given none. Values narrower than
the queries and keys (MLA's) are padded with zeros to their width, which the kernel needs (else it
runs unfused and keeps the scores). What the fused kernel cannot do keeps Megatron's path: sink
logits (gpt-oss' softmax_offset), a sliding window, attention dropout (Megatron's RNG tracker), an
attention bias, THD packing, queries fewer than keys under a causal mask.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import torch
import torch.nn.functional as F


@functools.cache
def sdpa_attention() -> type:
    """The class (built on first use: the package imports no Megatron until a model is built)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SdpaAttention(DotProductAttention):
        """DotProductAttention whose core runs in torch's fused scaled_dot_product_attention."""

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            scaled = self.config.apply_query_key_layer_scaling  # Megatron divides, its softmax multiplies back
            self.scale = self.softmax_scale * (self.layer_number if scaled else 1)

        def fused(self, query: torch.Tensor, key: torch.Tensor, mask_type: Any, *extras: Any) -> bool:
            return (
                self.softmax_offset is None
                and self.scale_mask_softmax.window_size is None
                and not (self.training and self.attention_dropout.p > 0)
                and all(extra is None for extra in extras)
                and (mask_type != AttnMaskType.causal or query.size(0) == key.size(0))
            )

        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            attn_mask_type: Any = None,
            attention_bias: torch.Tensor | None = None,
            packed_seq_params: Any = None,
        ) -> torch.Tensor:
            mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
            if not self.fused(query, key, mask_type, attention_bias, packed_seq_params):
                return super().forward(
                    query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
                )
            # [tokens, batch, heads, dim] -> [batch, heads, tokens, dim]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            width = v.size(-1)
            if width < q.size(-1):  # (MLA) the kernel takes one head width, or runs unfused, keeping the scores:
                v = F.pad(v, (0, q.size(-1) - width))  # zero columns, an output's to slice off
            context = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=None if attention_mask is None else additive(attention_mask, q.dtype),
                is_causal=attention_mask is None and mask_type == AttnMaskType.causal,
                scale=self.scale,
                enable_gqa=q.size(1) != k.size(1),
            )
            return context[..., :width].permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), -1)

    return SdpaAttention


_ADDITIVE: list[tuple[weakref.ref, weakref.ref]] = []
"""The last mask's additive copy (both held weakly): the kernel would turn a boolean mask into one
of its own in every layer, each kept for backward; the layers of a micro-batch share this one."""


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Megatron's mask (True where a query may NOT attend) as the kernel's additive one: 0 or -inf."""
    if _ADDITIVE:
        given, made = (ref() for ref in _ADDITIVE[0])
        if given is mask and made is not None and made.dtype == dtype:
            return made
    made = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    _ADDITIVE[:] = [(weakref.ref(mask), weakref.ref(made))]
    return made


def with_sdpa_core_attention(spec: Any) -> Any:
    """`spec` (a layer's ModuleSpec or a block's submodules) with every core attention that is
    Megatron's DotProductAttention itself replaced by SdpaAttention; subclasses (gpt-oss' windowed
    attention with sinks, MLA's, which derives from SdpaAttention) are left as they are."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    def replaced(value: Any) -> Any:
        if value is DotProductAttention:
            return sdpa_attention()
        if isinstance(value, ModuleSpec) and value.module is DotProductAttention:
            return dataclasses.replace(value, module=sdpa_attention())
        return walked(value)

    def walked(value: Any) -> Any:
        if isinstance(value, list | tuple):
            return type(value)(walked(v) for v in value)
        if isinstance(value, ModuleSpec):
            return dataclasses.replace(value, submodules=walked(value.submodules))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes = {}
            for field in dataclasses.fields(value):
                old = getattr(value, field.name)
                new = replaced(old) if field.name == "core_attention" else walked(old)
                if new is not old:
                    changes[field.name] = new
            return dataclasses.replace(value, **changes) if changes else value
        return value

    return walked(spec)

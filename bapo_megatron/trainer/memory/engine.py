"""An SGLang server rank's memory, as SGLang 0.5.23 divides it: its weights (bf16, or as the quantized
release it started from stores them), then KV tokens, and for a hybrid model (linear attention) the
request slots of its recurrent state.

    weights = engine_weight_bytes(spec, tp, quantization)   # quantization: the release's, or None
    cache = engine_cache(spec, tp, budget)   # budget: mem_fraction_static's bytes less the weights
    cache.tokens, cache.requests             # KV positions; concurrent requests (None: no state)

A server started from a quantized release keeps its quantized weights as released (SGLang's fp8 and
mxfp4 methods load the codes and scales into parameters of their own dtypes; every weight sync sends
that layout, weights/publish.engine_quantization): an fp8 weight is one byte a weight and a float32
scale a block, gpt-oss's MXFP4 experts half a byte a weight and one E8M0 byte each 32.

A hybrid's linear-attention layers keep a state per request, whatever its length, in a pool of
request slots beside the KV pool of its full-attention layers (mem_cache/kv_cache_configurator.py,
_handle_max_mamba_cache): by default the slots take mamba_full_memory_ratio / (1 + that ratio) of
the memory left after the weights, as many whole slots as fit less one (the pool's padding slot),
and the KV pool what the slots leave. A request needs a slot: the slots cap the requests a server
runs at once (with --max-running-requests and the tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bapo_megatron.common.hf_io import hf_entries
from bapo_megatron.models import family_of
from bapo_megatron.models.quantized import Quantization
from bapo_megatron.models.spec import ModelSpec
from bapo_megatron.trainer.memory.estimate import stage_params

MAMBA_FULL_MEMORY_RATIO = 0.9
"""SGLang 0.5.23's default --mamba-full-memory-ratio (arg_groups/fields/schedule.py's fallback)."""


@dataclass(frozen=True)
class EngineCache:
    """One SGLang rank's cache memory, split between the KV pool and the request-state pool."""

    kv_bytes: int
    tokens: int
    """KV positions the pool holds (every request's together)."""
    state_bytes: int = 0
    """The request-state pool (its padding slot included); 0 without recurrent layers."""
    per_request: int = 0
    """One request's state on this rank."""
    requests: int | None = None
    """Requests whose state fits at once (None: no recurrent state, no cap of this kind)."""


def engine_cache(spec: ModelSpec, tp: int, budget: int, ratio: float = MAMBA_FULL_MEMORY_RATIO) -> EngineCache:
    """How a rank of an SGLang server at TP `tp` divides `budget` bytes of cache memory (bf16 KV)."""
    family = family_of(spec)
    per_token, per_request = max(family.engine_cache_bytes(spec, tp), 1), family.engine_state_bytes(spec, tp)
    if not per_request:
        return EngineCache(kv_bytes=budget, tokens=budget // per_token)
    slots = max(0, int((budget * ratio / (1 + ratio) - per_request) // per_request))
    state = (slots + 1) * per_request
    kv = max(0, budget - state)
    return EngineCache(kv_bytes=kv, tokens=kv // per_token, state_bytes=state, per_request=per_request, requests=slots)


def engine_weight_bytes(spec: ModelSpec, tp: int, quantization: Quantization | None = None) -> int:
    """The weights one rank of an SGLang server at TP `tp` holds: the whole model split over its ranks
    (one stage, no vocabulary padding; each expert split over the ranks, the same bytes as EP = TP
    whole experts) in bf16, each tensor the family keeps in float32 (DeepSeek-V3's expert bias) in
    it, and each tensor `quantization` stores quantized as stored (Quantization.stored: codes and
    scales), split over the ranks as SGLang splits it."""
    total = stage_params(spec, spec.vocab_size, tp, 1, 0, expert=tp) * 2
    for entry in hf_entries(spec, torch.bfloat16):
        stored = [(entry.name, entry.shape, entry.dtype)]
        if quantization is not None and quantization.quantizes(entry.name, len(entry.shape)):
            stored = quantization.stored(entry.name, entry.shape)
        if stored[0][2] != torch.bfloat16:
            extra = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in stored) - math.prod(entry.shape) * 2
            total += extra // (1 if len(entry.shape) == 1 else tp)  # a vector (a bias) whole on every rank
    return total

"""An SGLang server rank's cache memory, as SGLang 0.5.23 divides it: KV tokens, and for a hybrid
model (linear attention) the request slots of its recurrent state.

    cache = engine_cache(spec, tp, budget)   # budget: mem_fraction_static's bytes less the weights
    cache.tokens, cache.requests             # KV positions; concurrent requests (None: no state)

A hybrid's linear-attention layers keep a state per request, whatever its length, in a pool of
request slots beside the KV pool of its full-attention layers (mem_cache/kv_cache_configurator.py,
_handle_max_mamba_cache): by default the slots take mamba_full_memory_ratio / (1 + that ratio) of
the memory left after the weights, as many whole slots as fit less one (the pool's padding slot),
and the KV pool what the slots leave. A request needs a slot: the slots cap the requests a server
runs at once (with --max-running-requests and the tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from bapo_megatron.models import family_of
from bapo_megatron.models.spec import ModelSpec

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

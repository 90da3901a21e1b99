"""The embedded engine's prefix store: the cached keys and values (and a MoE model's routes) of
requests cut short (max_new_tokens or abort), taken back when a request returns as prompt + partial
response (partial rollout's next round), which then skips its prefill, as SGLang's radix cache
would. It holds at most as many positions as the slotted cache (slots.py), the oldest dropped first."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from bapo_megatron.engines.embedded.request_queue import EngineRequest
from bapo_megatron.engines.embedded.slots import SlotKV


@dataclass
class _Prefix:
    """What the prefix store keeps of a request cut short, for its cached positions [0, n)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values) [kv_heads, n, head_dim]
    routes: torch.Tensor | None  # [n, moe_layers, top_k] (a MoE model)
    lora_id: str | None = None  # the LoRA adapter it was computed under (None: the base model)


def _prefix_key(request: EngineRequest) -> tuple[int, ...]:
    """The prefix store's key of a request: its tokens but the last, whose keys/values are cached."""
    return tuple((request.input_ids + request.output_ids)[:-1])


class PrefixStore:
    """Token ids -> the cached positions of a request cut short, oldest first; iterating gives the keys."""

    def __init__(self) -> None:
        self._stored: collections.OrderedDict[tuple[int, ...], _Prefix] = collections.OrderedDict()
        self._positions = 0  # the stored keys' lengths summed (kept, not summed per store: O(n) each)

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return iter(self._stored)

    def __len__(self) -> int:
        return len(self._stored)

    def clear(self) -> None:
        """Forget every stored prefix (the weights changed, or the memory was released)."""
        self._stored.clear()
        self._positions = 0

    def keep(self, request: EngineRequest, kv: SlotKV, slot: int, with_routes: bool) -> None:
        """Store the positions `request` has cached in `slot` (and its routes, `with_routes`)."""
        length = request.length - 1  # cached positions: every token but the last sampled one
        layers = [(k[slot, :, :length].clone(), v[slot, :, :length].clone()) for k, v in kv.layers()]
        routes = torch.cat(request.routes) if with_routes else None
        assert routes is None or len(routes) == length, "routes of every cached position"
        key = _prefix_key(request)
        if self._stored.pop(key, None) is not None:
            self._positions -= len(key)
        self._stored[key] = _Prefix(layers, routes, request.lora_id)
        self._positions += len(key)
        # at most as many positions as the slots hold: the store never more than doubles the cache
        limit = kv.slots * kv.store_room
        while self._positions > limit:
            dropped, _ = self._stored.popitem(last=False)  # the oldest first
            self._positions -= len(dropped)

    def resume(self, request: EngineRequest, kv: SlotKV, slot: int) -> bool:
        """Put the request's stored prefix (all but its last token), if any, into `slot` and take it
        out of the store, with its routes; False when none is stored."""
        cached = self._stored.get(_prefix_key(request))
        if cached is None or cached.lora_id != request.lora_id:  # computed under another adapter
            return False
        del self._stored[_prefix_key(request)]
        self._positions -= len(_prefix_key(request))
        # the cache may have been given back while idle (shrink): room for this prefix first
        kv.reserve([(k.unsqueeze(0), v.unsqueeze(0)) for k, v in cached.layers], request.length)
        kv.put(slot, cached.layers, request.length - 1)
        request.routes = [] if cached.routes is None else [cached.routes]
        return True

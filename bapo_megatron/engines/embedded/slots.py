"""The embedded engine's slotted KV cache: one preallocated buffer per layer, running request i in slot i,
and the transformers cache view a decode step writes through (engines/embedded/decode.py uses them)."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

GROWTH_FLOOR = 64
"""The fewest positions per slot a growth gives, where the requests may reach further."""


class SlotKV:
    """Keys and values of the running requests, per layer [slots, kv_heads, capacity, head_dim]."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def store_room(self) -> int:
        """Positions per slot the prefix store may keep beside the cache (prefixes.py): the capacity,
        at least GROWTH_FLOOR, so that a cache sized to short requests keeps what it kept before."""
        return max(self.capacity, GROWTH_FLOOR)

    def reserve(self, like: list[tuple[torch.Tensor, torch.Tensor]], length: int, most: int | None = None) -> None:
        """Room for `length` positions per slot (grown by doubling, contents kept); `like`: per layer
        (keys, values) shaped [batch, kv_heads, *, head_dim] to take heads, sizes and dtype from.
        most: the most positions the running requests can reach (prompt and max_new_tokens), which
        the doubling never passes: a step's batch of short answers holds what it can use (the demo's
        256 slots of 15 positions took 34 MB at the 64 positions a growth gave at least)."""
        if length <= self.capacity:
            return
        grown = max(2 * self.capacity, GROWTH_FLOOR)
        capacity = max(length, grown if most is None else min(grown, most))
        old = list(zip(self.keys, self.values, strict=True))
        self.keys, self.values = [], []
        for layer, (k, v) in enumerate(like):
            new_k = k.new_zeros(self.slots, k.shape[1], capacity, k.shape[3])
            new_v = v.new_zeros(self.slots, v.shape[1], capacity, v.shape[3])
            if old:
                new_k[:, :, : old[layer][0].shape[2]] = old[layer][0]
                new_v[:, :, : old[layer][1].shape[2]] = old[layer][1]
            self.keys.append(new_k)
            self.values.append(new_v)

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.keys, self.values, strict=True))

    def put(self, slot: int, layers: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        """Slot's positions [0, length) from per-layer (keys, values) [kv_heads, >= length, head_dim]."""
        for (k, v), (src_k, src_v) in zip(self.layers(), layers, strict=True):
            k[slot, :, :length] = src_k[:, :length]
            v[slot, :, :length] = src_v[:, :length]

    def put_rows(
        self, first: int, layers: list[tuple[torch.Tensor, torch.Tensor]], rows: list[int], length: int
    ) -> None:
        """Slots first, first + 1, ... take rows `rows` of per-layer (keys, values) [batch, kv_heads,
        >= length, head_dim], positions [0, length): one copy per layer for a whole prefill."""
        if not rows:
            return
        end = first + len(rows)
        picked = slice(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1)) else torch.tensor(rows)
        for (k, v), (src_k, src_v) in zip(self.layers(), layers, strict=True):
            k[first:end, :, :length] = src_k[picked, :, :length]
            v[first:end, :, :length] = src_v[picked, :, :length]

    def move_slots(self, sources: list[int], targets: list[int], length: int) -> None:
        """Each slot sources[i]'s first `length` positions into slot targets[i]: one copy per layer."""
        if not sources:
            return
        source, target = torch.tensor(sources), torch.tensor(targets)
        for k, v in self.layers():
            k[target, :, :length] = k[source, :, :length]
            v[target, :, :length] = v[source, :, :length]

    def move(self, source: int, target: int) -> None:
        """The whole slot (whatever it has cached) from source to target."""
        for k, v in self.layers():
            k[target] = k[source]
            v[target] = v[source]

    def step_cache(self, positions: torch.Tensor):
        """A transformers Cache over slots [0, len(positions)) that writes row b's new key/value at
        positions[b] and returns every row's first max(positions) + 1 positions (views, no copy)."""
        span = int(positions.max()) + 1
        return Cache(layers=[_SlotLayer(k, v, positions, span) for k, v in self.layers()])


class _SlotLayer(CacheLayerMixin):
    """One layer's view of SlotKV for one decode step (transformers' cache-layer interface)."""

    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, span: int) -> None:
        super().__init__()
        self.keys, self.values, self.positions, self.span = keys, values, positions, span
        self.rows = torch.arange(len(positions))
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys[self.rows, :, self.positions] = key_states[:, :, 0]
        self.values[self.rows, :, self.positions] = value_states[:, :, 0]
        return self.keys[: len(self.rows), :, : self.span], self.values[: len(self.rows), :, : self.span]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.span, 0

    def get_seq_length(self) -> int:
        return self.span - 1

    def get_max_length(self) -> int:
        return self.keys.shape[2]

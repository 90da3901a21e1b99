"""Routed experts of a sample: which experts each MoE layer chose for each position, compactly.

A sample of P prompt and R response tokens has routes for positions 0 .. P + R - 2: position t's
forward pass (in the engine, when t was fed in) picked top_k experts in each MoE layer, and that
pass gives the log-prob of token t + 1. The last token is never fed in by the engine, so it has
no route (its position predicts nothing the loss counts, and under causal attention it changes
no earlier position). Routes are kept as [positions, moe_layers, top_k] integers of the smallest
dtype that holds an expert id (1 byte up to 256 experts): MoE layers only, in layer order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype holding expert ids 0 .. num_experts - 1."""
    return torch.uint8 if num_experts <= 256 else torch.int16


@dataclass(frozen=True)
class RouteShape:
    """What one position's routes hold: top_k experts in each of moe_layers layers."""

    moe_layers: int
    top_k: int
    num_experts: int

    @property
    def dtype(self) -> torch.dtype:
        return route_dtype(self.num_experts)

    @property
    def bytes_per_position(self) -> int:
        return self.moe_layers * self.top_k * torch.empty((), dtype=self.dtype).element_size()

    def check(self, routes: torch.Tensor, positions: int, where: str) -> None:
        """ValueError unless `routes` is [positions, moe_layers, top_k] of expert ids."""
        want = (positions, self.moe_layers, self.top_k)
        if tuple(routes.shape) != want:
            raise ValueError(f"{where}: routes of shape {tuple(routes.shape)}, expected {want}")
        if routes.is_floating_point() or routes.is_complex():
            raise ValueError(f"{where}: routes of dtype {routes.dtype}; they must be integer expert ids")
        if routes.numel() and not (int(routes.min()) >= 0 and int(routes.max()) < self.num_experts):
            raise ValueError(f"{where}: an expert id outside [0, {self.num_experts})")

    def to_bytes(self, routes: torch.Tensor) -> bytes:
        """Compact bytes of [positions, moe_layers, top_k] routes (for checkpoints and the wire)."""
        return routes.to(self.dtype).contiguous().numpy().tobytes()

    def from_bytes(self, data: bytes) -> torch.Tensor:
        """The [positions, moe_layers, top_k] routes of `to_bytes`' bytes."""
        if len(data) % self.bytes_per_position:
            raise ValueError(f"{len(data)} bytes of routes is not a whole number of positions")
        flat = torch.frombuffer(bytearray(data), dtype=self.dtype) if data else torch.empty(0, dtype=self.dtype)
        return flat.view(-1, self.moe_layers, self.top_k)

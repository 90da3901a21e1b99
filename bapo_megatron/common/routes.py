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

from bapo_megatron.common import protocol
from bapo_megatron.config import JobConfig
from bapo_megatron.models.spec import ModelSpec

route_dtype = protocol.route_dtype


@dataclass(frozen=True)
class RouteShape:
    """What one position's routes hold: top_k experts in each MoE layer (sparse_layers, of num_layers)."""

    num_layers: int
    sparse_layers: tuple[int, ...]
    top_k: int
    num_experts: int

    @classmethod
    def of(cls, spec: ModelSpec) -> RouteShape:
        if spec.moe is None:
            raise ValueError(f"a {spec.architecture} model routes no tokens to experts")
        return cls(spec.num_layers, tuple(spec.moe.sparse_layers), spec.moe.top_k, spec.moe.num_experts)

    @property
    def moe_layers(self) -> int:
        return len(self.sparse_layers)

    @property
    def dtype(self) -> torch.dtype:
        return route_dtype(self.num_experts)

    @property
    def bytes_per_position(self) -> int:
        return self.moe_layers * self.top_k * torch.empty((), dtype=self.dtype).element_size()

    def to_bytes(self, routes: torch.Tensor) -> bytes:
        """Compact bytes of [positions, moe_layers, top_k] routes (for checkpoints and the wire)."""
        return routes.to(self.dtype).contiguous().numpy().tobytes()

    def from_engine(self, text: str | None, positions: int, where: str) -> bytes:
        """An engine's meta_info["routed_experts"] (SGLang's base64 int32 [positions, num_layers, top_k])
        as compact bytes of the MoE layers; MalformedResponse unless it holds `positions` positions of
        a router's choices (`problem`)."""
        routes = protocol.routed_experts(text, self.num_layers, self.top_k)
        if routes.shape[0] != positions:
            raise protocol.MalformedResponse(
                f"{where}: routed_experts for {routes.shape[0]} positions, expected {positions}"
            )
        try:
            compact = protocol.compact_routes(routes, self.sparse_layers, self.num_experts)
        except ValueError as err:
            raise protocol.MalformedResponse(f"{where}: {err}") from None
        problem = self.problem(compact)
        if problem:
            raise protocol.MalformedResponse(f"{where}: {problem}")
        return self.to_bytes(compact)

    def problem(self, routes: torch.Tensor) -> str | None:
        """What makes compact `routes` (a sample's, or an engine's MoE rows) no routes of this model
        (None: nothing): another shape than [positions, moe_layers, top_k], an id outside
        [0, num_experts), or one expert twice in a position's top-k. A router picks top_k distinct
        experts; a repeat would be replayed and trained as a route no router took, and an id past
        the experts fails inside Megatron's router."""
        if routes.dim() != 3 or tuple(routes.shape[1:]) != (self.moe_layers, self.top_k):
            return (
                f"routes of shape {list(routes.shape)}, not [positions, {self.moe_layers}, {self.top_k}] "
                f"(the model's {self.moe_layers} MoE layers, top-{self.top_k})"
            )
        if not routes.numel():
            return None
        low, high = int(routes.min()), int(routes.max())
        if low < 0 or high >= self.num_experts:
            return f"routes hold expert ids in [{low}, {high}], not [0, {self.num_experts}) (the model's experts)"
        ordered = routes.sort(dim=-1).values
        repeats = (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1).nonzero()
        if len(repeats):
            position, layer = (int(i) for i in repeats[0])
            return (
                f"routes name one expert twice in a top-{self.top_k} (position {position}, MoE layer "
                f"{self.sparse_layers[layer]}: experts {routes[position, layer].tolist()}); a router picks "
                "distinct experts"
            )
        return None

    def positions(self, data: bytes) -> int:
        return len(data) // self.bytes_per_position

    def from_bytes(self, data: bytes) -> torch.Tensor:
        """The [positions, moe_layers, top_k] routes of `to_bytes`' bytes."""
        if len(data) % self.bytes_per_position:
            raise ValueError(f"{len(data)} bytes of routes is not a whole number of positions")
        flat = torch.frombuffer(bytearray(data), dtype=self.dtype) if data else torch.empty(0, dtype=self.dtype)
        return flat.view(-1, self.moe_layers, self.top_k)


def recorded_routes(cfg: JobConfig, spec: ModelSpec) -> RouteShape | None:
    """The routes a job's samples keep (rollout.record_routes, by default algo.routing_replay), or None."""
    record = cfg.rollout.record_routes if cfg.rollout.record_routes is not None else cfg.algo.routing_replay
    return RouteShape.of(spec) if record and spec.moe is not None else None

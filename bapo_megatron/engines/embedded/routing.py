"""The embedded engine's record of routed experts: the experts each MoE layer's router picks for
every position a forward runs (SGLang's return_routed_experts, common/protocol.py's format).

The model's family hooks its routers (Family.hook_routes: Qwen3-MoE's, for one, takes the indices
its transformers top-k router returns, [tokens, top_k] over the forward's batch x positions,
row-major). The decode loop (decode.py) takes each forward's routes right after it and keeps them
per request, compactly (MoE layers only, protocol.route_dtype), so that a request resumed from the
prefix store still has the routes of the positions it skipped.
"""

from __future__ import annotations

import torch

from bapo_megatron.common import protocol
from bapo_megatron.models import family_of
from bapo_megatron.models.spec import ModelSpec


class RouteRecorder:
    """Records the experts a transformers mixture-of-experts model's routers pick, through the hooks
    its family puts on them; `of(model, spec)` is None for a dense one."""

    def __init__(self, model: torch.nn.Module, spec: ModelSpec) -> None:
        moe = spec.moe
        self.num_layers = spec.num_layers
        self.top_k, self.num_experts = moe.top_k, moe.num_experts
        self.dtype = protocol.route_dtype(self.num_experts)
        self._picked: list[torch.Tensor | None] = [None] * len(moe.sparse_layers)
        self.sparse_layers = family_of(spec).hook_routes(model, self._record)
        if self.sparse_layers != tuple(moe.sparse_layers):
            raise ValueError(
                f"{spec.architecture}: the served model's routers were hooked in layers {self.sparse_layers}, "
                f"its config.json routes in {tuple(moe.sparse_layers)} (Family.hook_routes)"
            )

    @classmethod
    def of(cls, model: torch.nn.Module, spec: ModelSpec) -> RouteRecorder | None:
        """A recorder of the routers of `model`, whose shape is `spec`, hooked (None: no layer routes)."""
        return cls(model, spec) if spec.moe is not None else None

    def _record(self, slot: int, indices: torch.Tensor) -> None:
        self._picked[slot] = indices

    def take(self, rows: int) -> torch.Tensor:
        """The last forward's routes as [rows, positions, moe_layers, top_k] (compact dtype), for a
        forward of `rows` sequences; forgotten here once taken."""
        assert all(p is not None for p in self._picked), "a forward did not run every router"
        picked = torch.stack(self._picked, dim=1).to(self.dtype)  # [tokens, moe_layers, top_k]
        self._picked = [None] * len(self._picked)
        return picked.view(rows, -1, *picked.shape[1:])

    def response(self, chunks: list[torch.Tensor], start: int) -> str:
        """meta_info["routed_experts"] for a request's routes `chunks` (positions [0, n) in order),
        from position `start` on: the positions it computed, dense layers DENSE_LAYER_EXPERT."""
        compact = torch.cat(chunks)[start:] if chunks else torch.empty(0, len(self.sparse_layers), self.top_k)
        return protocol.encode_routed_experts(protocol.expand_routes(compact, self.num_layers, self.sparse_layers))

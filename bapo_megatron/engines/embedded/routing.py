"""The embedded engine's record of routed experts: the experts each MoE layer's router picks for
every position a forward runs (SGLang's return_routed_experts, common/protocol.py's format).

Forward hooks on transformers' Qwen3-MoE routers (`Qwen3MoeTopKRouter.forward` returns
(logits, scores, indices), indices [tokens, top_k] over the forward's batch x positions, row-major).
The decode loop (decode.py) takes each forward's routes right after it and keeps them per request, compactly
(MoE layers only, protocol.route_dtype), so that a request resumed from the prefix store still has
the routes of the positions it skipped.
"""

from __future__ import annotations

from functools import partial

import torch

from bapo_megatron.common import protocol


class RouteRecorder:
    """Records the experts a transformers mixture-of-experts model's routers pick, through hooks on
    them; `of(model)` is None for a dense one."""

    def __init__(self, model: torch.nn.Module, found: list[tuple[int, torch.nn.Module]]) -> None:
        self.num_layers = len(model.model.layers)
        self.sparse_layers = tuple(layer for layer, _ in found)
        self.top_k = int(found[0][1].top_k)
        self.num_experts = int(found[0][1].num_experts)
        self.dtype = protocol.route_dtype(self.num_experts)
        self._picked: list[torch.Tensor | None] = [None] * len(found)
        for slot, (_, router) in enumerate(found):
            router.register_forward_hook(partial(self._hook, slot))

    @classmethod
    def of(cls, model: torch.nn.Module) -> RouteRecorder | None:
        """A recorder of the model's routers, hooked (None: no layer routes to experts)."""
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        layers = getattr(getattr(model, "model", None), "layers", [])
        found = [
            (i, layer.mlp.gate)
            for i, layer in enumerate(layers)
            if isinstance(getattr(layer.mlp, "gate", None), Qwen3MoeTopKRouter)
        ]
        return cls(model, found) if found else None

    def _hook(self, slot: int, module: torch.nn.Module, args, output: tuple) -> None:
        self._picked[slot] = output[2]

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

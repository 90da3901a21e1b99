"""The embedded engine's requests: one request's generation state, the reasons it finishes with,
and the queue it arrives, waits and runs in."""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bapo_megatron.common.protocol import SamplingParams
from bapo_megatron.engines.embedded.http import one_line


@dataclass
class EngineRequest:
    """One /generate request inside the engine: its input, its sampling, and what it has made so far."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    on_finish: Callable[[EngineRequest], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[list] = field(default_factory=list)  # [version, start, end] over output tokens
    finish: dict | None = None
    generator: torch.Generator | None = None
    routes: list[torch.Tensor] = field(default_factory=list)
    """A MoE model's routes of the positions run so far, [0, n) in order: [positions, moe_layers, top_k] chunks."""
    lora_id: str | None = None
    """The LoRA adapter it runs under (lora.py's Adapter.id; None: the base model)."""

    @property
    def length(self) -> int:
        return len(self.input_ids) + len(self.output_ids)


def failure(err: Exception) -> dict:
    """The finish reason of a request that met an error of its own (status 500, one line, no traceback)."""
    message = f"request failed: {one_line(err)}"
    return {"type": "abort", "message": message, "status_code": 500, "err_type": type(err).__name__}


class RequestQueue:
    """The requests in the engine: arrived (from any thread), waiting, and running, where running[i]
    owns slot i of the KV cache. Each request gets its own sampling generator as it arrives."""

    def __init__(self, seed: int, vocab_size: int) -> None:
        self.seed = seed
        self.vocab_size = vocab_size
        self.incoming: collections.deque[EngineRequest] = collections.deque()  # added by other threads
        self.waiting: list[EngineRequest] = []
        self.running: list[EngineRequest] = []
        self._count = 0
        self._ids: dict[str, EngineRequest] = {}
        """Every added request by id, pruned lazily: the engine's thread moves requests between the
        lists (and drops finished ones) without telling the queue, so an entry is trusted only after
        checking that its request is still in a list."""
        self._prune_at = 64

    def _in_flight(self, rid: str) -> bool:
        """Whether a request with id `rid` is arrived, waiting or running (a set look-up, not a scan
        of every request in flight per arrival, which made a burst quadratic)."""
        known = self._ids.get(rid)
        if known is None:
            return False
        # requests enter the lists only through add, which keeps the newest of an id here
        return any(r is known for requests in (self.incoming, self.waiting, self.running) for r in requests)

    def _prune(self) -> None:
        """Forget the ids of requests that left once they outnumber the ones in flight (amortised O(1))."""
        if len(self._ids) >= self._prune_at:
            self._ids = {r.rid: r for requests in (self.incoming, self.waiting, self.running) for r in requests}
            self._prune_at = 2 * len(self._ids) + 64

    def add(self, request: EngineRequest) -> None:
        """Queue a request; safe to call from another thread while a step runs."""
        if self._in_flight(request.rid):
            raise ValueError(f"request id {request.rid!r} is already in flight")
        vocab = self.vocab_size
        if not request.input_ids or any(not 0 <= t < vocab for t in request.input_ids):
            raise ValueError(f"input_ids must be a non-empty list of token ids in [0, {vocab})")
        seed = request.sampling.sampling_seed
        self._count += 1
        request.generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self._count if seed is None else seed)
        self._prune()
        self._ids[request.rid] = request
        self.incoming.append(request)

    def admit(self) -> None:
        """The requests that arrived join the waiting ones (on the engine's thread)."""
        while self.incoming:
            self.waiting.append(self.incoming.popleft())

    @property
    def busy(self) -> bool:
        return bool(self.incoming or self.waiting or self.running)

    def matching(self, rid: str | None) -> list[EngineRequest]:
        """The waiting and running requests with id `rid` (None: all of them), arrivals admitted first."""
        self.admit()
        return [r for r in self.waiting + self.running if rid is None or r.rid == rid]

    def retract(self) -> None:
        """Every running request back to the front of the waiting ones (their caches are dropped)."""
        self.waiting = self.running + self.waiting
        self.running = []

    def slot_of(self, request: EngineRequest) -> int | None:
        """The slot `request` runs in (None: it is not running)."""
        return next((i for i, r in enumerate(self.running) if r is request), None)

    def vacate(self, slot: int) -> int | None:
        """Free `slot`: the last running request moves into it; the slot it moved from (None: `slot` was the last)."""
        last = self.running.pop()
        if slot == len(self.running):
            return None
        self.running[slot] = last
        return len(self.running)

"""The embedded engine's decode loop: one step decodes the running requests together, then prefills
the waiting ones, each request in a slot of one preallocated KV buffer per layer (slots.py).

Running request i owns slot i, its cached positions [0, n_i). A decode step writes each request's
new key/value at its own position in place and attends over the slots' first max(n_i) + 1
positions with a per-row mask, so nothing is copied per step (a finished request's slot is refilled
by moving the last one into it). A request cut short leaves its keys and values in the prefix store
(prefixes.py), whence it resumes without a prefill. Requests arriving together are prefilled in
forwards of similar lengths (prefill_chunks), unmasked and right-padded, with logits at each row's
last token only; requests of one sequence under one adapter (a group's samples of one prompt) share
a row of the forward, whose keys and values each copies into its own slot and whose logits each
samples from with its own draw (SGLang shares them through its radix cache). A mixture-of-experts
model's routes (the experts each position went to) are kept per request and with its stored prefix
(routing.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache

from bapo_megatron.common.protocol import extend_spans
from bapo_megatron.engines.embedded import sampling
from bapo_megatron.engines.embedded.lora import ServedAdapters
from bapo_megatron.engines.embedded.prefixes import PrefixStore
from bapo_megatron.engines.embedded.request_queue import EngineRequest, RequestQueue, failure
from bapo_megatron.engines.embedded.routing import RouteRecorder
from bapo_megatron.engines.embedded.slots import SlotKV

COUNTERS = (
    "decode_steps",
    "decode_tokens",
    "prefill_forwards",
    "prefill_requests",
    "prefill_positions",
    "prefix_hits",
)
"""Running totals, for the server's throughput log: decode steps and the tokens they made, prefill
forwards, the requests and the (padded) positions they ran, prefix-store hits."""

# A prefill forward's fixed cost, in padded token positions. Measured on the tiny model (2 cores):
# 43 resumed requests of 10-450 tokens took 467 ms in one forward, 296 ms in 42, 175-236 ms in
# the 10 that 64 gives (attention's cost grows with the square of the length, favouring splits).
PREFILL_OVERHEAD_POSITIONS = 64

# An idle engine's first step waits while requests keep arriving, so that a burst (a step's samples,
# one HTTP request each, parsed one after another by the server's event loop) prefills in one
# forward and decodes in step. Measured (tiny model, 256 requests of 8 + 6 tokens, 1 thread): without
# it 10 prefill forwards and 14 decode steps a burst, 1.7x the engine CPU of one forward and 6 steps.
# A lone request waits one gap; a request arriving at a busy engine never waits.
ARRIVAL_GAP_S = 0.005
"""The wait ends once no request arrived for this long..."""
ARRIVAL_WAIT_S = 0.1
"""...or after this long in all."""


class DecodeLoop:
    """The model's forwards over the queue's requests, one `step()` at a time (the caller owns the
    loop and the locking). batch_invariant: every request runs alone in its forwards, over a cache
    of its own, and keeps no prefix (see EngineCore; so does a model whose cache is not by position)."""

    def __init__(
        self,
        model: torch.nn.Module,
        route_recorder: RouteRecorder | None,
        eos: set[int],
        queue: RequestQueue,
        prefixes: PrefixStore,
        generator: torch.Generator,
        max_batch: int,
        batch_invariant: bool,
    ) -> None:
        self.model, self.route_recorder, self.eos = model, route_recorder, eos
        self.queue, self.prefixes = queue, prefixes
        self.generator = generator  # plain sampling's, for every request without a seed of its own
        self.max_batch, self.batch_invariant = max_batch, batch_invariant
        self.version = "0"  # the weights' version, stamped on the tokens made with them
        self.kv = SlotKV(max_batch)
        self.adapters = ServedAdapters(model)  # LoRA: each request's rows of a forward under its adapter
        self._alone: dict[str, Cache] = {}  # batch_invariant: request id -> its own cache
        self._freed: list[int] | None = None  # slots freed in a decode step, compacted at its end
        self.counters = dict.fromkeys(COUNTERS, 0)

    # -- the cache --------------------------------------------------------------------------
    def retract(self) -> None:
        """Forget every running request's KV cache: they re-prefill. The prefix store stays."""
        self.queue.retract()
        self._alone.clear()

    def flush(self) -> None:
        """Forget every cached key and value (the weights changed): running requests re-prefill."""
        self.retract()
        self.prefixes.clear()

    def free_cache(self) -> None:
        """Give the slotted cache's memory back (it is reallocated on demand)."""
        self.kv = SlotKV(self.max_batch)

    # -- a step -----------------------------------------------------------------------------
    def step(self) -> list[EngineRequest]:
        """One batched decode step of the running requests, then one batched prefill of the waiting
        ones (up to max_batch running), which samples their first tokens."""
        queue = self.queue
        finished: list[EngineRequest] = []
        self._gather_arrivals()
        queue.admit()
        admitted: list[EngineRequest] = []
        try:
            with torch.no_grad():
                while queue.waiting and len(queue.running) + len(admitted) < self.max_batch:
                    request = queue.waiting.pop(0)
                    if request.sampling.max_new_tokens <= len(request.output_ids):
                        self.finish(request, {"type": "length", "length": len(request.output_ids)})
                        finished.append(request)
                    elif not self._resume(request):  # cached: it decodes with the others, no prefill
                        admitted.append(request)
                if queue.running:  # decode the running ones first: arrivals never starve them
                    finished += self._decode()
                if admitted:
                    finished += self._prefill(admitted)
        except BaseException:
            # the step failed: requests taken off the queue and not yet running go back on it, where
            # the caller's abort finds them (else their clients would wait forever)
            running = {id(r) for r in queue.running}
            queue.waiting[:0] = [r for r in admitted if r.finish is None and id(r) not in running]
            raise
        return finished

    def _gather_arrivals(self) -> None:
        """Nothing running: wait while requests keep arriving (ARRIVAL_GAP_S, ARRIVAL_WAIT_S), up to
        max_batch. Sleeping lets the server's thread take the GIL and hand in the burst's rest."""
        queue = self.queue
        if queue.running or self.batch_invariant:
            return
        deadline = time.monotonic() + ARRIVAL_WAIT_S
        seen = len(queue.incoming)
        while seen + len(queue.waiting) < self.max_batch and time.monotonic() < deadline:
            time.sleep(ARRIVAL_GAP_S)
            if len(queue.incoming) == seen:
                return
            seen = len(queue.incoming)

    def _resume(self, request: EngineRequest) -> bool:
        """Take the request a slot with its cached prefix (all but its last token), if stored."""
        if not self.prefixes.resume(request, self.kv, len(self.queue.running)):
            return False
        self.queue.running.append(request)
        self.counters["prefix_hits"] += 1
        return True

    def _prefill(self, batch: list[EngineRequest]) -> list[EngineRequest]:
        """Prefill the requests in forwards of similar lengths (see prefill_chunks); each unfinished
        one takes the next free slot. Batch-invariant: each alone."""
        finished = []
        if self.batch_invariant:
            for request in batch:
                finished += self._forward_alone(request, request.input_ids + request.output_ids)
            return finished
        for chunk in prefill_chunks([r.length for r in batch], PREFILL_OVERHEAD_POSITIONS):
            finished += self._prefill_chunk([batch[i] for i in chunk])
        return finished

    def _prefill_chunk(self, batch: list[EngineRequest]) -> list[EngineRequest]:
        """One forward over the requests' distinct sequences (shared_rows), right-padded and with no
        attention mask: under the causal mask a real token never attends to a pad after it, so the
        padding changes nothing a request keeps (its first len(seq) keys/values, the logits at its
        last token), and attention runs on the fused causal kernel. Logits only at each row's last token."""
        sequences = [r.input_ids + r.output_ids for r in batch]
        row_of, firsts = shared_rows(batch, sequences)
        longest = max(len(s) for s in sequences)
        ids = torch.zeros(len(firsts), longest, dtype=torch.long)
        for row, b in enumerate(firsts):
            ids[row, : len(sequences[b])] = torch.tensor(sequences[b])
        self.counters["prefill_forwards"] += 1
        self.counters["prefill_requests"] += len(batch)
        self.counters["prefill_positions"] += ids.numel()
        ends = torch.tensor([[len(sequences[b]) - 1] for b in firsts])
        out = self._forward([batch[b] for b in firsts], input_ids=ids, use_cache=True, logits_to_keep=ends)
        self._keep_routes(batch, [len(seq) for seq in sequences], fresh=True, rows=row_of)
        layers = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        self.kv.reserve(layers, longest + 1, reach([*self.queue.running, *batch]))
        logits = out.logits[:, -1] if len(firsts) == len(batch) else out.logits[torch.tensor(row_of), -1]
        finished, kept = [], []
        for b, (request, picked) in enumerate(zip(batch, self._sample(batch, logits), strict=True)):
            if isinstance(picked, Exception) or self._emit(request, *picked):
                if isinstance(picked, Exception):
                    self.finish(request, failure(picked))
                finished.append(request)
            else:
                kept.append(b)
        # the unfinished rows into the next free slots at once (padding past a row's length is
        # copied too: its decode steps overwrite and mask those positions)
        self.kv.put_rows(len(self.queue.running), layers, [row_of[b] for b in kept], longest)
        self.queue.running += [batch[b] for b in kept]
        return finished

    def _keep_routes(
        self, batch: list[EngineRequest], lengths: list[int], fresh: bool, rows: list[int] | None = None
    ) -> None:
        """A MoE model's routes of the forward just run, kept with its requests: batch[b]'s are the first
        lengths[b] positions (the rest is padding) of the forward's row rows[b] (None: row b), after
        the request's earlier ones, or instead of them when `fresh` (a prefill runs every position
        anew: a retracted request's again)."""
        if self.route_recorder is None:
            return
        rows = rows or list(range(len(batch)))
        picked = self.route_recorder.take(max(rows) + 1)
        for request, row, n in zip(batch, rows, lengths, strict=True):
            if fresh:
                request.routes = []
            request.routes.append(picked[row, :n].clone())

    def _forward_alone(self, request: EngineRequest, ids: list[int]) -> list[EngineRequest]:
        """Batch-invariant mode: one forward of `request` alone over its own cache (none: a prefill
        of `ids`) and its next token; [request] when it finished."""
        out = self._forward(
            [request],
            input_ids=torch.tensor([ids]),
            past_key_values=self._alone.get(request.rid),
            use_cache=True,
            logits_to_keep=1,
        )
        self._keep_routes([request], [len(ids)], fresh=request.rid not in self._alone)
        if request.rid in self._alone:  # a decode step of one token
            self.counters["decode_steps"] += 1
            self.counters["decode_tokens"] += 1
        else:
            self.counters["prefill_forwards"] += 1
            self.counters["prefill_requests"] += 1
            self.counters["prefill_positions"] += len(ids)
        (picked,) = self._sample([request], out.logits[:, -1])
        if isinstance(picked, Exception):
            self.finish(request, failure(picked))
            return [request]
        if self._emit(request, *picked):
            return [request]
        if request.rid not in self._alone:
            self.queue.running.append(request)
        self._alone[request.rid] = out.past_key_values
        return []

    def _decode(self) -> list[EngineRequest]:
        """One token for every running request: each writes its new key/value at its own position,
        attending to its slot's cached positions and nothing past them. Batch-invariant: each alone."""
        if self.batch_invariant:
            finished = []
            for request in list(self.queue.running):
                finished += self._forward_alone(request, [(request.output_ids or request.input_ids)[-1]])
            return finished
        batch = list(self.queue.running)
        positions = torch.tensor([r.length - 1 for r in batch])  # cached positions; the last token is the input
        span = int(positions.max()) + 1
        self.kv.reserve(self.kv.layers(), span, reach(batch))
        blocked = (torch.arange(span)[None, :] > positions[:, None])[:, None, None, :]
        dtype = self.model.dtype
        mask = torch.zeros(len(batch), 1, 1, span, dtype=dtype).masked_fill(blocked, torch.finfo(dtype).min)
        last = [(r.output_ids or r.input_ids)[-1] for r in batch]  # a resumed request's input is its last token
        out = self._forward(
            batch,
            input_ids=torch.tensor([last]).T,
            attention_mask=mask,
            position_ids=positions[:, None],
            past_key_values=self.kv.step_cache(positions),
            use_cache=True,
        )
        self._keep_routes(batch, [1] * len(batch), fresh=False)
        picked = self._sample(batch, out.logits[:, -1])
        self.counters["decode_steps"] += 1
        self.counters["decode_tokens"] += len(batch)
        finished = []
        self._freed = []  # the finished requests' slots are compacted once, not moved one by one
        try:
            for r, choice in zip(batch, picked, strict=True):
                if isinstance(choice, Exception):
                    self.finish(r, failure(choice))
                    finished.append(r)
                elif self._emit(r, *choice):
                    finished.append(r)
        finally:
            self._compact()
        return finished

    def _compact(self) -> None:
        """Fill the slots freed in a decode step with the running requests of the last slots, as
        one-by-one vacating does, but in one copy per layer (only the requests that move)."""
        freed, self._freed = set(self._freed or ()), None
        if not freed:
            return
        running = self.queue.running
        remaining = len(running) - len(freed)
        holes = sorted(f for f in freed if f < remaining)
        movers = [i for i in range(remaining, len(running)) if i not in freed]
        for hole, mover in zip(holes, movers, strict=True):
            running[hole] = running[mover]
        cached = max((running[m].length for m in movers), default=0)  # what the movers have cached, and more
        del running[remaining:]
        self.kv.move_slots(movers, holes, min(cached, self.kv.capacity))

    def _forward(self, batch: list[EngineRequest], **inputs):
        """The model's forward, row b under batch[b]'s LoRA adapter (lora.py; none: the base model)."""
        with self.adapters.rows(batch):
            return self.model(**inputs)

    def _sample(self, batch: list[EngineRequest], logits: torch.Tensor) -> list[tuple[int, float] | Exception]:
        return sampling.sample_rows(batch, logits, self.generator)

    # -- a request's end --------------------------------------------------------------------
    def _emit(self, request: EngineRequest, token: int, logprob: float) -> bool:
        """Append a sampled token to `request`; True when it finished."""
        request.output_ids.append(token)
        request.logprobs.append(logprob)
        n = len(request.output_ids)
        extend_spans(request.spans, self.version, n)
        s = request.sampling
        if token in s.stop_token_ids or (not s.ignore_eos and token in self.eos):
            self.finish(request, {"type": "stop", "matched": token})
        elif n >= s.max_new_tokens:
            self.finish(request, {"type": "length", "length": n})
        return request.finish is not None

    def finish(self, request: EngineRequest, reason: dict) -> None:
        """End `request` with `reason`: off the queue, its slot refilled, its prefix stored when it was
        cut short (length, or an abort that is no error: it may come back for more), its callback run."""
        request.finish = reason
        self.queue.waiting = [r for r in self.queue.waiting if r is not request]
        slot = self.queue.slot_of(request)
        cut = reason["type"] in ("length", "abort") and reason.get("status_code") is None
        if self.batch_invariant:
            self._alone.pop(request.rid, None)  # and no prefix kept: its next round prefills anew
        elif slot is not None and cut:
            self.prefixes.keep(request, self.kv, slot, with_routes=self.route_recorder is not None)
        if slot is not None and self._freed is not None:  # in a decode step: compacted at its end
            self._freed.append(slot)
        elif slot is not None:  # the last slot's request moves into the freed one
            moved_from = self.queue.vacate(slot)
            if moved_from is not None:
                self.kv.move(moved_from, slot)
        if request.on_finish is not None:
            request.on_finish(request)


def reach(requests: Sequence[EngineRequest]) -> int:
    """The most positions any of `requests` can hold: its prompt and max_new_tokens of output."""
    return max(len(r.input_ids) + r.sampling.max_new_tokens for r in requests)


def shared_rows(batch: Sequence[EngineRequest], sequences: Sequence[list[int]]) -> tuple[list[int], list[int]]:
    """The rows of a prefill forward over `batch`: requests of one sequence under one adapter share a
    row (their forwards would be the same). Returns row_of (batch[b] is computed in row row_of[b])
    and firsts (row r computes batch[firsts[r]]'s sequence)."""
    rows: dict[tuple, int] = {}
    row_of, firsts = [], []
    for b, (request, seq) in enumerate(zip(batch, sequences, strict=True)):
        key = (request.lora_id, *seq)
        if key not in rows:
            rows[key] = len(firsts)
            firsts.append(b)
        row_of.append(rows[key])
    return row_of, firsts


def prefill_chunks(lengths: Sequence[int], overhead: int) -> list[list[int]]:
    """Split a prefill batch into forwards of similar lengths: indices into `lengths`, longest first.
    A forward over rows padded to its longest costs `overhead` + rows x longest positions; the
    split of the length-sorted rows into contiguous runs that minimises the total is exact (a
    dynamic programme). A cut only ever falls where the length changes (a cut between rows of
    one length pads nothing less and adds an overhead), so the programme runs over the distinct
    lengths: a step's samples of one prompt length cost one comparison, not max_batch squared."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    starts = [i for i in range(len(order)) if i == 0 or lengths[order[i]] != lengths[order[i - 1]]]
    bounds = [*starts, len(order)]  # run r: rows bounds[r]..bounds[r + 1] - 1, all of one length
    best = [0] + [None] * len(starts)  # best[j]: cost of the first j runs
    cut = [0] * (len(starts) + 1)
    for j in range(1, len(starts) + 1):
        for i in range(j):  # runs i..j-1 in one forward, padded to run i's length
            cost = best[i] + overhead + (bounds[j] - bounds[i]) * lengths[order[bounds[i]]]
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    chunks, j = [], len(starts)
    while j:
        chunks.append(order[bounds[cut[j]] : bounds[j]])
        j = cut[j]
    return chunks[::-1]

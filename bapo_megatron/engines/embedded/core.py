"""The embedded engine's model loop: a transformers model, a slotted KV cache, batched decoding.

No HTTP here (engines/embedded/server.py serves it). The running requests' keys and values live in
one preallocated buffer per layer (SlotKV): running request i owns slot i, its cached
positions [0, n_i). A decode step writes each request's new key/value at its own position
in place and attends over the slots' first max(n_i) + 1 positions with a per-row mask, so
nothing is copied per step (a finished request's slot is refilled by moving the last one
into it). A request cut short (max_new_tokens or abort) leaves its keys and values in a
small prefix store; resubmitted as prompt + partial response (partial rollout's next round)
it takes them back and skips its prefill, as SGLang's radix cache would. The store is
emptied whenever weights change. Requests arriving together are prefilled in forwards of
similar lengths (prefill_chunks), unmasked and right-padded, with logits at each row's last
token only. Log-probs are log_softmax(logits / T) over the full
vocabulary, as SGLang reports them (top-p/top-k shape the sampling distribution only);
T = 0 is greedy, with log_softmax(logits). The model runs in the dtype asked for (float32, or
bfloat16 as a GPU engine would; weights sent in another dtype are cast as they are loaded). A
mixture-of-experts model's routes (the experts each position went to) are kept per request
and with its stored prefix (engines/embedded/routing.py); weights may come one tensor per
expert, the checkpoints' names, into transformers' fused expert parameters (common/hf_experts.py).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.cache_utils import Cache

from bapo_megatron.common.hf_experts import expert_slot, hf_target, per_expert
from bapo_megatron.common.protocol import SAMPLING_EPS, SamplingParams, extend_spans
from bapo_megatron.engines.embedded.routing import Routers
from bapo_megatron.engines.embedded.slots import SlotKV


@dataclass
class _Prefix:
    """What the prefix store keeps of a request cut short, for its cached positions [0, n)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values) [kv_heads, n, head_dim]
    routes: torch.Tensor | None  # [n, moe_layers, top_k] (a MoE model)


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    on_finish: Callable[[Request], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[list] = field(default_factory=list)  # [version, start, end] over output tokens
    finish: dict | None = None
    generator: torch.Generator | None = None
    routes: list[torch.Tensor] = field(default_factory=list)
    """A MoE model's routes of the positions run so far, [0, n) in order: [positions, moe_layers, top_k] chunks."""

    @property
    def length(self) -> int:
        return len(self.input_ids) + len(self.output_ids)


def _eos_ids(model) -> set[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return ids


class EngineCore:
    """Requests in, tokens out, one `step()` at a time (the caller owns the loop and the locking)."""

    def __init__(
        self,
        model_dir: str | Path,
        seed: int = 0,
        max_batch: int = 64,
        batch_invariant: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """dtype: the weights' and activations' (log-probs are computed in float32 from its logits).
        batch_invariant: every request runs alone in its forwards (its prefill, then one decode
        forward a token, over a cache of its own), and the prefix store is off, so a request's
        tokens and log-probs depend on nothing but its input, its sampling seed and the weights:
        never on what else runs or arrives when (SGLang's --enable-deterministic-inference). It
        is for deterministic runs and costs the batching."""
        import transformers

        self.model_dir = str(model_dir)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=dtype, use_safetensors=True
        ).eval()
        self.routers = Routers.of(self.model)  # None: a dense model
        self.eos = _eos_ids(self.model)
        self.seed = seed
        self.max_batch = max_batch
        self.batch_invariant = batch_invariant
        self._alone: dict[str, Cache] = {}  # batch_invariant: request id -> its own cache
        self.version = "0"
        self.incoming: collections.deque[Request] = collections.deque()  # added by other threads
        self.generator = torch.Generator().manual_seed(seed)
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # running[i] owns slot i of self.kv
        self.kv = SlotKV(max_batch)
        # token ids -> the cached positions of a request cut short
        self.prefixes: collections.OrderedDict[tuple[int, ...], _Prefix] = collections.OrderedDict()
        # running totals, for the server's throughput log: decode steps and the tokens they made,
        # prefill forwards, the requests and the (padded) positions they ran, prefix-store hits
        self.counters = dict.fromkeys(
            (
                "decode_steps",
                "decode_tokens",
                "prefill_forwards",
                "prefill_requests",
                "prefill_positions",
                "prefix_hits",
            ),
            0,
        )
        self._count = 0
        self.released: set[str] = set()  # memory tags released (SGLang's release_memory_occupation)
        self._shapes: dict[int, tuple[torch.Size, torch.dtype]] = {}  # id(parameter) -> its shape, while released
        self._unloaded: set[tuple] = set()  # tensors resumed without values, not loaded since (_load_unit)

    # -- requests -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request; safe to call from another thread while a step runs."""
        if any(r.rid == request.rid for r in [*self.incoming, *self.waiting, *self.running]):
            raise ValueError(f"request id {request.rid!r} is already in flight")
        vocab = self.model.config.vocab_size
        if not request.input_ids or any(not 0 <= t < vocab for t in request.input_ids):
            raise ValueError(f"input_ids must be a non-empty list of token ids in [0, {vocab})")
        seed = request.sampling.sampling_seed
        self._count += 1
        request.generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self._count if seed is None else seed)
        self.incoming.append(request)

    def _admit(self) -> None:
        while self.incoming:
            self.waiting.append(self.incoming.popleft())

    def abort(
        self,
        rid: str | None = None,
        message: str = "aborted",
        status_code: int | None = None,
        err_type: str | None = None,
    ) -> int:
        """Finish (with finish reason abort and their partial output) one request, or all if rid is None;
        an internal error passes its message, 500 and its type. Not concurrently with step()."""
        self._admit()
        hit = [r for r in self.waiting + self.running if rid is None or r.rid == rid]
        for r in hit:
            self._finish(r, {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type})
        return len(hit)

    def drop_caches(self) -> None:
        """Forget every running request's KV cache (retract): they re-prefill. The prefix store stays."""
        self.waiting = self.running + self.waiting
        self.running = []
        self._alone.clear()

    def flush(self) -> None:
        """Forget every cached key and value (the weights changed): running requests re-prefill."""
        self.drop_caches()
        self.prefixes.clear()

    @property
    def busy(self) -> bool:
        return bool(self.incoming or self.waiting or self.running)

    @property
    def context_length(self) -> int:
        """The most tokens (prompt and output) a request may hold: the model's position range."""
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 20)

    def shrink(self) -> None:
        """Free the slotted cache's memory when no request runs (it is reallocated on demand)."""
        if not self.running and self.kv.capacity:
            self.kv = SlotKV(self.max_batch)

    # -- memory ---------------------------------------------------------------------------
    def release_memory(self, tags: Sequence[str], paused: bool = False) -> None:
        """Free memory as SGLang's release_memory_occupation does under its memory saver: kv_cache
        drops the slotted cache and the prefix store; weights frees every parameter's storage
        (their values are lost, as SGLang's are: resume, then load weights); cuda_graph holds
        nothing here. Only when idle: no request running, and none waiting unless `paused`."""
        self._admit()
        if self.running or (self.waiting and not paused):
            raise ValueError("release_memory_occupation should be called only when the engine is idle (or paused)")
        if "kv_cache" in tags:
            self.flush()
            self.kv = SlotKV(self.max_batch)
        if "weights" in tags and "weights" not in self.released:
            for param in self.model.parameters():  # tied weights are one parameter
                self._shapes[id(param)] = (param.shape, param.dtype)
                param.data = torch.empty(0, dtype=param.dtype)
        self.released.update(tags)

    def resume_memory(self, tags: Sequence[str]) -> None:
        """Take released memory back; resumed weights hold no values until loaded."""
        if not set(tags) <= self.released:
            raise ValueError(f"cannot resume {sorted(set(tags) - self.released)}: not released")
        if "weights" in tags:
            for param in self.model.parameters():
                shape, dtype = self._shapes.pop(id(param))
                param.data = torch.empty(shape, dtype=dtype)
            state = self.model.state_dict(keep_vars=True)
            self._unloaded = {_load_unit(name, state) for name, _ in per_expert(state)}
        self.released.difference_update(tags)

    def can_generate(self) -> str | None:
        """Why generation cannot run now (memory released, weights not reloaded since), or None."""
        if self.released & {"weights", "kv_cache"}:
            return f"memory released ({', '.join(sorted(self.released))}): resume it first"
        if self._unloaded:
            return (
                f"{len(self._unloaded)} weight tensors were released and have not been loaded since: "
                "update the weights first"
            )
        return None

    # -- weights --------------------------------------------------------------------------
    def check_weights(self, announced: Iterable[tuple[str, torch.dtype, Sequence[int]]]) -> None:
        """ValueError naming the first (name, dtype, shape) that cannot be loaded into the served model:
        a name it has no parameter of, a dtype not floating point, another shape. Names are HF's:
        a MoE layer's experts one tensor each (`mlp.experts.E.gate_proj.weight`), checked against
        their slot in the fused parameter. What an update announces is checked with this before
        anything of it is allocated."""
        if "weights" in self.released:
            raise ValueError("the weights are released: resume_memory_occupation(weights) before loading them")
        state = self.model.state_dict(keep_vars=True)
        for name, dtype, shape in announced:
            target = hf_target(name, state)
            if target is None:
                raise ValueError(f"{name}: the model has no such parameter")
            if not dtype.is_floating_point:
                raise ValueError(f"{name}: dtype {dtype}; weights must be floating point")
            if tuple(shape) != tuple(target.shape):
                raise ValueError(f"{name}: shape {tuple(shape)}, the model's is {tuple(target.shape)}")

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors into the model (cast to its dtype); all are checked before any is copied."""
        pending = list(tensors)
        self.check_weights((name, tensor.dtype, tensor.shape) for name, tensor in pending)
        state = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in pending:
                hf_target(name, state).copy_(tensor)
                self._unloaded.discard(_load_unit(name, state))
        self.prefixes.clear()  # computed with the old weights
        return len(pending)

    # -- the loop -------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One batched decode step of the running requests, then one batched prefill of the waiting
        ones (up to max_batch running), which samples their first tokens."""
        finished: list[Request] = []
        self._admit()
        admitted: list[Request] = []
        try:
            with torch.no_grad():
                while self.waiting and len(self.running) + len(admitted) < self.max_batch:
                    request = self.waiting.pop(0)
                    if request.sampling.max_new_tokens <= len(request.output_ids):
                        self._finish(request, {"type": "length", "length": len(request.output_ids)})
                        finished.append(request)
                    elif not self._resume(request):  # cached: it decodes with the others, no prefill
                        admitted.append(request)
                if self.running:  # decode the running ones first: arrivals never starve them
                    finished += self._decode()
                if admitted:
                    finished += self._prefill(admitted)
        except BaseException:
            # the step failed: requests taken off the queue and not yet running go back on it, where
            # the caller's abort finds them (else their clients would wait forever)
            running = {id(r) for r in self.running}
            self.waiting[:0] = [r for r in admitted if r.finish is None and id(r) not in running]
            raise
        return finished

    def _resume(self, request: Request) -> bool:
        """Take the request a slot with its cached prefix (all but its last token), if stored."""
        cached = self.prefixes.pop(_prefix_key(request), None)
        if cached is None:
            return False
        # the cache may have been given back while idle (shrink): room for this prefix first
        self.kv.reserve([(k.unsqueeze(0), v.unsqueeze(0)) for k, v in cached.layers], request.length)
        self.kv.put(len(self.running), cached.layers, request.length - 1)
        request.routes = [] if cached.routes is None else [cached.routes]
        self.running.append(request)
        self.counters["prefix_hits"] += 1
        return True

    def _keep_prefix(self, request: Request, slot: int) -> None:
        length = request.length - 1  # cached positions: every token but the last sampled one
        layers = [(k[slot, :, :length].clone(), v[slot, :, :length].clone()) for k, v in self.kv.layers()]
        routes = torch.cat(request.routes) if self.routers is not None else None
        assert routes is None or len(routes) == length, "routes of every cached position"
        self.prefixes[_prefix_key(request)] = _Prefix(layers, routes)
        # at most as many positions as the slots hold: the store never more than doubles the cache
        limit = self.kv.slots * self.kv.capacity
        stored = sum(len(key) for key in self.prefixes)
        while stored > limit:
            key, _ = self.prefixes.popitem(last=False)  # the oldest first
            stored -= len(key)

    def _prefill(self, batch: list[Request]) -> list[Request]:
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

    def _prefill_chunk(self, batch: list[Request]) -> list[Request]:
        """One forward over the requests' whole sequences, right-padded and with no attention mask:
        under the causal mask a real token never attends to a pad after it, so the padding changes
        nothing a request keeps (its first len(seq) keys/values, the logits at its last token), and
        attention runs on the fused causal kernel. Logits only at each row's last token."""
        sequences = [r.input_ids + r.output_ids for r in batch]
        longest = max(len(s) for s in sequences)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        for b, seq in enumerate(sequences):
            ids[b, : len(seq)] = torch.tensor(seq)
        self.counters["prefill_forwards"] += 1
        self.counters["prefill_requests"] += len(batch)
        self.counters["prefill_positions"] += ids.numel()
        ends = torch.tensor([[len(seq) - 1] for seq in sequences])
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=ends)
        self._keep_routes(batch, [len(seq) for seq in sequences], fresh=True)
        layers = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        self.kv.reserve(layers, longest + 1)
        finished = []
        for b, (request, seq, picked) in enumerate(
            zip(batch, sequences, self._sample(batch, out.logits[:, -1]), strict=True)
        ):
            if isinstance(picked, Exception) or self._emit(request, *picked):
                if isinstance(picked, Exception):
                    self._fail(request, picked)
                finished.append(request)
                continue
            self.kv.put(len(self.running), [(k[b], v[b]) for k, v in layers], len(seq))
            self.running.append(request)
        return finished

    def _keep_routes(self, batch: list[Request], lengths: list[int], fresh: bool) -> None:
        """A MoE model's routes of the forward just run, kept with its requests: row b's first
        lengths[b] positions (the rest is padding), after the request's earlier ones, or instead of
        them when `fresh` (a prefill runs every position anew: a retracted request's again)."""
        if self.routers is None:
            return
        picked = self.routers.take(len(batch))
        for b, (request, n) in enumerate(zip(batch, lengths, strict=True)):
            if fresh:
                request.routes = []
            request.routes.append(picked[b, :n].clone())

    def _forward_alone(self, request: Request, ids: list[int]) -> list[Request]:
        """Batch-invariant mode: one forward of `request` alone over its own cache (none: a prefill
        of `ids`) and its next token; [request] when it finished."""
        out = self.model(
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
            self._fail(request, picked)
            return [request]
        if self._emit(request, *picked):
            return [request]
        if request.rid not in self._alone:
            self.running.append(request)
        self._alone[request.rid] = out.past_key_values
        return []

    def _decode(self) -> list[Request]:
        """One token for every running request: each writes its new key/value at its own position,
        attending to its slot's cached positions and nothing past them. Batch-invariant: each alone."""
        if self.batch_invariant:
            finished = []
            for request in list(self.running):
                finished += self._forward_alone(request, [(request.output_ids or request.input_ids)[-1]])
            return finished
        batch = list(self.running)
        positions = torch.tensor([r.length - 1 for r in batch])  # cached positions; the last token is the input
        span = int(positions.max()) + 1
        self.kv.reserve(self.kv.layers(), span)
        blocked = (torch.arange(span)[None, :] > positions[:, None])[:, None, None, :]
        dtype = self.model.dtype
        mask = torch.zeros(len(batch), 1, 1, span, dtype=dtype).masked_fill(blocked, torch.finfo(dtype).min)
        last = [(r.output_ids or r.input_ids)[-1] for r in batch]  # a resumed request's input is its last token
        out = self.model(
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
        for r, choice in zip(batch, picked, strict=True):
            if isinstance(choice, Exception):
                self._fail(r, choice)
                finished.append(r)
            elif self._emit(r, *choice):
                finished.append(r)
        return finished

    def _sample(self, batch: list[Request], logits: torch.Tensor) -> list[tuple[int, float] | Exception]:
        """(token, logprob) per row, or the error that row alone met (its request fails, the others
        go on). Rows with plain sampling (T > 0, no top-p/top-k, no seed of their own) are drawn
        together from the engine's generator; the others one by one."""
        logits = logits.float()
        finite = torch.isfinite(logits).all(-1).tolist()
        out: list[tuple[int, float] | Exception | None] = [
            None if ok else FloatingPointError("non-finite logits") for ok in finite
        ]
        plain = [
            b
            for b, r in enumerate(batch)
            if finite[b]
            and r.sampling.temperature >= SAMPLING_EPS
            and r.sampling.top_p == 1
            and r.sampling.top_k == -1
            and r.sampling.sampling_seed is None
        ]
        if plain:
            rows = torch.tensor(plain)
            temps = torch.tensor([batch[b].sampling.temperature for b in plain])
            logprobs = torch.log_softmax(logits[rows] / temps[:, None], -1)
            tokens = torch.multinomial(logprobs.exp(), 1, generator=self.generator)[:, 0]
            chosen = logprobs.gather(1, tokens[:, None])[:, 0]
            for b, t, lp in zip(plain, tokens.tolist(), chosen.tolist(), strict=True):
                out[b] = (t, lp)
        for b, r in enumerate(batch):
            if out[b] is None:
                try:
                    out[b] = sample(logits[b], r.sampling, r.generator)
                except (RuntimeError, ValueError) as err:  # this request's parameters: it fails alone
                    out[b] = err
        return out

    def _fail(self, request: Request, err: Exception) -> None:
        """Finish one request with an error (status 500, one line, no traceback)."""
        message = f"request failed: {one_line(err)}"
        self._finish(request, {"type": "abort", "message": message, "status_code": 500, "err_type": type(err).__name__})

    def _emit(self, request: Request, token: int, logprob: float) -> bool:
        """Append a sampled token to `request`; True when it finished."""
        request.output_ids.append(token)
        request.logprobs.append(logprob)
        n = len(request.output_ids)
        extend_spans(request.spans, self.version, n)
        s = request.sampling
        if token in s.stop_token_ids or (not s.ignore_eos and token in self.eos):
            self._finish(request, {"type": "stop", "matched": token})
        elif n >= s.max_new_tokens:
            self._finish(request, {"type": "length", "length": n})
        return request.finish is not None

    def _finish(self, request: Request, reason: dict) -> None:
        request.finish = reason
        self.waiting = [r for r in self.waiting if r is not request]
        slot = next((i for i, r in enumerate(self.running) if r is request), None)
        cut = reason["type"] in ("length", "abort") and reason.get("status_code") is None
        if self.batch_invariant:
            self._alone.pop(request.rid, None)  # and no prefix kept: its next round prefills anew
        elif slot is not None and cut:
            self._keep_prefix(request, slot)  # cut short: it may come back for more
        if slot is not None:  # the last slot's request moves into the freed one
            last = self.running.pop()
            if last is not request:
                self.kv.move(len(self.running), slot)
                self.running[slot] = last
        if request.on_finish is not None:
            request.on_finish(request)


# A prefill forward's fixed cost, in padded token positions. Measured on the tiny model (2 cores):
# 43 resumed requests of 10-450 tokens took 467 ms in one forward, 296 ms in 42, 175-236 ms in
# the 10 that 64 gives (attention's cost grows with the square of the length, favouring splits).
PREFILL_OVERHEAD_POSITIONS = 64


def one_line(err: BaseException) -> str:
    """An error as one line for a response: its type and the first line of its message."""
    text = str(err)
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def prefill_chunks(lengths: Sequence[int], overhead: int) -> list[list[int]]:
    """Split a prefill batch into forwards of similar lengths: indices into `lengths`, longest first.
    A forward over rows padded to its longest costs `overhead` + rows x longest positions; the
    split of the length-sorted rows into contiguous runs that minimises the total is exact (a
    dynamic programme over at most max_batch rows)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    best = [0] + [None] * len(order)  # best[j]: cost of the first j rows (longest first)
    cut = [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        for i in range(j):  # rows i..j-1 in one forward, padded to lengths[order[i]]
            cost = best[i] + overhead + (j - i) * lengths[order[i]]
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    chunks, j = [], len(order)
    while j:
        chunks.append(order[cut[j] : j])
        j = cut[j]
    return chunks[::-1]


def _load_unit(name: str, state: dict[str, torch.Tensor]) -> tuple:
    """What HF tensor `name` fills in `state`, as a key: its parameter (tied names share one) and,
    for a per-expert name, the expert and the rows of the fused parameter."""
    slot = expert_slot(name, state)
    if slot is None:
        return (id(state[name]),)
    return (id(state[slot.param]), slot.expert, None if slot.rows is None else slot.rows.start)


def _prefix_key(request: Request) -> tuple[int, ...]:
    """The prefix store's key of a request: its tokens but the last, whose keys/values are cached."""
    return tuple((request.input_ids + request.output_ids)[:-1])


def sample(logits: torch.Tensor, s: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """(token, its logprob): logprob from log_softmax(logits / T) over the whole vocabulary; below
    SAMPLING_EPS, greedy with the logprob of T = 1, as SGLang does. A temperature past float32's
    range divides by inf: the uniform distribution, its limit."""
    if s.temperature < SAMPLING_EPS:
        logprobs = torch.log_softmax(logits, -1)
        token = int(torch.argmax(logprobs))
        return token, float(logprobs[token])
    logprobs = torch.log_softmax(logits / s.temperature, -1)
    weights = logprobs.exp()
    if s.top_k > 0:
        kth = torch.topk(weights, min(s.top_k, weights.numel())).values[-1]
        weights = torch.where(weights >= kth, weights, 0.0)
    if s.top_p < 1:  # the smallest set of tokens whose mass reaches top_p: never less than the likeliest
        ordered, order = torch.sort(weights, descending=True)
        before = torch.cumsum(ordered, 0) - ordered  # mass of the tokens ahead of each
        kept = before < s.top_p * ordered.sum()
        kept[0] = True  # also when top_p * mass rounds to 0 in float32 (top_p 1e-300): no mass ahead is below 0
        keep = torch.zeros_like(weights, dtype=torch.bool)
        keep[order] = kept
        weights = torch.where(keep, weights, 0.0)
    token = int(torch.multinomial(weights, 1, generator=generator))
    return token, float(logprobs[token])

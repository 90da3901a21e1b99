"""The embedded engine's model loop: a transformers model, a KV cache per request, batched decoding.

No HTTP here (rollout/embedded.py serves it). Each request keeps its own key/value cache;
a decode step left-pads the running requests' caches to one length, runs the model once on
their last tokens with an attention mask and explicit positions, and splits the grown cache
back. Log-probs are log_softmax(logits / T) over the full vocabulary, as SGLang reports them
(top-p/top-k shape the sampling distribution only); T = 0 is greedy, with log_softmax(logits).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bapo_megatron.rollout.protocol import SamplingParams

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [kv_heads, length, head_dim]


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    on_finish: Callable[[Request], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[list] = field(default_factory=list)   # [version, start, end] over output tokens
    finish: dict | None = None
    cache: KV | None = None
    generator: torch.Generator | None = None

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

    def __init__(self, model_dir: str | Path, seed: int = 0, max_batch: int = 64) -> None:
        import transformers

        self.model_dir = str(model_dir)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        self.eos = _eos_ids(self.model)
        self.seed = seed
        self.max_batch = max_batch
        self.version = "0"
        self.incoming: collections.deque[Request] = collections.deque()  # added by other threads
        self.generator = torch.Generator().manual_seed(seed)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._count = 0

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

    def abort(self, rid: str | None = None, message: str = "aborted", status_code: int | None = None,
              err_type: str | None = None) -> int:
        """Finish (with finish reason abort and their partial output) one request, or all if rid is None;
        an internal error passes its message, 500 and its type. Not concurrently with step()."""
        self._admit()
        hit = [r for r in self.waiting + self.running if rid is None or r.rid == rid]
        for r in hit:
            self._finish(r, {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type})
        return len(hit)

    def drop_caches(self) -> None:
        """Forget every running request's KV cache (retract, or weights changed): they re-prefill."""
        for r in self.running:
            r.cache = None
        self.waiting = self.running + self.waiting
        self.running = []

    @property
    def busy(self) -> bool:
        return bool(self.incoming or self.waiting or self.running)

    # -- weights --------------------------------------------------------------------------
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors into the model; all are checked before any is copied."""
        state = self.model.state_dict()
        pending = []
        for name, tensor in tensors:
            if name not in state:
                raise KeyError(f"{name}: the model has no such parameter")
            if tuple(tensor.shape) != tuple(state[name].shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the model's is {tuple(state[name].shape)}")
            pending.append((name, tensor))
        with torch.no_grad():
            for name, tensor in pending:
                state[name].copy_(tensor)
        return len(pending)

    # -- the loop -------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One batched decode step of the running requests, then one batched prefill of the waiting
        ones (up to max_batch running), which samples their first tokens."""
        finished: list[Request] = []
        self._admit()
        with torch.no_grad():
            admitted = []
            while self.waiting and len(self.running) + len(admitted) < self.max_batch:
                request = self.waiting.pop(0)
                if request.sampling.max_new_tokens <= len(request.output_ids):
                    self._finish(request, {"type": "length", "length": len(request.output_ids)})
                    finished.append(request)
                else:
                    admitted.append(request)
            if self.running:  # decode the running ones first: arrivals never starve them
                finished += self._decode()
            if admitted:
                for request, done in zip(admitted, self._prefill(admitted), strict=True):
                    if done:
                        finished.append(request)
                    else:
                        self.running.append(request)
        return finished

    def _prefill(self, batch: list[Request]) -> list[bool]:
        """One forward over the requests' whole sequences, right-padded (a real token never attends
        to a pad under the causal mask); each keeps its own cache, pads cut off."""
        sequences = [r.input_ids + r.output_ids for r in batch]
        longest = max(len(s) for s in sequences)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros(len(batch), longest, dtype=torch.long)
        for b, seq in enumerate(sequences):
            ids[b, : len(seq)] = torch.tensor(seq)
            mask[b, : len(seq)] = 1
        out = self.model(input_ids=ids, attention_mask=mask, use_cache=True)
        layers = _layers(out.past_key_values)
        last = out.logits[torch.arange(len(batch)), torch.tensor([len(seq) - 1 for seq in sequences])]
        done = []
        for b, (request, seq, picked) in enumerate(zip(batch, sequences, self._sample(batch, last), strict=True)):
            request.cache = [(k[b, :, : len(seq)], v[b, :, : len(seq)]) for k, v in layers]
            done.append(self._emit(request, *picked))
        return done

    def _decode(self) -> list[Request]:
        batch = self.running
        lengths = [r.length - 1 for r in batch]  # cached positions; the last sampled token is the input
        longest = max(lengths)
        mask = torch.zeros(len(batch), longest + 1, dtype=torch.long)
        for b, n in enumerate(lengths):
            mask[b, longest - n:] = 1
        cache = _cache_of([_pad_left(r.cache, longest) for r in batch])
        out = self.model(input_ids=torch.tensor([[r.output_ids[-1]] for r in batch]), attention_mask=mask,
                         position_ids=torch.tensor([[n] for n in lengths]), past_key_values=cache, use_cache=True)
        layers = _layers(out.past_key_values)
        picked = self._sample(batch, out.logits[:, -1])
        finished = []
        for b, (r, n) in enumerate(zip(batch, lengths, strict=True)):
            r.cache = [(k[b, :, longest - n:], v[b, :, longest - n:]) for k, v in layers]
            if self._emit(r, *picked[b]):
                finished.append(r)
        self.running = [r for r in self.running if r.finish is None]
        return finished

    def _sample(self, batch: list[Request], logits: torch.Tensor) -> list[tuple[int, float]]:
        """(token, logprob) per row. Rows with plain sampling (T > 0, no top-p/top-k, no seed of
        their own) are drawn together from the engine's generator; the others one by one."""
        logits = logits.float()
        plain = [b for b, r in enumerate(batch) if r.sampling.temperature > 0 and r.sampling.top_p == 1
                 and r.sampling.top_k == -1 and r.sampling.sampling_seed is None]
        out: list[tuple[int, float] | None] = [None] * len(batch)
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
                out[b] = sample(logits[b], r.sampling, r.generator)
        return out

    def _emit(self, request: Request, token: int, logprob: float) -> bool:
        """Append a sampled token to `request`; True when it finished."""
        request.output_ids.append(token)
        request.logprobs.append(logprob)
        n = len(request.output_ids)
        if request.spans and request.spans[-1][0] == self.version and request.spans[-1][2] == n - 1:
            request.spans[-1][2] = n
        else:
            request.spans.append([self.version, n - 1, n])
        s = request.sampling
        if token in s.stop_token_ids or (not s.ignore_eos and token in self.eos):
            self._finish(request, {"type": "stop", "matched": token})
        elif n >= s.max_new_tokens:
            self._finish(request, {"type": "length", "length": n})
        return request.finish is not None

    def _finish(self, request: Request, reason: dict) -> None:
        request.finish = reason
        request.cache = None
        self.waiting = [r for r in self.waiting if r is not request]
        self.running = [r for r in self.running if r is not request]
        if request.on_finish is not None:
            request.on_finish(request)


def sample(logits: torch.Tensor, s: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """(token, its logprob): logprob from log_softmax(logits / T) over the whole vocabulary."""
    if s.temperature == 0:
        logprobs = torch.log_softmax(logits, -1)
        token = int(torch.argmax(logprobs))
        return token, float(logprobs[token])
    logprobs = torch.log_softmax(logits / s.temperature, -1)
    weights = logprobs.exp()
    if s.top_k > 0:
        kth = torch.topk(weights, min(s.top_k, weights.numel())).values[-1]
        weights = torch.where(weights >= kth, weights, 0.0)
    if s.top_p < 1:
        ordered, order = torch.sort(weights, descending=True)
        before = torch.cumsum(ordered, 0) - ordered  # mass of the tokens ahead of each
        keep = torch.zeros_like(weights, dtype=torch.bool)
        keep[order] = before < s.top_p * ordered.sum()
        weights = torch.where(keep, weights, 0.0)
    token = int(torch.multinomial(weights, 1, generator=generator))
    return token, float(logprobs[token])


def _layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [(k, v) for k, v in cache]


def _pad_left(cache: KV, length: int) -> KV:
    out = []
    for k, v in cache:
        pad = length - k.shape[1]
        if pad:
            k = torch.cat([k.new_zeros(k.shape[0], pad, k.shape[2]), k], 1)
            v = torch.cat([v.new_zeros(v.shape[0], pad, v.shape[2]), v], 1)
        out.append((k, v))
    return out


def _cache_of(per_request: list[KV]):
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer in range(len(per_request[0])):
        keys = torch.stack([c[layer][0] for c in per_request])
        values = torch.stack([c[layer][1] for c in per_request])
        cache.update(keys, values, layer)
    return cache

"""The embedded engine's sampling: a token and its log-prob per row of logits, as SGLang samples.

Log-probs are log_softmax(logits / T) over the full vocabulary, as SGLang reports them (top-p/top-k
shape the sampling distribution only); T = 0 is greedy, with log_softmax(logits). Log-probs are
computed in float32 whatever dtype the model runs in.
"""

from __future__ import annotations

import torch

from bapo_megatron.common.protocol import SAMPLING_EPS, SamplingParams
from bapo_megatron.engines.embedded.request_queue import EngineRequest


def sample_rows(
    batch: list[EngineRequest], logits: torch.Tensor, generator: torch.Generator
) -> list[tuple[int, float] | Exception]:
    """(token, logprob) per row, or the error that row alone met (its request fails, the others
    go on). Rows with plain sampling (T > 0, no top-p/top-k, no seed of their own) are drawn
    together from the engine's `generator`; the others one by one, from their own."""
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
        tokens = torch.multinomial(logprobs.exp(), 1, generator=generator)[:, 0]
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

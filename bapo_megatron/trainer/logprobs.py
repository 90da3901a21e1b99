"""Per-token log-probs and entropy from vocab-parallel logits, never gathering the vocabulary.

Each tensor-parallel rank holds the logits of a contiguous slice of the vocabulary. Per
chunk of tokens: one MAX all-reduce (for a stable log-sum-exp) and one SUM all-reduce of
(sum exp, sum exp * z, target logit) over the TP group. The backward pass recomputes the
softmax chunk by chunk from the saved log-sum-exp and needs no collective, so no
[tokens x vocab] float32 tensor exists beyond one chunk in either direction.
Logits are divided by the sampling temperature and vocabulary padding rows are excluded,
exactly as SGLang computes its logprobs: log_softmax(logits / T) over the model's vocab.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

LIVE_TEMPORARIES = 8
"""float32 [chunk, V_local] tensors alive at once at the peak of a chunk when the work runs op by
op (backward: z, log p, p, the one-hot mask, the gradient terms; measured on an H100: 234 MiB
for a 256 MiB budget)."""
FUSED_TEMPORARIES = 1
"""The same for the fused kernels, which keep only their bf16 gradient chunk (measured: 16 MiB
for a 256 MiB budget sized as 8): one float32 chunk's room."""


def chunk_tokens_for(v_local: int, itemsize: int, budget_bytes: int, live: int = LIVE_TEMPORARIES) -> int:
    """Tokens per chunk whose `live` temporaries fit in budget_bytes (at least one token)."""
    return max(1, budget_bytes // (live * itemsize * v_local))


def _all_reduce(t: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


# The per-chunk work, as pure functions of whole chunks: run op by op (CPU, or fused=False) or
# compiled by torch.compile into a few fused kernels on CUDA, where op by op they are a dozen
# passes over a float32 [chunk, V] tensor each (measured: 37% of a Qwen2.5-1.5B step's GPU time).


def _scaled(logits: torch.Tensor, inv_temperature: float, valid_cols: torch.Tensor, dtype) -> torch.Tensor:
    return torch.where(valid_cols, logits.to(dtype) * inv_temperature, float("-inf"))


def _chunk_max(logits, inv_temperature: float, valid_cols, dtype: torch.dtype):
    return _scaled(logits, inv_temperature, valid_cols, dtype).amax(dim=-1)


def _chunk_stats(logits, inv_temperature: float, valid_cols, zmax, local_target, on_rank, dtype: torch.dtype):
    """(sum exp(z - max), sum exp(z - max) * z, the target's z where this rank holds it), stacked."""
    z = _scaled(logits, inv_temperature, valid_cols, dtype)
    e = torch.exp(z - zmax.unsqueeze(-1))
    cols = torch.arange(z.shape[-1], device=z.device)
    is_target = (cols == local_target.unsqueeze(-1)) & on_rank.unsqueeze(-1)
    return torch.stack([e.sum(-1), torch.where(valid_cols, e * z, 0.0).sum(-1), torch.where(is_target, z, 0.0).sum(-1)])


def _chunk_grad(logits, inv_temperature: float, valid_cols, lse, entropy, g_lp, g_h, local_target, on_rank):
    """d(sum g_lp * logp + g_h * H)/d logits of one chunk, in the logits' dtype:
    d logp_target / dz = onehot - p;  d H / dz = -p (log p + H);  dz/dlogits = 1/T."""
    dtype = lse.dtype
    z = _scaled(logits, inv_temperature, valid_cols, dtype)
    log_p = z - lse.unsqueeze(-1)
    p = torch.exp(log_p)
    g_lp, g_h = g_lp.to(dtype).unsqueeze(-1), g_h.to(dtype).unsqueeze(-1)
    log_p = torch.where(valid_cols, log_p, 0.0)  # padding columns: p = 0, and 0 * -inf is not 0
    cols = torch.arange(z.shape[-1], device=z.device)
    is_target = (cols == local_target.unsqueeze(-1)) & on_rank.unsqueeze(-1)
    dz = torch.where(is_target, g_lp, 0.0) - g_lp * p - g_h * p * (log_p + entropy.unsqueeze(-1))
    return (dz * inv_temperature).to(logits.dtype)


_COMPILED: dict[str, object] = {}


def _kernels(fused: bool):
    """(max, stats, grad) chunk functions: compiled once per process when fused, else as written."""
    if not fused:
        return _chunk_max, _chunk_stats, _chunk_grad
    if not _COMPILED:
        for name, fn in (("max", _chunk_max), ("stats", _chunk_stats), ("grad", _chunk_grad)):
            _COMPILED[name] = torch.compile(fn, dynamic=True)  # the last chunk is shorter
    return _COMPILED["max"], _COMPILED["stats"], _COMPILED["grad"]


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, temperature, vocab_start, vocab_size, chunk, fused):
        n, v_local = logits.shape
        dtype = torch.promote_types(logits.dtype, torch.float32)
        chunk_max, chunk_stats, _ = _kernels(fused)
        inv_t = 1.0 / temperature
        logp = torch.empty(n, dtype=dtype, device=logits.device)
        entropy = torch.empty_like(logp)
        lse_all = torch.empty_like(logp)
        top = torch.empty_like(logp)
        valid_cols = (torch.arange(v_local, device=logits.device) + vocab_start) < vocab_size
        local_target = targets - vocab_start
        on_rank = (local_target >= 0) & (local_target < v_local)
        for s in range(0, n, chunk):
            part = logits[s : s + chunk]
            zmax = chunk_max(part, inv_t, valid_cols, dtype)
            _all_reduce(zmax, dist.ReduceOp.MAX, group)
            stats = chunk_stats(
                part, inv_t, valid_cols, zmax, local_target[s : s + chunk], on_rank[s : s + chunk], dtype
            )
            _all_reduce(stats, dist.ReduceOp.SUM, group)
            sum_e, sum_ez, z_target = stats
            lse = zmax + torch.log(sum_e)
            logp[s : s + chunk] = z_target - lse
            entropy[s : s + chunk] = lse - sum_ez / sum_e
            lse_all[s : s + chunk] = lse
            top[s : s + chunk] = zmax - lse  # the same floats as logp where the target is the argmax
        ctx.save_for_backward(logits, local_target, on_rank, lse_all, entropy, valid_cols)
        ctx.inv_t, ctx.chunk, ctx.fused = inv_t, chunk, fused
        ctx.mark_non_differentiable(top)
        return logp, entropy, top

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, grad_top):
        logits, local_target, on_rank, lse_all, entropy, valid_cols = ctx.saved_tensors
        _, _, chunk_grad = _kernels(ctx.fused)
        grad = torch.empty_like(logits)
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse_all)
        if grad_entropy is None:
            grad_entropy = torch.zeros_like(lse_all)
        c = ctx.chunk
        for s in range(0, logits.shape[0], c):
            grad[s : s + c] = chunk_grad(
                logits[s : s + c],
                ctx.inv_t,
                valid_cols,
                lse_all[s : s + c],
                entropy[s : s + c],
                grad_logp[s : s + c],
                grad_entropy[s : s + c],
                local_target[s : s + c],
                on_rank[s : s + c],
            )
        return grad, None, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    memory_budget_bytes: int = 1 << 30,
    fused: bool | None = None,
    with_top: bool = False,
) -> tuple[torch.Tensor, ...]:
    """log pi(target) and the entropy of pi for every token, from this rank's vocabulary slice.

    Args:
        logits: [..., V_local], this rank's slice [vocab_start, vocab_start + V_local).
        targets: [...] global token ids.
        group: the tensor-parallel group (None: the logits hold the whole vocabulary).
        vocab_size: the model's real vocabulary; padding columns at or past it are excluded.
        temperature: the rollout's sampling temperature (logits are divided by it).
        chunk_tokens: tokens per chunk (None: as many as memory_budget_bytes holds); the float32
            (or wider) temporaries are chunk x V_local each.
        memory_budget_bytes: what the temporaries of one chunk may take, when chunk_tokens is None.
        fused: run each chunk's work as torch.compile'd kernels (None: on CUDA only).
        with_top: also return the log-prob of each position's most likely token (no gradient).
            It is computed from the same floats as log pi(target), so `logprobs == top` holds
            exactly where the target is the argmax: the token greedy decoding would pick.
    Returns:
        (logprobs, entropy), or (logprobs, entropy, top) with with_top, each of targets' shape,
        float32 or wider; logprobs and entropy are differentiable in logits.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature!r}: must be > 0")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree")
    v_local = logits.shape[-1]
    if vocab_size is None:
        vocab_size = vocab_start + v_local if group is None else v_local * dist.get_world_size(group)
    lead = targets.shape
    fused = logits.is_cuda if fused is None else bool(fused)
    if chunk_tokens is None:
        itemsize = torch.promote_types(logits.dtype, torch.float32).itemsize
        live = FUSED_TEMPORARIES if fused else LIVE_TEMPORARIES
        chunk_tokens = chunk_tokens_for(v_local, itemsize, memory_budget_bytes, live)
    logp, entropy, top = _VocabParallelLogprobEntropy.apply(
        logits.reshape(-1, v_local),
        targets.reshape(-1),
        group,
        float(temperature),
        int(vocab_start),
        int(vocab_size),
        max(1, int(chunk_tokens)),
        fused,
    )
    if with_top:
        return logp.view(lead), entropy.view(lead), top.view(lead)
    return logp.view(lead), entropy.view(lead)

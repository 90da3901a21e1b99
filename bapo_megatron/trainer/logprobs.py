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

EAGER_TEMPORARIES = 3
"""float32 [chunk, valid columns] tensors alive at once at the peak of a chunk when the work runs op
by op (the padding columns sliced off): backward's log p, p (reused for g_h p (log p + H)) and
g_lp p (reused for the gradient); forward keeps two (z and exp(z - max)). Counted in _eager_grad
and _eager_stats, measured on CPU with trainer/memory/probe.LiveBytes (tests/unit/test_logprobs_eager.py:
3.03-3.07 chunks in backward, the per-token vectors included). The masked kernels these replaced
kept about 8 chunks of the whole slice op by op (an H100 measurement of those older kernels: 234 MiB
for a 256 MiB budget); that figure does not describe the kernels here."""
FUSED_TEMPORARIES = 1
"""The same for the fused kernels, which keep only their bf16 gradient chunk (measured: 16 MiB
for a 256 MiB budget sized as 8): one float32 chunk of the whole slice."""


def chunk_tokens_for(columns: int, itemsize: int, budget_bytes: int, live: int = EAGER_TEMPORARIES) -> int:
    """Tokens per chunk whose `live` temporaries of `columns` fit in budget_bytes (at least one token)."""
    return max(1, budget_bytes // (live * itemsize * max(columns, 1)))


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


# Op by op (CPU, or fused=False) the same math takes as few passes over a chunk as exactness allows:
# the padding columns (a suffix of the slice) are sliced off rather than masked, the target's logit
# is gathered rather than summed out of a one-hot mask, and temporaries are reused in place.


def _eager_max(logits, inv_temperature: float, n_valid: int, dtype: torch.dtype):
    if n_valid == 0:  # a slice of padding alone: nothing of it counts
        return torch.full(logits.shape[:1], float("-inf"), dtype=dtype, device=logits.device)
    return (logits[:, :n_valid].to(dtype) * inv_temperature).amax(dim=-1)


def _target_z(z, local_target, on_rank):
    """z at each row's target where this rank holds it; 0 where another rank does; -inf at padding."""
    held = on_rank & (local_target < z.shape[1])
    if z.shape[1] == 0:
        picked = torch.zeros(z.shape[:1], dtype=z.dtype, device=z.device)
    else:
        picked = z.gather(1, torch.where(held, local_target, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(held, picked, torch.where(on_rank, float("-inf"), 0.0).to(z.dtype))


def _eager_stats(logits, inv_temperature: float, n_valid: int, zmax, local_target, on_rank, dtype: torch.dtype):
    """_chunk_stats over the valid columns: the same floats but for the order of the sums."""
    z = logits[:, :n_valid].to(dtype) * inv_temperature
    target = _target_z(z, local_target, on_rank)
    e = torch.sub(z, zmax.unsqueeze(-1)).exp_()
    sum_e = e.sum(-1)
    return torch.stack([sum_e, e.mul_(z).sum(-1), target])


def _eager_grad(logits, inv_temperature: float, n_valid: int, lse, entropy, g_lp, g_h, local_target, on_rank):
    """_chunk_grad's floats over the valid columns (the padding's gradient is 0), in float32: the
    caller's copy into the gradient rounds to the logits' dtype as .to() would, without one more
    chunk alive (EAGER_TEMPORARIES). Off the target, (0 - g_lp p) - g_h p (log p + H) is
    -(g_lp p + g_h p (log p + H)) exactly, so the one-hot term is taken at the targets alone, with
    _chunk_grad's operations in _chunk_grad's order there."""
    dtype = lse.dtype
    g_lp, g_h = g_lp.to(dtype).unsqueeze(-1), g_h.to(dtype).unsqueeze(-1)
    log_p = (logits[:, :n_valid].to(dtype) * inv_temperature).sub_(lse.unsqueeze(-1))
    p = torch.exp(log_p)
    lp_term = p * g_lp
    h_term = p.mul_(g_h).mul_(log_p.add_(entropy.unsqueeze(-1)))
    # no data-dependent shapes (nonzero would read the device from the host inside the schedule):
    # every row gathers a column, the rows whose target is not here write back what they read
    if n_valid == 0:  # a slice of padding alone
        return lp_term.add_(h_term)
    hit = (on_rank & (local_target < n_valid)).unsqueeze(-1)
    cols = torch.where(hit, local_target.unsqueeze(-1), 0)
    at_target = (g_lp - lp_term.gather(1, cols)) - h_term.gather(1, cols)
    dz = lp_term.add_(h_term).mul_(-inv_temperature)
    dz.scatter_(1, cols, torch.where(hit, at_target * inv_temperature, dz.gather(1, cols)))
    return dz


_COMPILED: dict[str, object] = {}


def _kernels(fused: bool):
    """(max, stats, grad) chunk functions: the compiled ones (once per process; they take the valid
    columns as a mask and cover the whole slice), else the op-by-op ones (the valid columns' count)."""
    if not fused:
        return _eager_max, _eager_stats, _eager_grad
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
        n_valid = max(0, min(v_local, vocab_size - vocab_start))  # the padding is the slice's end
        valid = (torch.arange(v_local, device=logits.device) < n_valid) if fused else n_valid
        local_target = targets - vocab_start
        on_rank = (local_target >= 0) & (local_target < v_local)
        for s in range(0, n, chunk):
            part = logits[s : s + chunk]
            zmax = chunk_max(part, inv_t, valid, dtype)
            _all_reduce(zmax, dist.ReduceOp.MAX, group)
            stats = chunk_stats(part, inv_t, valid, zmax, local_target[s : s + chunk], on_rank[s : s + chunk], dtype)
            _all_reduce(stats, dist.ReduceOp.SUM, group)
            sum_e, sum_ez, z_target = stats
            lse = zmax + torch.log(sum_e)
            logp[s : s + chunk] = z_target - lse
            entropy[s : s + chunk] = lse - sum_ez / sum_e
            lse_all[s : s + chunk] = lse
            top[s : s + chunk] = zmax - lse  # the same floats as logp where the target is the argmax
        ctx.save_for_backward(logits, local_target, on_rank, lse_all, entropy)
        ctx.inv_t, ctx.chunk, ctx.fused, ctx.valid = inv_t, chunk, fused, valid
        ctx.mark_non_differentiable(top)
        return logp, entropy, top

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, grad_top):
        logits, local_target, on_rank, lse_all, entropy = ctx.saved_tensors
        _, _, chunk_grad = _kernels(ctx.fused)
        grad = torch.empty_like(logits)
        width = logits.shape[1] if ctx.fused else ctx.valid  # the columns chunk_grad covers
        grad[:, width:] = 0
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse_all)
        if grad_entropy is None:
            grad_entropy = torch.zeros_like(lse_all)
        c = ctx.chunk
        for s in range(0, logits.shape[0], c):
            grad[s : s + c, :width] = chunk_grad(
                logits[s : s + c],
                ctx.inv_t,
                ctx.valid,
                lse_all[s : s + c],
                entropy[s : s + c],
                grad_logp[s : s + c],
                grad_entropy[s : s + c],
                local_target[s : s + c],
                on_rank[s : s + c],
            )
        return grad, None, None, None, None, None, None, None


def _budget_chunk(logits: torch.Tensor, vocab_start: int, vocab_size: int, budget: int, fused: bool) -> int:
    """Tokens a chunk whose temporaries fit `budget`: the compiled kernels cover the whole slice,
    padding included; op by op, the valid columns alone (the padding is the slice's end)."""
    v_local = logits.shape[-1]
    itemsize = torch.promote_types(logits.dtype, torch.float32).itemsize
    if fused:
        return chunk_tokens_for(v_local, itemsize, budget, FUSED_TEMPORARIES)
    n_valid = max(0, min(v_local, vocab_size - vocab_start))
    return chunk_tokens_for(n_valid, itemsize, budget, EAGER_TEMPORARIES)


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
            (or wider) temporaries are chunk x V_local each (op by op: chunk x the valid columns).
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
        chunk_tokens = _budget_chunk(logits, vocab_start, vocab_size, memory_budget_bytes, fused)
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

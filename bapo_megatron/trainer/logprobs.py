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

LIVE_TEMPORARIES = 5
"""[chunk, V_local] tensors alive at once at the peak of a chunk (backward: z, log p, p, the
gradient and a masked copy; forward: fewer)."""


def chunk_tokens_for(v_local: int, itemsize: int, budget_bytes: int) -> int:
    """Tokens per chunk whose temporaries fit in budget_bytes (at least one token)."""
    return max(1, budget_bytes // (LIVE_TEMPORARIES * itemsize * v_local))


def _all_reduce(t: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, temperature, vocab_start, vocab_size, chunk):
        n, v_local = logits.shape
        dtype = torch.promote_types(logits.dtype, torch.float32)
        logp = torch.empty(n, dtype=dtype, device=logits.device)
        entropy = torch.empty_like(logp)
        lse_all = torch.empty_like(logp)
        valid_cols = (torch.arange(v_local, device=logits.device) + vocab_start) < vocab_size
        local_target = targets - vocab_start
        on_rank = (local_target >= 0) & (local_target < v_local)
        for s in range(0, n, chunk):
            z = _scaled(logits[s : s + chunk], temperature, valid_cols, dtype)
            zmax = z.max(dim=-1).values
            _all_reduce(zmax, dist.ReduceOp.MAX, group)
            e = torch.exp(z - zmax.unsqueeze(-1))
            zt = z.gather(1, local_target[s : s + chunk].clamp(0, v_local - 1).unsqueeze(1)).squeeze(1)
            stats = torch.stack(
                [
                    e.sum(-1),
                    torch.where(valid_cols, e * z, 0.0).sum(-1),
                    torch.where(on_rank[s : s + chunk], zt, 0.0),
                ]
            )
            _all_reduce(stats, dist.ReduceOp.SUM, group)
            sum_e, sum_ez, z_target = stats
            lse = zmax + torch.log(sum_e)
            logp[s : s + chunk] = z_target - lse
            entropy[s : s + chunk] = lse - sum_ez / sum_e
            lse_all[s : s + chunk] = lse
        ctx.save_for_backward(logits, local_target, on_rank, lse_all, entropy, valid_cols)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, local_target, on_rank, lse_all, entropy, valid_cols = ctx.saved_tensors
        grad = torch.empty_like(logits)
        n, v_local = logits.shape
        dtype = lse_all.dtype
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse_all)
        if grad_entropy is None:
            grad_entropy = torch.zeros_like(lse_all)
        for s in range(0, n, ctx.chunk):
            z = _scaled(logits[s : s + ctx.chunk], ctx.temperature, valid_cols, dtype)
            log_p = z - lse_all[s : s + ctx.chunk].unsqueeze(-1)
            p = torch.exp(log_p)
            g_lp = grad_logp[s : s + ctx.chunk].unsqueeze(-1).to(dtype)
            g_h = grad_entropy[s : s + ctx.chunk].unsqueeze(-1).to(dtype)
            # d logp_target / dz = onehot - p;  d H / dz = -p (log p + H)
            log_p = torch.where(valid_cols, log_p, 0.0)
            dz = -g_lp * p - g_h * p * (log_p + entropy[s : s + ctx.chunk].unsqueeze(-1))
            cols = local_target[s : s + ctx.chunk].clamp(0, v_local - 1).unsqueeze(1)
            dz.scatter_add_(1, cols, torch.where(on_rank[s : s + ctx.chunk].unsqueeze(1), g_lp, 0.0))
            grad[s : s + ctx.chunk] = (dz / ctx.temperature).to(grad.dtype)
        return grad, None, None, None, None, None, None


def _scaled(logits: torch.Tensor, temperature: float, valid_cols: torch.Tensor, dtype) -> torch.Tensor:
    z = logits.to(dtype) / temperature
    return torch.where(valid_cols, z, float("-inf"))


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
) -> tuple[torch.Tensor, torch.Tensor]:
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
    Returns:
        (logprobs, entropy), each of targets' shape, float32 or wider, differentiable in logits.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature!r}: must be > 0")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree")
    v_local = logits.shape[-1]
    if vocab_size is None:
        vocab_size = vocab_start + v_local if group is None else v_local * dist.get_world_size(group)
    lead = targets.shape
    if chunk_tokens is None:
        itemsize = torch.promote_types(logits.dtype, torch.float32).itemsize
        chunk_tokens = chunk_tokens_for(v_local, itemsize, memory_budget_bytes)
    logp, entropy = _VocabParallelLogprobEntropy.apply(
        logits.reshape(-1, v_local),
        targets.reshape(-1),
        group,
        float(temperature),
        int(vocab_start),
        int(vocab_size),
        max(1, int(chunk_tokens)),
    )
    return logp.view(lead), entropy.view(lead)

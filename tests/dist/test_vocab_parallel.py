"""Vocab-parallel log-prob and entropy over a TP=2 gloo group equal the full-vocab float64 result."""

import math

import torch
import torch.distributed as dist

from bapo_megatron.trainer.logprobs import vocab_parallel_logprobs
from tests.dist.launch import count_collectives, run_workers
from tests.unit.test_logprobs import reference


def _worker(rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(0)
    vocab, padded = 250, 256  # the last rank's slice ends in 6 padding rows
    full = torch.randn(37, padded, generator=g, dtype=torch.float64) * 4
    targets = torch.randint(vocab, (37,), generator=g)
    greedy = full[:, :vocab].argmax(-1)
    targets[::2] = greedy[::2]  # every other target is the argmax, held by either rank
    assert {int(t) // (padded // world) for t in greedy[::2]} == set(range(world))
    upstream = torch.randn(2, 37, generator=g, dtype=torch.float64)
    width = padded // world
    for dtype, tol, chunk in ((torch.float64, 1e-12, 8), (torch.float32, 1e-5, 4096)):
        local = full[:, rank * width : (rank + 1) * width].to(dtype).clone().requires_grad_()
        with count_collectives() as calls:
            logp, ent, top = vocab_parallel_logprobs(
                local,
                targets,
                group=dist.group.WORLD,
                vocab_start=rank * width,
                vocab_size=vocab,
                temperature=0.8,
                chunk_tokens=chunk,
                with_top=True,
            )
        assert len(calls) == 2 * math.ceil(37 / chunk), calls  # one MAX and one SUM per chunk
        with count_collectives() as calls:
            ((logp.double() * upstream[0]).sum() + (ent.double() * upstream[1]).sum()).backward()
        assert not calls  # the backward pass is local

        ref_logits = full.clone().requires_grad_()
        ref_logp, ref_ent = reference(ref_logits, targets, vocab, 0.8)
        ((ref_logp * upstream[0]).sum() + (ref_ent * upstream[1]).sum()).backward()
        torch.testing.assert_close(logp.double(), ref_logp, rtol=tol, atol=tol)
        torch.testing.assert_close(ent.double(), ref_ent, rtol=tol, atol=tol)
        assert torch.equal(logp == top, targets == greedy)  # exactly where the target is the argmax
        want = ref_logits.grad[:, rank * width : (rank + 1) * width]
        torch.testing.assert_close(local.grad.double(), want, rtol=tol, atol=tol)


def test_vocab_parallel_tp2_equals_full_vocab():
    run_workers(_worker, 2)

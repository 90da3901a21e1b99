"""The op-by-op log-prob kernels (CPU) give the masked kernels' floats (the ones torch.compile fuses on
CUDA) in fewer passes: the padding columns sliced off, the target gathered, temporaries reused. The
gradient is elementwise, so it is bitwise the same; the sums are too unless padding changes their length.
"""

import pytest
import torch

from bapo_megatron.trainer import logprobs as lp

F32 = torch.float32


def _chunk(vocab: int, padded: int = 256, rows: int = 37, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, padded, generator=g) * 3
    targets = torch.randint(vocab, (rows,), generator=g)
    on_rank = torch.ones(rows, dtype=torch.bool)
    on_rank[::5] = False  # rows whose target another rank holds
    valid = torch.arange(padded) < vocab
    return logits, targets, on_rank, valid, g


@pytest.mark.parametrize("vocab", [256, 250], ids=["unpadded", "padded"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_eager_kernels_give_the_masked_kernels_floats(vocab, temperature):
    logits, targets, on_rank, valid, g = _chunk(vocab)
    inv_t = 1.0 / temperature
    zmax = lp._chunk_max(logits, inv_t, valid, F32)
    assert torch.equal(lp._eager_max(logits, inv_t, vocab, F32), zmax)
    masked = lp._chunk_stats(logits, inv_t, valid, zmax, targets, on_rank, F32)
    eager = lp._eager_stats(logits, inv_t, vocab, zmax, targets, on_rank, F32)
    assert torch.equal(eager[2], masked[2])  # the target's logit: gathered, or summed out of a one-hot
    if vocab == logits.shape[1]:
        assert torch.equal(eager, masked)
    else:  # sums of other lengths (the padding's zeros left out): the last bits may differ
        torch.testing.assert_close(eager, masked, rtol=1e-6, atol=0)
    sum_e, sum_ez, _ = masked
    lse = zmax + torch.log(sum_e)
    entropy = lse - sum_ez / sum_e
    g_lp, g_h = torch.randn(2, logits.shape[0], generator=g)
    want = lp._chunk_grad(logits, inv_t, valid, lse, entropy, g_lp, g_h, targets, on_rank)
    got = lp._eager_grad(logits, inv_t, vocab, lse, entropy, g_lp, g_h, targets, on_rank)
    assert torch.equal(got, want[:, :vocab]) and not want[:, vocab:].any()


def test_a_slice_of_padding_alone_counts_for_nothing():
    """A tensor-parallel rank whose slice holds only padding columns (a large padded vocabulary)."""
    logits, targets, on_rank, _, _ = _chunk(250, rows=5)
    off_rank = torch.zeros_like(on_rank)
    zmax = lp._eager_max(logits, 1.0, 0, F32)
    assert torch.equal(zmax, torch.full((5,), float("-inf")))
    stats = lp._eager_stats(logits, 1.0, 0, torch.zeros(5), targets, off_rank, F32)
    assert torch.equal(stats, torch.zeros(3, 5))
    zeros, ones = torch.zeros(5), torch.ones(5)
    grad = lp._eager_grad(logits, 1.0, 0, zeros, zeros, ones, ones, targets, off_rank)
    assert grad.shape == (5, 0)


def test_the_masked_kernels_gradient_in_bf16():
    """_eager_grad answers in float32; rounded to the logits' dtype (as the copy into the gradient
    does) it is the masked kernel's bf16 gradient."""
    logits, targets, on_rank, valid, g = _chunk(250)
    logits = logits.bfloat16()
    lse, entropy, g_lp, g_h = torch.randn(4, logits.shape[0], generator=g)
    want = lp._chunk_grad(logits, 0.7, valid, lse, entropy, g_lp, g_h, targets, on_rank)
    got = lp._eager_grad(logits, 0.7, 250, lse, entropy, g_lp, g_h, targets, on_rank)
    assert got.dtype == F32 and torch.equal(got.bfloat16(), want[:, :250])


def _temporaries(dtype, **chunking) -> tuple[float, float]:
    """Bytes the log-probs' forward, and their backward beyond the logits' gradient, hold at their peak
    (padded vocabulary 1024, 250 real), measured with the memory probe."""
    from bapo_megatron.trainer.memory.probe import LiveBytes

    rows, vocab = 256, 250
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(rows, 1024, generator=g) * 3).to(dtype).requires_grad_()
    targets = torch.randint(vocab, (rows,), generator=g)
    upstream = torch.randn(2, rows, generator=g)
    with LiveBytes() as probe:
        logp, entropy = lp.vocab_parallel_logprobs(x, targets, group=None, vocab_size=vocab, **chunking)
        forward = probe.peak
        probe.reset_peak()
        before = probe.live
        ((logp * upstream[0]).sum() + (entropy * upstream[1]).sum()).backward()
    return forward, probe.peak - before - x.numel() * x.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [256, 64])
def test_op_by_op_temporaries_are_what_the_estimate_counts(dtype, chunk):
    """At their peak (backward) the op-by-op kernels keep EAGER_TEMPORARIES float32 [chunk, valid
    columns] beyond the logits and their gradient, the per-token vectors aside (forward: two); the
    memory estimate (trainer/memory/estimate.py) and the chunk sizing count that many."""
    forward, backward = (b / (4 * chunk * 250) for b in _temporaries(dtype, chunk_tokens=chunk))
    assert 2 <= forward < 2.25, forward
    assert lp.EAGER_TEMPORARIES <= backward < lp.EAGER_TEMPORARIES + 0.25, backward


def test_chunks_sized_from_the_budget_fill_it():
    """Op by op a chunk spans the real vocabulary's columns alone: sized from the budget, its
    temporaries take the budget (sized by the padded slice, a quarter of it here)."""
    budget = lp.EAGER_TEMPORARIES * 4 * 250 * 40
    _, backward = _temporaries(torch.float32, memory_budget_bytes=budget)
    assert 0.95 * budget <= backward <= 1.1 * budget, backward / budget

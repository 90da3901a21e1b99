"""Chunked log-prob/entropy equals a full-vocabulary float64 computation, with gradients."""

import pytest
import torch

from bapo_megatron.trainer.logprobs import vocab_parallel_logprobs


def reference(logits, targets, vocab_size, temperature):
    z = logits[..., :vocab_size].double() / temperature
    log_p = torch.log_softmax(z, dim=-1)
    return log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("temperature", "chunk"), [(1.0, 4096), (0.7, 5), (1.3, 1)])
def test_matches_full_vocab_reference(dtype, temperature, chunk):
    g = torch.Generator().manual_seed(0)
    vocab, padded = 250, 256
    logits = (torch.randn(3, 11, padded, generator=g, dtype=torch.float64) * 3).to(dtype).requires_grad_()
    targets = torch.randint(vocab, (3, 11), generator=g)
    upstream = torch.randn(2, 3, 11, generator=g, dtype=torch.float64)

    logp, ent = vocab_parallel_logprobs(
        logits, targets, group=None, vocab_size=vocab, temperature=temperature, chunk_tokens=chunk
    )
    ((logp.double() * upstream[0]).sum() + (ent.double() * upstream[1]).sum()).backward()
    ref_logits = logits.detach().double().requires_grad_()
    ref_logp, ref_ent = reference(ref_logits, targets, vocab, temperature)
    ((ref_logp * upstream[0]).sum() + (ref_ent * upstream[1]).sum()).backward()

    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-5}[dtype]
    torch.testing.assert_close(logp.double(), ref_logp, rtol=tol, atol=tol)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=tol, atol=tol)
    grad_tol = 1e-12 if dtype == torch.float64 else (1e-5 if dtype == torch.float32 else 1e-2)
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=grad_tol, atol=grad_tol)
    assert logits.grad[..., vocab:].abs().sum() == 0  # padding rows get no gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_marks_exactly_the_greedy_tokens(dtype):
    """`logprobs == top` where the target is the argmax of the (unpadded) vocabulary, whatever the
    chunking and temperature, and top is the largest log-prob."""
    g = torch.Generator().manual_seed(3)
    vocab, padded = 250, 256
    logits = (torch.randn(4, 9, padded, generator=g) * 3).to(dtype)
    logits[..., vocab:] = 100.0  # padding columns never count as the argmax
    greedy = logits[..., :vocab].float().argmax(-1)
    targets = torch.where(torch.rand(4, 9, generator=g) < 0.5, greedy, torch.randint(vocab, (4, 9), generator=g))
    for temperature, chunk in ((1.0, 4096), (0.6, 5)):
        logp, _, top = vocab_parallel_logprobs(
            logits, targets, group=None, vocab_size=vocab, temperature=temperature, chunk_tokens=chunk, with_top=True
        )
        assert torch.equal(logp == top, targets == greedy)
        want = torch.log_softmax(logits[..., :vocab].double() / temperature, -1).amax(-1)
        torch.testing.assert_close(top.double(), want, rtol=1e-5, atol=1e-5)
        assert not top.requires_grad


def test_bad_inputs():
    with pytest.raises(ValueError, match="temperature=0"):
        vocab_parallel_logprobs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), group=None, temperature=0)
    with pytest.raises(ValueError, match=r"logits \(2, 4\) and targets \(3,\)"):
        vocab_parallel_logprobs(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long), group=None)


def test_chunks_are_sized_from_the_memory_budget():
    from bapo_megatron.trainer.logprobs import EAGER_TEMPORARIES, FUSED_TEMPORARIES, chunk_tokens_for

    # Qwen2.5's 152,064-token vocabulary in float32: ~1.8 MB a token op by op at TP=1, ~0.2 MB at TP=8
    assert chunk_tokens_for(152064, 4, 1 << 30) == (1 << 30) // (EAGER_TEMPORARIES * 4 * 152064) == 588
    assert chunk_tokens_for(152064 // 8, 4, 1 << 30) == 4707
    assert chunk_tokens_for(152064, 4, 1 << 30, FUSED_TEMPORARIES) == 1765  # fused kernels keep one chunk
    assert chunk_tokens_for(152064, 4, 1) == 1  # never zero
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 256, generator=g, dtype=torch.float64)
    targets = torch.randint(250, (40,), generator=g)
    whole = vocab_parallel_logprobs(logits, targets, group=None, vocab_size=250, chunk_tokens=40)
    budget = 7 * EAGER_TEMPORARIES * 8 * 250  # seven float64 tokens of 250 real columns: six chunks, the last short
    chunked = vocab_parallel_logprobs(logits, targets, group=None, vocab_size=250, memory_budget_bytes=budget)
    for a, b in zip(whole, chunked, strict=True):
        assert torch.equal(a, b)  # each token's floats are its own row's: chunks change none


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_match_op_by_op(dtype):
    """The torch.compile'd chunk functions (used on CUDA) give what the op-by-op ones give; here
    compiled for the CPU, which checks the same traced graphs (tests/gpu runs them on CUDA)."""
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(23, 256, generator=g) * 3).to(dtype)
    targets = torch.randint(250, (23,), generator=g)
    upstream = torch.randn(2, 23, generator=g)
    out = {}
    for fused in (False, True):
        x = logits.clone().requires_grad_()
        logp, ent = vocab_parallel_logprobs(
            x, targets, group=None, vocab_size=250, temperature=0.7, chunk_tokens=5, fused=fused
        )
        ((logp * upstream[0]).sum() + (ent * upstream[1]).sum()).backward()
        out[fused] = (logp.detach(), ent.detach(), x.grad)
    for a, b in zip(out[False], out[True], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 1e-2)

"""On CUDA: the log-prob/entropy temporaries stay within the memory budget (beyond the logits,
their gradient and the per-token outputs), for a Qwen-sized vocabulary."""

import pytest
import torch

from bapo_megatron.trainer.logprobs import vocab_parallel_logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("fused", [True, False])
def test_temporaries_stay_within_the_budget(fused):
    tokens, vocab, budget = 4096, 152064, 256 << 20
    logits = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(vocab, (tokens,), device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logp, entropy = vocab_parallel_logprobs(logits, targets, group=None, memory_budget_bytes=budget, fused=fused)
    (logp.sum() + entropy.sum()).backward()
    torch.cuda.synchronize()
    grad = logits.numel() * logits.element_size()
    per_token = 8 * tokens * 4  # outputs and saved statistics, float32
    extra = torch.cuda.max_memory_allocated() - base - grad - per_token
    print(f"fused={fused}: {extra / 2**20:.0f} MiB of temporaries for a {budget / 2**20:.0f} MiB budget")
    assert extra <= budget, f"{extra / 2**20:.0f} MiB of temporaries for a {budget / 2**20:.0f} MiB budget"

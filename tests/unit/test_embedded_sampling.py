"""The embedded engine's sampling rule (engines/embedded/sampling.py sample), as SGLang's: top_p keeps the
smallest set of the likeliest tokens whose probability reaches top_p, which always holds the most
likely one (a top_p of 5e-324, 0 in float32, once kept none: "invalid multinomial distribution")."""

import math

import pytest
import torch

from bapo_megatron.common.protocol import SamplingParams
from bapo_megatron.engines.embedded.sampling import sample

PROBS = torch.tensor([0.1, 0.5, 0.2, 0.15, 0.05])  # token 1 likeliest, then 2, 3, 0, 4


@pytest.mark.parametrize(
    ("top_p", "top_k", "support"),
    [
        (1.0, -1, {0, 1, 2, 3, 4}),
        (0.45, -1, {1}),
        (0.65, -1, {1, 2}),
        (0.8, -1, {1, 2, 3}),
        (1e-300, -1, {1}),
        (5e-324, -1, {1}),
        (1.0, 1, {1}),
        (1.0, 10**30, {0, 1, 2, 3, 4}),
        (0.8, 2, {1, 2}),
    ],
)
def test_top_p_and_top_k_keep_the_likeliest_tokens_and_never_none(top_p, top_k, support):
    params = SamplingParams(max_new_tokens=1, top_p=top_p, top_k=top_k)
    generator = torch.Generator().manual_seed(0)
    drawn = {sample(PROBS.log(), params, generator) for _ in range(300)}
    assert {token for token, _ in drawn} == support
    for token, logprob in drawn:  # the logprob of the full distribution at T = 1, as SGLang reports it
        assert logprob == pytest.approx(math.log(PROBS[token]), abs=1e-6)


def test_a_temperature_past_float32_is_the_uniform_distribution():
    params = SamplingParams(max_new_tokens=1, temperature=1e300, top_p=5e-324)
    token, logprob = sample(PROBS.log(), params, torch.Generator().manual_seed(0))
    assert 0 <= token < len(PROBS) and logprob == pytest.approx(-math.log(len(PROBS)))

"""The embedded engine serving a hybrid model (transformers' Qwen3.5 text model: Gated DeltaNet
layers, whose cache is a recurrent state, beside full attention), built tiny and random here.

Its cache cannot be cut at a position, right-padded or slotted as keys and values are
(Family.cache_by_position is False): before, the batched prefill failed on the first linear
attention layer's cache. Now each request runs alone over its own cache, and a request continued
after a cut (partial rollout's next round: prompt + partial response) has its state rebuilt from
its tokens, so it goes on exactly as the uninterrupted generation, which is transformers' greedy
generate.
"""

import pytest
import torch

from bapo_megatron.common.protocol import SamplingParams
from bapo_megatron.models import FAMILIES, family_for_hf

pytestmark = pytest.mark.e2e
PROMPTS = ([5, 9, 17, 3], [100, 2, 7, 7, 7, 40, 11])
TOKENS = 10


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    import transformers

    config = transformers.Qwen3_5TextConfig(
        vocab_size=250,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,  # three Gated DeltaNet layers, then full attention
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=512,
    )
    config.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():  # a random model's greedy tokens must not tie: spread its logits
        model.lm_head.weight.mul_(20)
    path = tmp_path_factory.mktemp("qwen3_5") / "model"
    model.save_pretrained(path)
    with torch.no_grad():
        made = [model.generate(torch.tensor([p]), max_new_tokens=TOKENS, do_sample=False)[0] for p in PROMPTS]
    greedy = [tokens[len(p) :].tolist() for p, tokens in zip(PROMPTS, made, strict=True)]
    return path, greedy


@pytest.fixture
def family(hybrid_dir):
    """The real Qwen3.5 family reads the model and says its cache is not by position."""
    import json

    from bapo_megatron.models.qwen3_5 import Qwen3_5
    from bapo_megatron.models.spec import ModelSpec

    hf = json.loads((hybrid_dir[0] / "config.json").read_text())
    found = family_for_hf(hf)
    assert type(found) is Qwen3_5 and FAMILIES[found.name] is found
    assert not found.cache_by_position(ModelSpec.from_hf_config(hf)), f"{found.name}: Family.cache_by_position"


def _run(core, requests) -> dict[str, tuple[list[int], list[float]]]:
    for r in requests:
        core.add(r)
    while core.busy:
        core.step()
    return {r.rid: (r.output_ids, r.logprobs) for r in requests}


def test_a_continued_request_goes_on_as_the_uninterrupted_generation(hybrid_dir, family):
    from bapo_megatron.engines.embedded.core import EngineCore
    from bapo_megatron.engines.embedded.request_queue import EngineRequest

    path, greedy = hybrid_dir
    core = EngineCore(path, max_batch=2)

    def request(rid, prompt, n):
        return EngineRequest(rid, prompt, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))

    whole = _run(core, [request(f"w{i}", p, TOKENS) for i, p in enumerate(PROMPTS)])  # together
    assert [whole[f"w{i}"][0] for i in range(len(PROMPTS))] == greedy
    cut = _run(core, [request(f"c{i}", p, 4) for i, p in enumerate(PROMPTS)])
    rest = _run(core, [request(f"r{i}", p + cut[f"c{i}"][0], TOKENS - 4) for i, p in enumerate(PROMPTS)])
    for i in range(len(PROMPTS)):
        tokens = cut[f"c{i}"][0] + rest[f"r{i}"][0]
        logprobs = torch.tensor(cut[f"c{i}"][1] + rest[f"r{i}"][1])
        assert tokens == whole[f"w{i}"][0]
        torch.testing.assert_close(logprobs, torch.tensor(whole[f"w{i}"][1]), rtol=0, atol=1e-5)
    assert core.alone and not core.prefixes  # nothing cut by position was kept

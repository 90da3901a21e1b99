"""Megatron built from a HF config, with HF weights mapped in, gives transformers' logits.

Random Qwen2, Llama, Qwen3 and Qwen3-MoE models (transformers, offline, every weight randomised
including the norms and the routers) cover GQA ratios 1, 2 and 4, a vocabulary that needs padding
(250 -> 256), tied and untied embeddings, QKV bias on and off, q/k norms, a MoE model with a dense
first layer (4 experts, top-2, renormalised and not). The map back to HF names is bitwise exact.
"""

import dataclasses

import torch

from tests.dist.launch import run_workers

CASES = [
    ("qwen2", 4, False),
    ("qwen2", 2, True),
    ("qwen2", 1, False),
    ("llama", 1, True),
    ("llama", 2, False),
    ("qwen3", 2, False),
    ("qwen3_moe", 2, False),
    ("qwen3_moe-unnormalised", 1, True),
]


def _worker(rank: int, world: int) -> None:
    import transformers

    from bapo_megatron.common.hf_experts import per_expert
    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer import megatron_config as mc
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.weights.layout import hf_to_megatron, megatron_to_hf

    activate_cpu_shim()
    cfg = load_config(None, [])
    init_model_parallel(cfg.parallel, cfg.seed)
    g = torch.Generator().manual_seed(0)
    for case, kv_heads, tied in CASES:
        arch = case.split("-")[0]
        spec = dataclasses.replace(tiny_spec(arch), num_kv_heads=kv_heads, tie_embeddings=tied)
        if case.endswith("unnormalised"):
            spec = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, norm_topk_prob=False))
        hf_config = transformers.AutoConfig.for_model(**spec.to_hf_config())
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
        with torch.no_grad():
            for name, p in hf_model.named_parameters():
                base = 1.0 if "norm" in name else 0.0
                p.copy_(base + 0.08 * torch.randn(p.shape, generator=g))
        hf_state = dict(per_expert(hf_model.state_dict()))  # per expert, as on disk
        padded = mc.padded_vocab(spec, cfg.model, cfg.parallel)
        model = mc.build_gpt_model(spec, cfg.model, cfg.parallel, pre_process=True, post_process=True).eval()
        missing, unexpected = model.load_state_dict(hf_to_megatron(spec, hf_state, padded), strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)

        ids = torch.randint(spec.vocab_size, (2, 23), generator=g)
        positions = torch.arange(23).unsqueeze(0).expand(2, 23)
        with torch.no_grad():
            ours = model(ids, positions, attention_mask=None)[..., : spec.vocab_size]
            theirs = hf_model(ids).logits
        rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
        assert rel <= 1e-4, f"{arch} kv={kv_heads} tied={tied}: logits differ by {rel:.2e} (relative)"

        back = megatron_to_hf(spec, model.state_dict())
        expected = {k for k in hf_state if not (tied and k == "lm_head.weight")}
        assert set(back) == expected
        for key in expected:
            assert torch.equal(back[key], hf_state[key]), key


def test_megatron_equals_transformers():
    run_workers(_worker, 1)

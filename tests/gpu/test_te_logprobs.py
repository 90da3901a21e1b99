"""On a GPU with Transformer Engine: TE's layer spec in bf16 gives the log-probs of the local spec
in bf16, within bf16's precision. Both load the same HF weights; each is compared with the local
spec in float32 (the reference), and TE's error must be no larger than bf16's own. The tiny
Qwen3-MoE runs its experts as TE's grouped GEMM (model.moe.grouped_gemm's default with TE: the
HF weights loaded under its `linear_fc1.weightE` names) against the local spec's experts one
after another. TE's run packs its micro-batches (parallel.packing's default with TE), the local
ones pad theirs: log-probs are compared sample by sample. The 2026 families whose layers Transformer
Engine builds (DeepSeek-V3's latent attention, GLM-4.5's partial rotary and shared expert, gpt-oss's
sinks, windows and clamped experts) run the same comparison from a random transformers model;
Qwen3.5's hybrid layers are local only (its family refuses TE)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.dist.launch import run_workers
from tests.helpers import CASES, make_batch, make_hf_model

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None,
    reason="needs CUDA and Transformer Engine",
)
MODELS = {
    "qwen2-gqa2": CASES["qwen2-gqa2"],
    "qwen3-moe": ("qwen3_moe", 2, False),
    "deepseek-v3": "deepseek_v3",
    "glm4-moe": "glm4_moe",
    "gpt-oss": "gpt_oss",
}
"""name: (architecture, kv heads, tied) for tests.helpers' HF models, or a family's name (its tiny(),
random weights from tests/families.py)."""


def hf_model_of(name: str, root: Path):
    """MODELS[name]'s spec, its HF directory written to root/name."""
    import dataclasses

    from bapo_megatron.models.spec import tiny_spec
    from tests.families import random_hf_model, save_hf_model

    if isinstance(MODELS[name], str):
        spec = tiny_spec(MODELS[name])
        save_hf_model(random_hf_model(spec), spec, root / name)
        return spec
    arch, kv, tied = MODELS[name]
    make_hf_model(root, name, MODELS[name])
    return dataclasses.replace(tiny_spec(arch), num_kv_heads=kv, tie_embeddings=tied)


RUNS = {
    "local-fp32": ["model.transformer_impl=local", "model.precision=fp32"],
    "local-bf16": ["model.transformer_impl=local", "model.precision=bf16"],
    "transformer_engine-bf16": ["model.transformer_impl=transformer_engine", "model.precision=bf16"],
}


def logprobs_of_runs(rank: int, world: int, root: str, name: str, runs: dict[str, list[str]]) -> None:
    """For each of `runs` (label: config overrides), every response token's log-prob of the same batch
    under MODELS[name]'s HF weights, in sample order (the runs' micro-batch layouts may differ: TE
    packs), and the attention the run's layout took; into root/logprobs.json."""
    from bapo_megatron.config import load_config
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer
    from bapo_megatron.weights.hf_load import load_hf_into_trainer
    from tests.dist.test_packing import token_logprobs

    spec = hf_model_of(name, Path(root))
    batch = make_batch(5, groups=4, n=4, max_len=40)
    out, attention = {}, {}
    for label, overrides in runs.items():
        cfg = load_config(None, [*overrides, "parallel.max_tokens_per_microbatch=512"])
        trainer = PolicyTrainer(spec, cfg, init_model_parallel(cfg.parallel, cfg.seed))
        load_hf_into_trainer(trainer, Path(root) / name)
        if spec.moe is not None and cfg.model.transformer_impl == "transformer_engine":
            names = [n for n, _ in trainer.model[0].named_parameters()]
            assert any(n.endswith("mlp.experts.linear_fc1.weight0") for n in names), names[:8]  # grouped
        found = token_logprobs(trainer, batch)
        out[label] = torch.cat([found[i][0].float().cpu() for i in sorted(found)]).tolist()
        attention[label] = type(trainer.layout.attention).__name__
        del trainer
    (Path(root) / "logprobs.json").write_text(json.dumps({"logprobs": out, "attention": attention}))


def read_runs(root: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """What logprobs_of_runs wrote: (log-probs, attention) by run label."""
    done = json.loads((root / "logprobs.json").read_text())
    return {k: torch.tensor(v) for k, v in done["logprobs"].items()}, done["attention"]


@pytest.mark.parametrize("name", list(MODELS))
def test_te_bf16_logprobs_match_the_local_spec(tmp_path, name):
    run_workers(logprobs_of_runs, 1, str(tmp_path), name, RUNS, device="cuda")
    got, _ = read_runs(tmp_path)
    ref = got["local-fp32"]
    local_err = (got["local-bf16"] - ref).abs()
    te_err = (got["transformer_engine-bf16"] - ref).abs()
    between = (got["transformer_engine-bf16"] - got["local-bf16"]).abs()
    print(
        f"max |error| vs fp32: local bf16 {local_err.max():.4f}, TE bf16 {te_err.max():.4f}; "
        f"TE vs local bf16: max {between.max():.4f}, mean {between.mean():.5f} over {ref.numel()} tokens"
    )
    assert ref.numel() > 100
    # bf16 keeps 8 bits of mantissa: log-probs around -5.5 carry errors of a few hundredths, and a
    # routed model's bf16 router logits can tie and pick another expert (measured on an H100: local
    # bf16 0.12 at worst on the tiny Qwen3-MoE, TE 0.05): TE's worst no worse than bf16's own
    assert te_err.max() <= max(local_err.max(), 0.1)
    assert te_err.mean() <= 2 * local_err.mean() + 1e-3

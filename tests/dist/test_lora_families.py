"""LoRA on the families beyond the standard decoder, against PEFT's LoRA on the transformers model and
across layouts: Qwen3.5 (gated full attention: q_proj's rows are each head's query and output gate,
which Megatron's linear_qkv holds apart; Gated DeltaNet: in_proj_qkv / in_proj_z / in_proj_b /
in_proj_a fused in Megatron's in_proj, each part split over TP on its own, and out_proj) and
Qwen3.5-MoE (the shared expert's projections beside the routed experts); GLM-4.5's and gpt-oss's attention
(q/k/v with biases; gpt-oss's sinks and sliding windows beside them); DeepSeek-V3's multi-latent
attention with a query latent (q_a_proj and kv_a_proj_with_mqa beside Megatron's replicated
down-projections, before the latent norms; q_b_proj, kv_b_proj, o_proj) and without one (q_proj, with
rope_interleave false: the rotary rows Megatron interleaves); Qwen3-Next's delta rule (in_proj_qkvz and
in_proj_ba grouped per key head in HF's rows, part by part in Megatron's in_proj).

One launch of two processes (gloo, CPU). At TP 1 each process checks every family: fresh adapters
leave the logits bit for bit the base's, and with the same random adapters PEFT's logits and A and B
gradients agree (1e-5; Qwen3-Next's gradients 3e-5: GRADIENT_GAP). Then the Qwen3.5 model takes one
Adam step at TP 1 (the two processes as data parallel ranks) and at TP 2 with sequence parallel
through Megatron's DDP, optimizer and schedule: the loss, the adapters' gradients and updated values
agree within 1e-5; so do the dense DeepSeek-V3 models (the replicated down-projections' adapter
gradients summed over the sequence shares; a rank's heads' rotary rows reordered) and Qwen3-Next (a
rank's rows of a grouped projection's B: its key heads').
"""

import dataclasses
from pathlib import Path

import torch

from tests.dist.launch import run_workers
from tests.dist.test_lora_layouts import (
    SEQ,
    _adam_step,
    _base,
    _close,
    _global,
    _part,
    _peft_model,
    _random_adapters,
    _set_adapters,
    _setup,
    _tokens,
)

RANK, ALPHA = 4, 8.0
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
DELTA_RULE = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
LATENT = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
DEEPSEEK = ("deepseek_v3", "deepseek_v3-no-q-latent", "deepseek_v3-dense")
GROUPED_DELTA_RULE = ("in_proj_qkvz", "in_proj_ba", "out_proj")
GRADIENT_GAP = {"qwen3_next": 3e-5}
"""Qwen3-Next's adapter gradients against PEFT's: up to 1.5e-5 measured (its logits 2e-6), float32
noise of the two chunked delta rules (Megatron's torch rule, transformers'), largest on in_proj_ba,
whose gates reach the loss through cumulative sums of log-decays; any row misplaced gives O(1)."""
FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text", "glm4_moe", "gpt_oss", *DEEPSEEK[:2], "qwen3_next")


def _spec(arch: str):
    """The family's tiny model; DeepSeek-V3 also dense, with or without a query latent (without:
    Moonlight's attention, with the rotary rows as halves, rope_interleave false)."""
    from bapo_megatron.models.spec import tiny_spec

    family, _, variant = arch.partition("-")
    spec = dataclasses.replace(tiny_spec(family), tie_embeddings=False)
    if variant == "no-q-latent":
        latent = dataclasses.replace(spec.latent_attention, q_lora_rank=None, rope_interleave=False)
        return dataclasses.replace(spec, latent_attention=latent, moe=None)
    return dataclasses.replace(spec, moe=None) if variant == "dense" else spec


def _lora(arch: str = "qwen3_5_text"):
    """Every projection of the family (the delta rule's input projections are trained with sync
    merged only; GLM-4.5's and gpt-oss's attention alone is adapted)."""
    from bapo_megatron.config.lora import LoRAConfig

    if arch in DEEPSEEK:  # by name: peft's all-linear on this model takes its routed experts too
        return LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=_latent_targets(arch), sync="merged")
    if arch == "qwen3_next":  # its MLPs: no target (peft takes them for the routed experts)
        return LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=ATTENTION + GROUPED_DELTA_RULE, sync="merged")
    targets = ATTENTION if arch in ("glm4_moe", "gpt_oss") else ATTENTION + DELTA_RULE + MLP
    return LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=targets, sync="merged")


def _latent_targets(arch: str) -> tuple[str, ...]:
    if _spec(arch).latent_attention.q_lora_rank is None:
        return ("q_proj", *LATENT[2:])
    return LATENT


def _check_against_peft(hf_dir: Path, arch: str) -> None:
    from bapo_megatron.models.lora import adapter_names
    from bapo_megatron.trainer.lora import adapter_parameters, apply_lora

    cfg = _setup(1, 1)
    spec, lora = _spec(arch), _lora(arch)
    gpt = _base(hf_dir, cfg).eval()
    ids = _tokens(spec)[:, :SEQ]
    positions = torch.arange(SEQ).expand_as(ids)
    with torch.no_grad():
        base = gpt(ids, positions, attention_mask=None)
    apply_lora(gpt, spec, lora)
    names = adapter_names(spec, lora)
    assert {_global(gpt, n) for n in adapter_parameters(gpt)} == set(names)
    with torch.no_grad():
        assert torch.equal(gpt(ids, positions, attention_mask=None), base), f"{arch}: fresh adapters moved the logits"
    whole = _random_adapters(spec, lora)
    _set_adapters(gpt, whole)
    peft_model, peft_params = _peft_model(hf_dir, spec, lora, whole)
    weights = torch.randn(*ids.shape, spec.vocab_size, generator=torch.Generator().manual_seed(5))
    ours = gpt(ids, positions, attention_mask=None)[..., : spec.vocab_size]
    theirs = peft_model(input_ids=ids).logits
    assert (ours - base[..., : spec.vocab_size]).abs().max() > 1e-3, "the adapters change the logits"
    gap = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert gap <= 1e-5, f"{arch}: logits differ from PEFT's by {gap:.2e}"
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    for name, param in adapter_parameters(gpt).items():
        want = peft_params[names[_global(gpt, name)].replace(".weight", ".default.weight")].grad
        gap = (torch.linalg.norm(param.grad - want) / torch.linalg.norm(want)).item()
        assert gap <= GRADIENT_GAP.get(arch, 1e-5), f"{arch} {name}: gradient differs from PEFT's by {gap:.2e}"


def _step(hf_dir: Path, arch: str, whole: dict[str, torch.Tensor], tp: int) -> dict:
    """One Adam step of the adapters at TP `tp`: the loss, each adapter's gradient and updated value."""
    from bapo_megatron.trainer.lora import apply_lora

    cfg = _setup(tp, 1)
    spec = _spec(arch)
    gpt = _base(hf_dir, cfg)
    apply_lora(gpt, spec, _lora(arch))
    _set_adapters(gpt, whole)
    return _adam_step(gpt, cfg, spec, _global, lambda name, p, rank: _part(p, tp, rank))


def _worker(rank: int, world: int, root: str) -> None:
    for arch in FAMILIES:
        _check_against_peft(Path(root) / arch, arch)
    for arch in ("qwen3_5_text", *DEEPSEEK[1:], "qwen3_next"):
        whole = _random_adapters(_spec(arch), _lora(arch))
        want = _step(Path(root) / arch, arch, whole, 1)
        got = _step(Path(root) / arch, arch, whole, 2)
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (arch, got["loss"], want["loss"])
        for key, part in got["part"].items():
            for what in ("grads", "values"):
                gap = _close(got[what][key], part(want[what][key]))
                assert gap <= 1e-5, f"{arch} tp2 {key}: {what} differ from one process's by {gap:.2e}"


def test_family_lora_against_peft_and_tp2(tmp_path):
    from tests.families import random_hf_model, save_hf_model

    for seed, arch in enumerate((*FAMILIES, DEEPSEEK[2])):
        spec = _spec(arch)
        save_hf_model(random_hf_model(spec, seed), spec, tmp_path / arch)
    run_workers(_worker, 2, str(tmp_path))

"""LoRA on the routed experts (model.lora.experts) of the tiny Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next,
GLM-4.5, DeepSeek-V3 and gpt-oss (shared experts and dense MLPs unadapted):
Megatron's per-expert adapters against PEFT's on transformers 5's fused expert tensors, and expert
parallel against one process.

One launch of two processes (gloo, CPU) holds every family. At EP 1 each process checks that fresh
adapters leave the logits bit for bit the base's and that, with the same random adapters (the family's
targets and every expert's gate_up_proj and down_proj; PEFT's stacked on its ParamWrapper), PEFT's
logits and A and B gradients agree (1e-5). Then one Adam step through Megatron's DDP, optimizer and
schedule at EP 1 (the two processes data parallel with the same batch: one process's step) and at EP 2
(each rank holds half the experts and their adapters), and for Qwen3-MoE at TP 2 with sequence parallel
(experts whole, expert TP 1): the loss and every adapter's gradient and updated value agree within
1e-5, each adapter on the rank of its expert.
"""

import dataclasses
from pathlib import Path

import torch

from tests.dist.launch import run_workers
from tests.dist.test_lora_layouts import SEQ, _adam_step, _base, _close, _part, _tokens

RANK, ALPHA = 4, 8.0
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
FAMILIES = {
    "qwen3_moe": (ATTENTION, ((1, 2), (2, 1))),
    # gated attention, the delta rule's output and the shared expert beside the routed experts
    "qwen3_5_moe_text": (("q_proj", "o_proj", "out_proj", "gate_proj", "up_proj", "down_proj"), ((1, 2),)),
    # its delta rule's grouped projections (sync merged: SGLang serves none of its expert adapters)
    "qwen3_next": (("o_proj", "in_proj_qkvz", "out_proj"), ((1, 2),)),
    "glm4_moe": (ATTENTION, ((1, 2),)),
    "deepseek_v3": (("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj"), ((1, 2),)),
    # its experts' biases and clamped SwiGLU beside the adapters, gate and up interleaved in PEFT's B
    "gpt_oss": (ATTENTION, ((1, 2),)),
}
"""Each family: its target modules beside the experts, and the (TP, EP) layouts stepped against EP 1."""


def _spec(arch: str):
    from bapo_megatron.models.spec import tiny_spec

    return dataclasses.replace(tiny_spec(arch), tie_embeddings=False)


def _lora(arch: str):
    from bapo_megatron.config.lora import LoRAConfig

    sync = "merged" if arch == "qwen3_next" else "adapter"
    return LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=FAMILIES[arch][0], experts=True, sync=sync)


def _setup(tp: int, ep: int):
    from bapo_megatron.config import load_config
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import destroy_model_parallel, init_model_parallel

    activate_cpu_shim()
    destroy_model_parallel()
    overrides = [f"parallel.tensor={tp}", f"parallel.expert={ep}", f"parallel.sequence_parallel={tp > 1}"]
    overrides += ["optimizer.lr=1e-3", "optimizer.clip_grad=1.0", "optimizer.adam_eps=1e-5"]
    cfg = load_config(None, overrides)
    init_model_parallel(cfg.parallel, cfg.seed)
    return cfg


def _global(gpt, name: str) -> str:
    """A chunk-local parameter name with its global layer and expert numbers."""
    from bapo_megatron.weights.hf_load import global_name

    return global_name(gpt, name)


def _random_adapters(spec, lora) -> dict[str, torch.Tensor]:
    """Whole adapter matrices by Megatron name, B nonzero so that A has a gradient."""
    from bapo_megatron.models.lora import layer_targets, megatron_name

    g = torch.Generator().manual_seed(3)
    whole = {}
    for layer in range(spec.num_layers):
        for t in layer_targets(spec, lora, layer):
            whole[megatron_name(layer, t, "A")] = 0.1 * torch.randn(lora.rank, t.in_features, generator=g)
            whole[megatron_name(layer, t, "B")] = 0.1 * torch.randn(t.out_features, lora.rank, generator=g)
    return whole


def _set_adapters(gpt, whole: dict[str, torch.Tensor]) -> None:
    from megatron.core import parallel_state as ps

    from bapo_megatron.trainer.lora import adapter_parameters

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in adapter_parameters(gpt).items():
            key = _global(gpt, name)
            param.copy_(_whole(whole[key]) if ".mlp.experts." in key else _part(param, tp, rank)(whole[key]))


def _peft_model(hf_dir: Path, spec, lora, whole: dict[str, torch.Tensor]):
    """PEFT's LoRA on transformers' model with our adapters (the experts stacked as PEFT holds them);
    (model, its adapter parameters by the names peft_stacked gives)."""
    import peft
    import transformers

    from bapo_megatron.models.lora import adapter_names, peft_config
    from bapo_megatron.models.lora_experts import peft_stacked

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    config = {
        k: v for k, v in peft_config(spec, lora, None).items() if k not in ("peft_type", "base_model_name_or_path")
    }
    model = peft.get_peft_model(hf_model, peft.LoraConfig(**config))
    params = {n.replace(".default.", "."): p for n, p in model.named_parameters() if p.requires_grad}
    theirs = peft_stacked(spec, {adapter_names(spec, lora)[k]: v for k, v in whole.items()})
    assert set(theirs) == set(params)
    with torch.no_grad():
        for name, tensor in theirs.items():
            params[name].copy_(tensor)
    return model, params


def _check_against_peft(hf_dir: Path, arch: str) -> None:
    from bapo_megatron.models.lora import adapter_names
    from bapo_megatron.models.lora_experts import peft_stacked
    from bapo_megatron.trainer.lora import adapter_parameters, apply_lora

    spec, lora = _spec(arch), _lora(arch)
    gpt = _base(hf_dir, _setup(1, 1)).eval()
    ids = _tokens(spec)[:, :SEQ]
    positions = torch.arange(SEQ).expand_as(ids)
    with torch.no_grad():
        base = gpt(ids, positions, attention_mask=None)
    apply_lora(gpt, spec, lora)
    names = adapter_names(spec, lora)
    assert {_global(gpt, n) for n in adapter_parameters(gpt)} == set(names)
    with torch.no_grad():
        assert torch.equal(gpt(ids, positions, attention_mask=None), base), "fresh adapters moved the logits"
    whole = _random_adapters(spec, lora)
    _set_adapters(gpt, whole)
    peft_model, peft_params = _peft_model(hf_dir, spec, lora, whole)
    weights = torch.randn(*ids.shape, spec.vocab_size, generator=torch.Generator().manual_seed(5))
    ours = gpt(ids, positions, attention_mask=None)[..., : spec.vocab_size]
    theirs = peft_model(input_ids=ids).logits
    assert (ours - base[..., : spec.vocab_size]).abs().max() > 1e-3, "the adapters change the logits"
    gap = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert gap <= 1e-5, f"logits differ from PEFT's by {gap:.2e}"
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    grads = {names[_global(gpt, n)]: p.grad for n, p in adapter_parameters(gpt).items()}
    ours_stacked = peft_stacked(spec, grads)
    assert any(".mlp.experts.base_layer." in n for n in ours_stacked)
    for name, grad in ours_stacked.items():
        want = peft_params[name].grad
        gap = (torch.linalg.norm(grad - want) / torch.linalg.norm(want)).item()
        assert gap <= 1e-5, f"{name}: gradient differs from PEFT's by {gap:.2e}"


def _step(hf_dir: Path, arch: str, whole: dict[str, torch.Tensor], tp: int, ep: int) -> dict:
    """One Adam step of the adapters at TP `tp` x EP `ep`: the loss, and by global name each adapter's
    gradient and updated value (this rank's: its part, its experts)."""
    from bapo_megatron.trainer.lora import apply_lora

    cfg = _setup(tp, ep)
    spec = _spec(arch)
    gpt = _base(hf_dir, cfg)
    apply_lora(gpt, spec, _lora(arch))
    _set_adapters(gpt, whole)
    return _adam_step(
        gpt, cfg, spec, _global, lambda name, p, rank: _whole if ".mlp.experts." in name else _part(p, tp, rank)
    )


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """An expert's adapter: whole on its rank (expert TP 1)."""
    return tensor


def _worker(rank: int, world: int, root: str) -> None:
    for arch in FAMILIES:
        _check_family(Path(root) / arch, arch)


def _check_family(hf_dir: Path, arch: str) -> None:
    _check_against_peft(hf_dir, arch)
    whole = _random_adapters(_spec(arch), _lora(arch))
    want = _step(hf_dir, arch, whole, 1, 1)
    assert any(not torch.equal(want["values"][n], whole[n]) for n in want["values"] if ".experts." in n)
    for tp, ep in FAMILIES[arch][1]:
        got = _step(hf_dir, arch, whole, tp, ep)
        experts = {n for n in got["values"] if ".mlp.experts." in n}
        assert len(experts) == len({n for n in want["values"] if ".mlp.experts." in n}) // ep, "each rank its experts'"
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (tp, ep, got["loss"], want["loss"])
        for key, part in got["part"].items():
            for what in ("grads", "values"):
                gap = _close(got[what][key], part(want[what][key]))
                assert gap <= 1e-5, f"{arch} tp {tp} ep {ep} {key}: {what} differ from one process's by {gap:.2e}"


def test_expert_lora_against_peft_and_expert_parallel(tmp_path):
    from tests.families import random_hf_model, save_hf_model

    for arch in FAMILIES:
        spec = _spec(arch)
        (tmp_path / arch).mkdir()
        save_hf_model(random_hf_model(spec), spec, tmp_path / arch)
    run_workers(_worker, 2, str(tmp_path))

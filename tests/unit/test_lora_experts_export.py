"""The routed experts' adapters (model.lora.experts) out of a trainer at expert parallel 2: the live
export (what the adapter sync sends, weights/export.py part "adapters") holds every expert's adapters
whole under SGLang's per-expert names; the checkpoint's PEFT adapter (weights/peft_export.py, the
experts stacked as PEFT holds them) loads with peft onto transformers' Qwen3-MoE and gives the
trainer's logits; SGLang 0.5.23's LoRA loader, from its wheel, files every sent tensor under its
MoE buffers with their shapes, for Qwen3-MoE and the other families whose experts LoRA adapts
(Qwen3.5-MoE, GLM-4.5, DeepSeek-V3, gpt-oss: its B [gate; up] as SGLang interleaves it); Qwen3-Next's,
which the embedded engine serves, SGLang's model would refuse (the wheel's reason checked)."""

from pathlib import Path

import pytest
import torch

from tests.dist.launch import run_workers

CASE = ("qwen3_moe", 2, False)
LORA = ("model.lora.rank=4", "model.lora.alpha=8", "model.lora.experts=true")
TARGETS = "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"
WHEEL_TARGETS = {
    "qwen3_moe": TARGETS,
    # o_proj: a module whose SGLang buffer is the default's in each (Qwen3.5's gated q_proj is not)
    "qwen3_5_moe_text": "model.lora.target_modules=[o_proj]",
    "glm4_moe": "model.lora.target_modules=[o_proj]",
    "qwen3_next": "model.lora.target_modules=[o_proj]",  # SGLang refuses its expert adapters (sync merged)
    "deepseek_v3": "model.lora.target_modules=[q_b_proj]",  # its o_proj reads v_head_dim, not the default's
    "gpt_oss": "model.lora.target_modules=[o_proj]",
}
"""The families whose synced expert adapters SGLang's loader reads, with the modules adapted beside."""


def _set_random_adapters(trainer, spec, lora) -> dict[str, torch.Tensor]:
    """Nonzero whole adapters by PEFT's per-expert name, each rank given its part and its experts."""
    from megatron.core import parallel_state as ps

    from bapo_megatron.models.lora import adapter_names, is_adapter, layer_targets, megatron_name
    from bapo_megatron.weights.hf_load import global_name

    names, g, whole = adapter_names(spec, lora), torch.Generator().manual_seed(5), {}
    for layer in range(spec.num_layers):
        for t in layer_targets(spec, lora, layer):
            whole[megatron_name(layer, t, "A")] = 0.1 * torch.randn(lora.rank, t.in_features, generator=g)
            whole[megatron_name(layer, t, "B")] = 0.1 * torch.randn(t.out_features, lora.rank, generator=g)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for chunk in trainer.model:
        for local, param in chunk.module.named_parameters():
            if is_adapter(local):
                value = whole[global_name(chunk.module, local)]
                if ".mlp.experts." not in local and getattr(param, "tensor_model_parallel", False):
                    value = value.chunk(tp, dim=param.partition_dim)[tp_rank]
                with torch.no_grad():
                    param.copy_(value)
    return {names[k]: v for k, v in whole.items()}


def _logits(trainer, ids: torch.Tensor) -> torch.Tensor:
    model = trainer.model[0].module
    model.eval()
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand_as(ids), attention_mask=None)


def _worker(rank: int, world: int, hf_dir: str, out: str) -> None:
    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.config import dump_config, load_config
    from bapo_megatron.config.run import CheckpointConfig
    from bapo_megatron.trainer.checkpoint import CheckpointManager
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer
    from bapo_megatron.weights.gather import hf_buckets_to_rank0
    from bapo_megatron.weights.hf_load import load_hf_into_trainer
    from bapo_megatron.weights.peft_export import write_peft_adapter
    from tests.helpers import make_batch

    activate_cpu_shim()
    hf = HFCheckpoint(hf_dir)
    cfg = load_config(None, [f"model.hf_path={hf_dir}", *LORA, TARGETS, "parallel.expert=2", "optimizer.lr=1e-2"])

    def trainer() -> PolicyTrainer:
        made = PolicyTrainer(hf.spec, cfg, init_model_parallel(cfg.parallel, cfg.seed))
        load_hf_into_trainer(made, hf_dir)
        return made

    def adapters(t: PolicyTrainer) -> dict[str, torch.Tensor]:
        return {n: t.clone() for bucket in hf_buckets_to_rank0(t, 1 << 14, "adapters") for n, t in bucket}

    first = trainer()
    whole = _set_random_adapters(first, hf.spec, cfg.model.lora)
    if rank == 0:
        sent = adapters(first)
        assert sent.keys() == whole.keys() and all(torch.equal(sent[n], whole[n]) for n in whole)
        assert any(".mlp.experts.3." in n for n in sent), "rank 1's experts gathered"
    else:
        adapters(first)
    first.train_step(make_batch(0))  # the adapters moved, Adam's state made
    sent = adapters(first)
    ids = torch.randint(hf.spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
    logits = _logits(first, ids)[..., : hf.spec.vocab_size]
    manager = CheckpointManager(CheckpointConfig(dir=f"{out}/ckpt"), dump_config(cfg))
    manager.without_base = True
    saved = manager.save(first)
    if rank == 0:
        assert any(not torch.equal(sent[n], whole[n]) for n in whole if ".mlp.experts." in n), "the experts' moved"
        write_peft_adapter(f"{out}/ckpt", f"{out}/peft")  # from the adapters alone
        torch.save({"logits": logits, "ids": ids, "sent": sent}, f"{out}/trainer.pt")
    first.model[0].module.train()
    first.train_step(make_batch(1))
    resumed = trainer()
    CheckpointManager(CheckpointConfig(dir=f"{out}/ckpt")).load(resumed, saved)
    resumed.train_step(make_batch(1))
    ours = dict(resumed.model[0].module.named_parameters())
    for name, param in first.model[0].module.named_parameters():
        assert torch.equal(ours[name], param), f"{name}: the resumed step differs"


@pytest.fixture(scope="module")
def exported(hf_model, tmp_path_factory) -> tuple[Path, Path]:
    """(our output directory: peft/ and trainer.pt, the HF base)."""
    hf_dir, out = hf_model("lora-experts", CASE), tmp_path_factory.mktemp("lora-experts")
    run_workers(_worker, 2, str(hf_dir), str(out))
    return out, hf_dir


def test_peft_loads_the_expert_adapters_with_the_trainers_logits(exported):
    import json

    import peft
    import transformers

    out, hf_dir = exported
    config = json.loads((out / "peft" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    base = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(base, str(out / "peft")).eval()
    saved = torch.load(out / "trainer.pt")
    with torch.no_grad():
        theirs = model(input_ids=saved["ids"]).logits
        with model.disable_adapter():
            plain = model(input_ids=saved["ids"]).logits
    ours = saved["logits"]
    assert (theirs - plain).abs().max() > 1e-3, "the adapters change the logits"
    gap = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert gap <= 1e-5, f"logits differ from peft's by {gap:.2e}"


@pytest.fixture(params=list(WHEEL_TARGETS))
def synced(request, hf_model) -> tuple[Path, str, dict[str, torch.Tensor]]:
    """(HF base, target overrides, what the adapter sync sends): Qwen3-MoE's from the trainer at EP 2
    (exported); another family's random whole adapters under adapter_names' per-expert names, the
    names its trainer's adapters export under (tests/dist/test_lora_experts.py checks them)."""
    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.config import load_config
    from bapo_megatron.models.lora import adapter_names, layer_targets, megatron_name
    from bapo_megatron.models.spec import tiny_spec

    arch, targets = request.param, WHEEL_TARGETS[request.param]
    if arch == CASE[0]:
        out, hf_dir = request.getfixturevalue("exported")
        return hf_dir, targets, dict(torch.load(out / "trainer.pt")["sent"])
    hf_dir = hf_model(f"lora-experts-{arch}", (arch, tiny_spec(arch).num_kv_heads, False))
    spec, lora = HFCheckpoint(hf_dir).spec, load_config(None, [*LORA, targets]).model.lora
    names, g, sent = adapter_names(spec, lora), torch.Generator().manual_seed(5), {}
    for layer in range(spec.num_layers):
        for t in layer_targets(spec, lora, layer):
            sent[names[megatron_name(layer, t, "A")]] = 0.1 * torch.randn(lora.rank, t.in_features, generator=g)
            sent[names[megatron_name(layer, t, "B")]] = 0.1 * torch.randn(t.out_features, lora.rank, generator=g)
    return hf_dir, targets, sent


def test_the_embedded_engine_serves_each_familys_expert_adapters_as_peft_does(synced):
    """What the adapter sync sends, loaded by the embedded engine's ServedAdapters onto transformers'
    model of each family: its logits are PEFT's with the same adapters (stacked as PEFT holds them)."""
    from types import SimpleNamespace

    import peft
    import transformers

    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.config import load_config
    from bapo_megatron.engines.embedded.lora import TENSOR_SOURCE, ServedAdapters
    from bapo_megatron.models.lora import peft_config
    from bapo_megatron.models.lora_experts import peft_stacked

    hf_dir, targets, sent = synced
    spec, lora = HFCheckpoint(hf_dir).spec, load_config(None, [*LORA, targets]).model.lora
    config = peft_config(spec, lora, str(hf_dir))

    def base():
        return transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()

    model, ids = base(), torch.randint(spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
    served = ServedAdapters(model)
    adapter = served.build("v1", config, sent.items(), TENSOR_SOURCE)
    assert len(adapter.experts) == len(spec.moe.sparse_layers), "every routed layer's experts"
    served.add(adapter)
    kwargs = {k: v for k, v in config.items() if k not in ("peft_type", "base_model_name_or_path")}
    theirs = peft.get_peft_model(base(), peft.LoraConfig(**kwargs)).eval()
    peft.set_peft_model_state_dict(theirs, peft_stacked(spec, sent))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with served.rows([SimpleNamespace(lora_id=adapter.id)] * 2):
            ours = model(input_ids=ids).logits
        want = theirs(input_ids=ids).logits
    gap = ((ours - want).abs().max() / want.abs().max()).item()
    assert gap <= 1e-5 and (want - plain).abs().max() > 1e-3, f"the engine and peft differ by {gap:.2e}"


def test_sglang_files_what_the_sync_sends_under_its_moe_buffers(synced, wheel, monkeypatch, tmp_path):
    """The adapter sync's tensors and config (peft_config) read by SGLang 0.5.23's LoRAAdapter from the
    wheel, against the targets our launcher gives the server (lora_args): every expert's tensor filed
    under its expert's `<module>_moe` buffer (it wraps a MoE layer only when its targets hold gate_up_proj
    and down_proj) with that buffer's shape per expert (get_lora_A/B_shape: [r x stacked, in], [out, r])."""
    import json
    import re

    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.config import load_config
    from bapo_megatron.engines.sglang_launcher import ServedLoRA, lora_args
    from bapo_megatron.models.lora import PEFT_CONFIG, peft_config
    from tests.unit.test_peft_sglang_loader import _sglang

    hf_dir, targets, sent = synced
    ns = _sglang(wheel, monkeypatch)
    if HFCheckpoint(hf_dir).spec.architecture == "qwen3_next":
        _check_sglang_refuses_qwen3_next(ns, wheel, hf_dir)
        return
    cfg = load_config(None, [f"model.hf_path={hf_dir}", *LORA, targets])
    spec, lora = HFCheckpoint(hf_dir).spec, cfg.model.lora
    (tmp_path / PEFT_CONFIG).write_text(json.dumps(peft_config(spec, lora, str(hf_dir))))
    config = ns["LoRAConfig"](str(tmp_path))
    base = __import__("transformers").AutoConfig.from_pretrained(str(hf_dir))
    adapter = ns["LoRAAdapter"]("ours", config, base, None, None)
    adapter.initialize_weights_from_tensors(sent)
    server = ns["get_normalized_target_modules"](
        lora_args(cfg.rollout, ServedLoRA.of(spec, lora))["lora-target-modules"]
    )
    assert {"gate_up_proj", "down_proj"} <= server
    served = {}
    for i, layer in enumerate(adapter.layers):
        for name, weight in layer.weights.items():
            module = ns["get_target_module_name"](name, server)  # ValueError: skipped (refused when strict)
            expert = re.search(r"experts\.(\d+)\.", name)
            module += "_moe" if expert else ""
            inputs, outputs = ns["get_default_hidden_dim"](module, base, i)
            stacked = ns["get_stacked_multiply"](module)
            expected = (config.r * stacked, inputs) if "lora_A" in name else (outputs, config.r)
            assert tuple(weight.shape) == expected, f"{name}: {tuple(weight.shape)}, SGLang's buffer {expected}"
            served.setdefault(f"{i}.{module}", set()).add((int(expert[1]) if expert else None, name[-8]))
    experts = spec.moe.num_experts
    for i in spec.moe.sparse_layers:
        for module in ("gate_up_proj_moe", "down_proj_moe"):
            assert served[f"{i}.{module}"] == {(e, m) for e in range(experts) for m in "AB"}, (i, module)
    assert not any(k.endswith("_moe") for k in served if int(k.split(".")[0]) not in spec.moe.sparse_layers)


def _check_sglang_refuses_qwen3_next(ns: dict, wheel, hf_dir: Path) -> None:
    """The wheel's Qwen3NextForCausalLM has no get_hidden_dim: the fallback sizes the LoRA buffers of the
    shared expert's gate_up_proj and down_proj (which the experts' targets wrap) by intermediate_size,
    and set_lora_info refuses a B buffer unlike its layer's output: what check_targets refuses by name."""
    import transformers

    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.config.lora import LoRAConfig
    from bapo_megatron.errors import ConfigError
    from bapo_megatron.models.lora import check_targets
    from tests.sglang_wheel import source

    assert "def get_hidden_dim" not in source(wheel, "models/qwen3_next.py")
    assert "base partition prefix dim" in source(wheel, "lora/layers.py")  # set_lora_info's ValueError
    base = transformers.AutoConfig.from_pretrained(str(hf_dir))
    shared = base.shared_expert_intermediate_size
    layer = HFCheckpoint(hf_dir).spec.moe.sparse_layers[0]
    assert ns["get_default_hidden_dim"]("gate_up_proj", base, layer) != (base.hidden_size, 2 * shared)
    assert ns["get_default_hidden_dim"]("down_proj", base, layer) != (shared, base.hidden_size)
    with pytest.raises(ConfigError, match=rf"intermediate_size {base.intermediate_size}.*{shared}"):
        check_targets(HFCheckpoint(hf_dir).spec, LoRAConfig(rank=4, target_modules=("o_proj",), experts=True))


def test_the_embedded_engine_serves_the_synced_expert_adapters_with_the_trainers_logits(exported):
    """What the adapter sync sends, loaded by the embedded engine's ServedAdapters onto transformers'
    model: under the adapter a row's logits are the trainer's (and peft's), a row beside it naming no
    adapter the base's, the base weights untouched; a missing expert's matrix is refused by name."""
    from types import SimpleNamespace

    import transformers

    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.config import load_config
    from bapo_megatron.engines.embedded.lora import TENSOR_SOURCE, ServedAdapters
    from bapo_megatron.models.lora import peft_config

    out, hf_dir = exported
    saved = torch.load(out / "trainer.pt")
    lora = load_config(None, [f"model.hf_path={hf_dir}", *LORA, TARGETS]).model.lora
    config = peft_config(HFCheckpoint(hf_dir).spec, lora, str(hf_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    served = ServedAdapters(model)
    adapter = served.build("v1", config, saved["sent"].items(), TENSOR_SOURCE)
    assert len(adapter.experts) == 3, "every routed layer's experts"
    served.add(adapter)
    ids = saved["ids"]
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with served.rows([SimpleNamespace(lora_id=adapter.id)] * 2):
            together = model(input_ids=ids).logits
        with served.rows([SimpleNamespace(lora_id=adapter.id), SimpleNamespace(lora_id=None)]):
            mixed = model(input_ids=ids).logits
    ours = saved["logits"]
    gap = ((together - ours).abs().max() / ours.abs().max()).item()
    assert gap <= 1e-5 and (together - plain).abs().max() > 1e-3, f"engine and trainer differ by {gap:.2e}"
    torch.testing.assert_close(mixed[0], together[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mixed[1], plain[1], rtol=0, atol=0)
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())
    gone = {n: t for n, t in saved["sent"].items() if ".experts.2.down_proj.lora_B." not in n}
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.2\.down_proj\.lora_B\.weight: missing"):
        served.build("v2", config, gone.items(), TENSOR_SOURCE)


def test_the_merged_export_of_the_adapters_alone_is_pefts_merge(exported, tmp_path):
    """mcore-to-hf of the adapters-alone checkpoint merges each expert's gate_up_proj adapter into its
    gate_proj and up_proj on disk (weights/lora_merge.py): transformers loads what peft's merge gives."""
    import peft
    import transformers

    from bapo_megatron.weights.convert import mcore_to_hf

    out, hf_dir = exported
    merged = mcore_to_hf(out / "ckpt", tmp_path / "hf", dtype="float32", progress=False, base=hf_dir)
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).state_dict()
    base = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base, str(out / "peft")).merge_and_unload().state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-6, atol=1e-6, msg=name)
    initial = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).state_dict()
    assert not torch.equal(
        ours["model.layers.2.mlp.experts.gate_up_proj"], initial["model.layers.2.mlp.experts.gate_up_proj"]
    )

"""What a LoRA run needs beyond its layers: the merge of the adapters into their base weights (the
model the engines and the HF export get) against PEFT's own merge_and_unload, and the starting
weights (a HF directory, a base's dist checkpoint) loaded around the adapters, which keep PEFT's
init, while a LoRA run's own checkpoint brings its adapters back. The whole loop: tests/e2e/test_lora_loop.py."""

import pytest
import torch

from bapo_megatron.common.hf_io import HFCheckpoint
from bapo_megatron.config.lora import LoRAConfig
from bapo_megatron.models.lora import adapter_names, is_adapter, merge_adapters
from bapo_megatron.models.spec import tiny_spec
from bapo_megatron.weights.layout import hf_to_megatron, megatron_to_hf
from tests.dist.launch import run_workers

CASE = ("qwen2", 2, False)
"""Grouped queries (the q/k/v rows interleaved by query group in Megatron's fused weight) and biases."""


def _random_adapters(names: dict[str, str], hf: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A nonzero A and B for every adapter (Megatron's name), shaped as PEFT's [r, in] / [out, r]."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, peft in names.items():
        weight = hf[peft.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] + ".weight"]
        shape = (4, weight.shape[1]) if ".lora_A." in name else (weight.shape[0], 4)
        out[name] = 0.1 * torch.randn(shape, generator=g)
    return out


def test_the_merged_model_is_pefts_merge_and_unload(hf_model):
    import peft
    import transformers

    directory = hf_model("lora-run", CASE)
    spec = HFCheckpoint(directory).spec
    lora = LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    hf = {k: v.detach().clone() for k, v in base.state_dict().items()}
    names = adapter_names(spec, lora)
    adapters = _random_adapters(names, hf, seed=1)
    mg = {**hf_to_megatron(spec, hf, spec.vocab_size, "local"), **adapters}

    with pytest.raises(ValueError, match="merge them first"):  # never exported without them
        megatron_to_hf(spec, mg, "local")
    merged = megatron_to_hf(spec, merge_adapters(spec, mg, lora.alpha / lora.rank), "local")

    config = peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=list(lora.target_modules), lora_dropout=0.0)
    theirs = peft.get_peft_model(base, config)
    state = {names[k]: v for k, v in adapters.items()}
    missing = set(state) - {k.replace(".default", "") for k in theirs.state_dict()}
    assert not missing, sorted(missing)[:3]
    peft.set_peft_model_state_dict(theirs, state)
    reference = theirs.merge_and_unload().state_dict()
    assert merged.keys() <= reference.keys()
    changed = {k for k in merged if not torch.equal(merged[k], hf[k])}
    adapted = {p.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] + ".weight" for p in names.values()}
    assert changed == adapted  # k_proj, gate_proj (fused beside adapted ones) untouched
    for k in merged:
        torch.testing.assert_close(merged[k], reference[k], rtol=1e-6, atol=1e-6, msg=k)


def test_without_adapters_the_merge_changes_nothing():
    tensors = {"decoder.layers.0.self_attention.linear_qkv.weight": torch.randn(16, 8)}
    assert merge_adapters(tiny_spec(), tensors, 2.0) == tensors


def _loader_worker(rank: int, world: int, hf_dir: str, tmp: str) -> None:
    """A LoRA trainer started from a HF directory and from a base's dist checkpoint: the base as
    there, the adapters as PEFT initialises them; then from a LoRA checkpoint: its adapters."""
    from pathlib import Path

    from bapo_megatron.config import load_config
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.dist_ckpt import load_model, save_model
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer
    from bapo_megatron.weights.hf_load import load_hf_into_trainer

    activate_cpu_shim()
    spec = HFCheckpoint(hf_dir).spec

    def trainer(*overrides: str) -> PolicyTrainer:
        cfg = load_config(None, [f"model.hf_path={hf_dir}", *overrides])
        return PolicyTrainer(spec, cfg, init_model_parallel(cfg.parallel, cfg.seed))

    def state(t: PolicyTrainer) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in t.model[0].module.named_parameters()}

    full = trainer()
    load_hf_into_trainer(full, hf_dir)
    save_model(full.model, Path(tmp) / "base")
    expected = state(full)

    lora = trainer("model.lora.rank=4")
    initial = state(lora)
    load_hf_into_trainer(lora, hf_dir)
    for loaded in (state(lora), None):
        if loaded is None:
            for name, p in lora.model[0].module.named_parameters():  # nothing left of the HF load
                with torch.no_grad():
                    p.add_(1.0 if is_adapter(name) else -1.0)
            load_model(lora.model, Path(tmp) / "base")
            loaded = state(lora)
            initial = {k: v + 1.0 for k, v in initial.items()}
        adapters = {k for k in loaded if is_adapter(k)}
        assert adapters and adapters | expected.keys() == loaded.keys()
        for k in adapters:
            assert torch.equal(loaded[k], initial[k]), k  # untouched: B zero, so the base's outputs
        for k in expected:
            assert torch.equal(loaded[k], expected[k]), k

    save_model(lora.model, Path(tmp) / "lora")
    again = trainer("model.lora.rank=4")
    load_model(again.model, Path(tmp) / "lora")
    assert all(torch.equal(v, loaded[k]) for k, v in state(again).items())
    with pytest.raises(ValueError, match="holds LoRA adapters and this model has none"):  # never the base alone
        load_model(full.model, Path(tmp) / "lora")
    _resumes_exactly(trainer, state, tmp)


def _resumes_exactly(trainer, state, tmp: str) -> None:
    """A LoRA step saved and resumed: the adapters and their Adam state as they were (the next step
    the same to the bit), the base unchanged by training. Saved the way a run with a base from a
    source saves (the adapters alone: no base tensor in the checkpoint), and the way checkpoints were
    written before (the base beside them), which still resume."""
    from bapo_megatron.config.run import CheckpointConfig
    from bapo_megatron.trainer.checkpoint import CheckpointManager
    from bapo_megatron.trainer.safe_load import read_metadata
    from tests.helpers import make_batch

    lora = ("model.lora.rank=4", "model.lora.alpha=8", "optimizer.lr=1e-2", "parallel.max_tokens_per_microbatch=48")
    for without_base in (True, False):
        first = trainer(*lora)
        start = state(first)
        first.train_step(make_batch(0))
        manager = CheckpointManager(CheckpointConfig(dir=f"{tmp}/run-{without_base}"))
        manager.without_base = without_base
        saved = manager.save(first)
        stored = {  # the model's tensors (its modules' small objects, TE's _extra_state, are kept either way)
            k for k, m in read_metadata(saved).state_dict_metadata.items() if hasattr(m, "size") and "." in k
        }
        stored = {k for k in stored if not k.startswith("optimizer.")}
        assert stored and all(is_adapter(k) for k in stored) == without_base, sorted(stored)[:3]
        first.train_step(make_batch(1))
        resumed = trainer(*lora)  # its base: the seed's, as the first's (a run loads it from its source)
        CheckpointManager(CheckpointConfig(dir=f"{tmp}/run-{without_base}")).load(resumed, saved)
        resumed.train_step(make_batch(1))
        ours, theirs = state(resumed), state(first)
        differ = [k for k in ours if not torch.equal(ours[k], theirs[k])]
        assert not differ, (without_base, differ[:3])
        moved = {k for k in ours if not torch.equal(ours[k], start[k])}
        assert moved == {k for k in ours if is_adapter(k)}  # every adapter trained (B from zero), no base weight


def test_a_lora_trainer_loads_the_base_around_its_adapters(hf_model, tmp_path):
    run_workers(_loader_worker, 1, str(hf_model("lora-run", CASE)), str(tmp_path))

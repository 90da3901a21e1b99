"""The PEFT adapter of a LoRA run on a released Qwen3.5 checkpoint (Qwen3_5ForConditionalGeneration: the
text model under model.language_model., a vision tower beside it): its names are the multimodal
model's (base_model.model.model.language_model.layers.*), and peft loads it onto transformers'
multimodal model with the trainer's logits."""

from pathlib import Path

import pytest
import torch

from tests.dist.launch import run_workers

LORA = ("model.lora.rank=4", "model.lora.alpha=8", "model.lora.sync=merged")


def _multimodal_dir(spec, directory: Path) -> None:
    """A tiny Qwen3_5ForConditionalGeneration (one-block vision tower) saved in the released layout."""
    import transformers

    from tests.families import multimodal_qwen3_5_config, random_hf_model, save_hf_model

    config = multimodal_qwen3_5_config(spec)
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():  # a random text model under the multimodal names
        for name, tensor in random_hf_model(spec).state_dict().items():
            disk = name if name == "lm_head.weight" else "model.language_model." + name.removeprefix("model.")
            model.state_dict()[disk].copy_(tensor)
    save_hf_model(model, spec, directory)


def _worker(rank: int, world: int, hf_dir: str, out: str) -> None:
    """A LoRA trainer on the multimodal checkpoint, its adapters random: its logits, its checkpoint's
    PEFT adapter."""
    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.config import dump_config, load_config
    from bapo_megatron.config.run import CheckpointConfig
    from bapo_megatron.models.lora import is_adapter
    from bapo_megatron.trainer.checkpoint import CheckpointManager
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer
    from bapo_megatron.weights.hf_load import load_hf_into_trainer
    from bapo_megatron.weights.peft_export import write_peft_adapter

    activate_cpu_shim()
    hf = HFCheckpoint(hf_dir)
    cfg = load_config(None, [f"model.hf_path={hf_dir}", *LORA])
    trainer = PolicyTrainer(hf.spec, cfg, init_model_parallel(cfg.parallel, cfg.seed))
    load_hf_into_trainer(trainer, hf_dir)
    model, g = trainer.model[0].module, torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter(name):
                param.copy_(0.1 * torch.randn(param.shape, generator=g))
    ids = torch.randint(hf.spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
    model.eval()
    with torch.no_grad():
        logits = model(ids, torch.arange(12).expand_as(ids), attention_mask=None)[..., : hf.spec.vocab_size]
    CheckpointManager(CheckpointConfig(dir=f"{out}/ckpt"), dump_config(cfg)).save(trainer)
    write_peft_adapter(f"{out}/ckpt", f"{out}/peft")
    torch.save({"logits": logits, "ids": ids}, f"{out}/trainer.pt")


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path]:
    """(our output directory: peft/ and trainer.pt, the multimodal HF base)."""
    import dataclasses

    from bapo_megatron.models.spec import tiny_spec

    root = tmp_path_factory.mktemp("lora-multimodal")
    _multimodal_dir(dataclasses.replace(tiny_spec("qwen3_5_text"), tie_embeddings=False), root / "hf")
    run_workers(_worker, 1, str(root / "hf"), str(root))
    return root, root / "hf"


def test_the_adapter_names_are_the_multimodal_models(exported):
    import json

    from safetensors.torch import load_file

    out, _ = exported
    names = set(load_file(str(out / "peft" / "adapter_model.safetensors")))
    assert names and all(n.startswith("base_model.model.model.language_model.layers.") for n in names), names
    config = json.loads((out / "peft" / "adapter_config.json").read_text())
    assert "in_proj_qkv" in config["target_modules"] and "q_proj" in config["target_modules"]


def test_peft_loads_it_onto_the_multimodal_model_with_the_trainers_logits(exported):
    import peft
    import transformers

    out, hf_dir = exported
    base = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(base, str(out / "peft")).eval()
    loaded = {n for n, _ in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}
    assert loaded and not any(".visual." in n for n in loaded), "the vision tower is not adapted"
    saved = torch.load(out / "trainer.pt")
    with torch.no_grad():
        theirs = model(input_ids=saved["ids"]).logits
        with model.disable_adapter():
            plain = model(input_ids=saved["ids"]).logits
    assert (theirs - plain).abs().max() > 1e-3, "the adapters change the logits"
    gap = ((saved["logits"] - theirs).abs().max() / theirs.abs().max()).item()
    assert gap <= 1e-5, f"logits differ from peft's by {gap:.2e}"

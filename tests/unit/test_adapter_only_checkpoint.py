"""A LoRA run's checkpoint of the adapters alone (its base loaded from a source at every start): no base
tensor in it, and mcore-to-hf merges it onto the base its lora_base.json names, or onto one given
(--base: a copy, or the base converted to a dist checkpoint), into the model the same run's checkpoint
with the base beside its adapters (the layout written before) exports; a base with other weights is
refused naming both, a base gone asks for --base; the PEFT adapter needs no base; verify runs on it.
The run itself (resume exact, bapo-train): tests/unit/test_lora_run.py, tests/e2e/test_lora_loop.py."""

import shutil
from pathlib import Path

import pytest
import torch

from tests.dist.launch import run_workers

CASE = ("qwen2", 2, False)
"""Grouped queries (the q/k/v rows interleaved by query group in Megatron's fused weight) and biases."""


def _saved(hf_dir: Path, root: Path) -> tuple[Path, Path]:
    """A LoRA step (the HF base, its adapters moved off zero by one step) saved twice: the adapters
    alone (as a run whose base has a source saves), and with the base beside them (as before)."""
    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.config import dump_config, load_config
    from bapo_megatron.config.run import CheckpointConfig
    from bapo_megatron.trainer.base_identity import identify_base
    from bapo_megatron.trainer.checkpoint import CheckpointManager
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer
    from bapo_megatron.weights.hf_load import load_hf_into_trainer
    from tests.helpers import make_batch

    overrides = [f"model.hf_path={hf_dir}", "model.lora.rank=4", "model.lora.alpha=8", "optimizer.lr=5e-2"]
    cfg = load_config(None, [*overrides, "parallel.max_tokens_per_microbatch=48"])
    trainer = PolicyTrainer(HFCheckpoint(hf_dir).spec, cfg, init_model_parallel(cfg.parallel, cfg.seed))
    load_hf_into_trainer(trainer, hf_dir)
    identify_base(trainer, "model.hf_path", hf_dir)  # lora_base.json, in what the checkpoints carry
    trainer.train_step(make_batch(0))
    saved = []
    for without_base in (True, False):
        manager = CheckpointManager(CheckpointConfig(dir=str(root / f"ckpt-{without_base}")), dump_config(cfg))
        manager.without_base = without_base
        saved.append(manager.save(trainer))
    return saved[0], saved[1]


def _changed(source: Path, out: Path) -> Path:
    """A copy of the HF directory `source` with one element of a weight's first row changed."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    name = "model.layers.0.self_attn.o_proj.weight"
    (weights,) = [f for f in out.glob("*.safetensors") if name in load_file(str(f))]
    tensors = load_file(str(weights))
    tensors[name][0, 1] += 0.25
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return out


def _worker(rank: int, world: int, hf_dir: str, tmp: str) -> None:
    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.models.lora import is_adapter
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.safe_load import read_metadata
    from bapo_megatron.weights.convert import hf_to_mcore, mcore_to_hf, verify_conversion
    from bapo_megatron.weights.peft_export import write_peft_adapter

    activate_cpu_shim()
    root = Path(tmp)
    shutil.copytree(hf_dir, root / "base")
    alone, beside = _saved(root / "base", root)
    tensors = {k for k, m in read_metadata(alone).state_dict_metadata.items() if hasattr(m, "size")}
    assert {k for k in tensors if not k.startswith("optimizer.") and not is_adapter(k)} == set()
    assert any(not is_adapter(k) for k in read_metadata(beside).state_dict_metadata if k.startswith("decoder."))

    def export(source: Path, name: str, **kw) -> dict[str, torch.Tensor]:
        out = mcore_to_hf(source, root / name, dtype="float32", progress=False, **kw)
        hf = HFCheckpoint(out)
        return {n: hf[n] for n in hf.files}

    want = export(beside, "from-beside")  # merged in Megatron's names, the base as the checkpoint holds it
    base = HFCheckpoint(root / "base")
    assert any(not torch.equal(t, base[n]) for n, t in want.items()), "the step moved the adapters"
    for name, got in export(alone, "onto-recorded").items():  # the base lora_base.json names
        torch.testing.assert_close(got, want[name], rtol=1e-6, atol=1e-6, msg=name)
    assert verify_conversion(root / "onto-recorded", alone)["max_rel"] <= 1e-5

    hf_to_mcore(root / "base", root / "base-mcore", progress=False)
    shutil.copytree(root / "base", root / "copy")
    for given in ("copy", "base-mcore"):  # the same weights elsewhere, a HF directory or a dist checkpoint
        for name, got in export(alone, f"onto-{given}", base=root / given).items():
            torch.testing.assert_close(got, want[name], rtol=1e-6, atol=1e-6, msg=name)

    _changed(root / "base", root / "other")
    with pytest.raises(ValueError, match="has other weights") as refused:
        export(alone, "onto-other", base=root / "other")
    assert str(root / "other") in str(refused.value) and str((root / "base").resolve()) in str(refused.value)
    with pytest.raises(ValueError, match="holds its model's base itself"):
        export(beside, "given-needlessly", base=root / "copy")
    (root / "base").rename(root / "moved")
    with pytest.raises(ValueError, match=r"is not there: pass --base"):
        export(alone, "base-gone")
    write_peft_adapter(alone, root / "peft")  # needs no base
    assert (root / "peft" / "adapter_model.safetensors").is_file()
    _refused_without_its_base(root / "moved", alone)


def _refused_without_its_base(hf_dir: Path, alone: Path) -> None:
    """The adapters alone are no model: a run without model.lora does not resume them, and no run
    starts from them as its weights (model.mcore_path), each said by name."""
    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.config import load_config
    from bapo_megatron.config.run import CheckpointConfig
    from bapo_megatron.errors import ConfigError
    from bapo_megatron.trainer.checkpoint import CheckpointManager
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    cfg = load_config(None, [f"model.hf_path={hf_dir}"])
    full = PolicyTrainer(HFCheckpoint(hf_dir).spec, cfg, init_model_parallel(cfg.parallel, cfg.seed))
    with pytest.raises(ConfigError, match="model.lora.rank=0.*holds LoRA adapters alone"):
        CheckpointManager(CheckpointConfig(dir=str(alone.parent))).load(full, alone)
    with pytest.raises(ValueError, match="holds LoRA adapters alone, without the base"):
        full.load_weights(alone)


def test_an_adapter_only_checkpoint_exports_onto_its_checked_base(hf_model, tmp_path):
    run_workers(_worker, 1, str(hf_model("lora-run", CASE)), str(tmp_path))


def _resume_worker(rank: int, world: int, hf_dir: str, tmp: str) -> None:
    """At data parallel 2 (the distributed optimizer's state split over the ranks): the adapters-alone
    checkpoint resumes onto the base loaded from its source, and the next step is the same to the bit."""
    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.config import load_config
    from bapo_megatron.config.run import CheckpointConfig
    from bapo_megatron.models.lora import is_adapter
    from bapo_megatron.trainer.checkpoint import CheckpointManager
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer
    from bapo_megatron.trainer.safe_load import read_metadata
    from bapo_megatron.weights.hf_load import load_hf_into_trainer
    from tests.helpers import make_batch

    activate_cpu_shim()
    overrides = [f"model.hf_path={hf_dir}", "model.lora.rank=4", "optimizer.lr=1e-2"]
    cfg = load_config(None, [*overrides, "parallel.max_tokens_per_microbatch=48"])

    def trainer() -> PolicyTrainer:
        made = PolicyTrainer(HFCheckpoint(hf_dir).spec, cfg, init_model_parallel(cfg.parallel, cfg.seed))
        load_hf_into_trainer(made, hf_dir)  # the base from its source, as job.py loads it at every start
        return made

    def state(t: PolicyTrainer) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in t.model[0].module.named_parameters()}

    first = trainer()
    first.train_step(make_batch(0))
    manager = CheckpointManager(CheckpointConfig(dir=f"{tmp}/run"))
    manager.without_base = True
    saved = manager.save(first)
    stored = [k for k, m in read_metadata(saved).state_dict_metadata.items() if hasattr(m, "size")]
    assert [k for k in stored if not k.startswith("optimizer.") and not is_adapter(k)] == []  # no base tensor
    first.train_step(make_batch(1))
    resumed = trainer()
    CheckpointManager(CheckpointConfig(dir=f"{tmp}/run")).load(resumed, saved)
    resumed.train_step(make_batch(1))
    ours, theirs = state(resumed), state(first)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), [k for k in ours if not torch.equal(ours[k], theirs[k])]


def test_an_adapter_only_checkpoint_resumes_exactly_at_data_parallel_2(hf_model, tmp_path):
    run_workers(_resume_worker, 2, str(hf_model("lora-run", CASE)), str(tmp_path))

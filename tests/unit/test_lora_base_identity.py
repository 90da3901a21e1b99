"""A LoRA checkpoint records its base (trainer/base_identity.py): the fingerprint is the base's at any
layout and blind to the adapters; a resume on another base (another path and weights, or the same
path with other weights) is refused naming both, the same weights by another path accepted with a
note; and bapo-train checks it on resume before the checkpoint's state loads."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from bapo_megatron.errors import ConfigError
from bapo_megatron.trainer.base_identity import BASE_FILE, BaseIdentity, check_base
from tests.dist.launch import run_workers

CASE = ("qwen2", 2, False)
"""Grouped queries and q/k/v biases: the fused qkv rows interleaved by query group, split over TP."""
ROW0 = "model.layers.1.self_attn.o_proj.weight"
"""A row-parallel weight: its first row split over TP by columns."""


def _record(directory: Path, identity: BaseIdentity) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / BASE_FILE).write_text(identity.to_json())
    return directory


def test_another_base_is_refused_naming_both_and_a_copy_accepted(tmp_path):
    saved = _record(tmp_path / "step_00000002", BaseIdentity("/models/a", "f" * 64, 10))
    assert check_base(saved, BaseIdentity("/models/a", "f" * 64, 10)) is None
    note = check_base(saved, BaseIdentity("/copies/a", "f" * 64, 10))
    assert "/models/a" in note and "/copies/a" in note and "same weights" in note
    for other in (BaseIdentity("/models/b", "e" * 64, 10), BaseIdentity("/models/a", "e" * 64, 10)):
        with pytest.raises(ConfigError, match="model.hf_path") as refused:
            check_base(saved, other)
        line = str(refused.value)
        assert "\n" not in line and "/models/a" in line and other.path in line and "ffffffffffff" in line
    with pytest.raises(ConfigError, match="seed's random initialisation"):
        check_base(saved, BaseIdentity(None, "e" * 64, 10), "seed")
    assert "does not record" in check_base(tmp_path, BaseIdentity("/models/a", "f" * 64, 10))


def _changed_copy(source: Path, out: Path, name: str = ROW0) -> Path:
    """`source` copied to `out`, one element of `name`'s first row changed."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    for weights in out.glob("*.safetensors"):
        tensors = load_file(str(weights))
        if name in tensors:
            tensors[name][0, 3] += 0.5
            save_file(tensors, str(weights), metadata={"format": "pt"})
            return out
    raise AssertionError(f"{source} has no {name}")


def _trainer(hf_dir: Path, tp: int, *extra: str):
    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.config import load_config
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer
    from bapo_megatron.weights.hf_load import load_hf_into_trainer

    overrides = [f"model.hf_path={hf_dir}", "model.lora.rank=4", f"parallel.tensor={tp}", *extra]
    cfg = load_config(None, overrides)
    trainer = PolicyTrainer(HFCheckpoint(hf_dir).spec, cfg, init_model_parallel(cfg.parallel, cfg.seed))
    load_hf_into_trainer(trainer, hf_dir)
    return trainer


def _fingerprint_worker(rank: int, world: int, tmp: str, bases: list[str]) -> None:
    """Each base's fingerprint at TP = world, then the last one's with its adapters moved."""
    from bapo_megatron.models.lora import is_adapter
    from bapo_megatron.trainer.base_identity import fingerprint
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim

    activate_cpu_shim()
    found = []
    for base in bases:
        trainer = _trainer(Path(base), world)
        found.append(fingerprint(trainer.model, trainer.spec.vocab_size))
    with torch.no_grad():
        for name, p in trainer.model[0].module.named_parameters():
            if is_adapter(name):
                p.add_(1.0)
    found.append(fingerprint(trainer.model, trainer.spec.vocab_size))
    if rank == 0:
        Path(tmp, f"tp{world}.json").write_text(json.dumps(found))


def test_the_fingerprint_is_the_bases_at_any_layout(hf_model, tmp_path):
    base = hf_model("lora-base", CASE)
    changed = _changed_copy(base, tmp_path / "changed")
    for world in (1, 2):
        run_workers(_fingerprint_worker, world, str(tmp_path), [str(base), str(changed)])
    one, two = (json.loads((tmp_path / f"tp{w}.json").read_text()) for w in (1, 2))
    assert one == two  # the same at TP 1 and TP 2 (row-parallel rows gathered, vocabulary unpadded)
    (digest, count), (other, _), (with_moved_adapters, _) = one
    assert count > 10 and digest != other  # one element of a row-parallel weight's first row
    assert with_moved_adapters == other


def _resume_worker(rank: int, world: int, tmp: str, base: str) -> None:
    """A LoRA checkpoint saved with its base's record; resumes checked on a copy, another base, and
    the same path with its weights changed."""
    from bapo_megatron.config.run import CheckpointConfig
    from bapo_megatron.trainer.base_identity import identify_base, recorded_base
    from bapo_megatron.trainer.checkpoint import CheckpointManager
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim

    activate_cpu_shim()
    root = Path(tmp)
    shutil.copytree(base, root / "a")
    first = _trainer(root / "a", 1)
    mine = identify_base(first, "model.hf_path", root / "a")
    saved = CheckpointManager(CheckpointConfig(dir=str(root / "run"))).save(first)
    assert recorded_base(saved) == mine and mine.path == str((root / "a").resolve())

    shutil.copytree(root / "a", root / "copy")
    assert identify_base(_trainer(root / "copy", 1), "model.hf_path", root / "copy", saved).path.endswith("copy")
    _changed_copy(root / "a", root / "b", "model.layers.0.mlp.down_proj.weight")
    with pytest.raises(ConfigError, match=r"model.hf_path=.*/b'.*trained on the base .*/a \(fingerprint"):
        identify_base(_trainer(root / "b", 1), "model.hf_path", root / "b", saved)
    shutil.rmtree(root / "a")
    (root / "b").rename(root / "a")  # the same path, other weights
    with pytest.raises(ConfigError, match="has other weights"):
        identify_base(_trainer(root / "a", 1), "model.hf_path", root / "a", saved)


def test_a_lora_checkpoint_refuses_another_base(hf_model, tmp_path):
    run_workers(_resume_worker, 1, str(tmp_path), str(hf_model("lora-base", CASE)))


@pytest.mark.e2e
@pytest.mark.slow
def test_bapo_train_refuses_a_lora_resume_on_another_base(hf_model, tmp_path):
    """The run's checkpoint records its base; resumed with model.hf_path at other weights, bapo-train
    stops with one error line naming both before its next step (job.py identifies the base first)."""
    from tests.online import MODEL, args, metrics, start, train, write_task

    task = write_task(tmp_path / "task", 8, hf_model(*MODEL))
    run = tmp_path / "run"
    lora = ("rollout.mode=sync", "model.lora.rank=4")
    train(args(task, run, 1, *lora))
    assert json.loads((run / "ckpt" / "step_00000001" / BASE_FILE).read_text())["path"] == str((task / "m").resolve())

    other = _changed_copy(task / "m", tmp_path / "other", "model.layers.0.self_attn.o_proj.weight")
    proc = start([*args(task, run, 2, *lora), f"model.hf_path={other}"])
    out, _ = proc.communicate(timeout=900)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, out[-3000:]
    assert str((task / "m").resolve()) in errors[0] and str(other) in errors[0], errors[0]
    assert [m["step"] for m in metrics(run)] == [1]  # refused before it trained

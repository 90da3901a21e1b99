"""Checkpoints under kills, reuse of a directory, and crafted files.

A kill at each point of the save sequence (before the rename, after the rename but before
`latest`, after `latest` but before pruning) leaves a directory that resumes at the newest
complete step, repairs `latest`, and saves on without a FileExistsError; a step whose updates
were all skipped saves under its own name; pruning never removes the newest step, what
`latest` names, or what was just written; starting afresh over existing checkpoints is refused.
A checkpoint whose .metadata or .distcp byte item carries a pickled command is refused, naming
the file, and the command never runs (a marker file must never appear).
"""

import os
import pickle
from pathlib import Path

import pytest

from tests.dist.launch import run_workers


class SimulatedKill(BaseException):
    """Stands in for SIGKILL at one point of a save (nothing after it runs)."""


class Command:
    """A pickle that runs a command when loaded (what a hostile checkpoint would carry)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _trainer(cfg_overrides=()):
    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    activate_cpu_shim()
    cfg = load_config(None, ["parallel.max_tokens_per_microbatch=64", *cfg_overrides])
    return PolicyTrainer(tiny_spec(), cfg, init_model_parallel(cfg.parallel, cfg.seed)), cfg


def _kills(rank: int, world: int, root: str) -> None:
    import warnings

    from bapo_megatron.config import CheckpointConfig
    from bapo_megatron.errors import ConfigError
    from bapo_megatron.trainer import checkpoint, dist_ckpt
    from tests.helpers import make_batch

    trainer, _ = _trainer()
    trainer.train_step(make_batch(1))  # optimizer state to save and restore
    for point, module, patched in (
        ("before-rename", dist_ckpt, "publish"),
        ("before-latest", checkpoint, "write_text_atomic"),
        ("before-prune", checkpoint, "CheckpointManager._prune"),
    ):
        directory = Path(root) / point
        manager = checkpoint.CheckpointManager(CheckpointConfig(dir=str(directory), keep_last=1))
        manager.save(trainer, 1)
        owner, _, name = patched.rpartition(".")
        target = getattr(module, owner) if owner else module
        original = getattr(target, name)

        def kill(*args, _point=point, **kwargs):
            raise SimulatedKill(_point)

        setattr(target, name, kill)
        try:
            with pytest.raises(SimulatedKill):
                manager.save(trainer, 2)
        finally:
            setattr(target, name, original)
        if point == "before-rename":  # a real kill leaves the save's temporary behind (it is cleaned up later)
            (directory / ".step_00000002.k1ll3d.tmp").mkdir()
        resumed = checkpoint.CheckpointManager(CheckpointConfig(dir=str(directory), keep_last=1))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            newest = resumed.latest()
        expected = "step_00000001" if point == "before-rename" else "step_00000002"
        assert newest.name == expected, (point, newest)
        assert (directory / "latest").read_text().strip() == expected  # repaired when it was stale
        assert bool(caught) == (point == "before-latest"), (point, [str(w.message) for w in caught])
        assert resumed.load(trainer) == int(expected[-1])
        resumed.save(trainer, 3)  # saves on: no FileExistsError from a step written before the kill
        assert sorted(p.name for p in directory.iterdir()) == ["latest", "step_00000003"], point  # temporaries too
    # a step whose updates were all skipped leaves the optimizer step where it was: its own name still
    skipped = checkpoint.CheckpointManager(CheckpointConfig(dir=str(Path(root) / "skipped"), keep_last=5))
    assert skipped.save(trainer, 1).name != skipped.save(trainer, 2).name
    assert skipped.save(trainer, 2).name == "step_00000002"  # repeated after a kill: done already
    # a fresh run in a directory that holds later steps: refused, saying how
    later = checkpoint.CheckpointManager(CheckpointConfig(dir=str(Path(root) / "skipped"), keep_last=1))
    with pytest.raises(ConfigError, match=r"checkpoint.resume=False: .* holds checkpoints \(newest step_00000002\)"):
        later.check_start(resume=False)
    later.check_start(resume=True)
    # pruning keeps the newest, what latest names, and what was just written, whatever their order
    (Path(root) / "skipped" / "step_00000100").mkdir()
    (Path(root) / "skipped" / "step_00000100" / "metadata.json").write_text("{}")
    written = later.save(trainer, 3)
    assert written.is_dir() and (Path(root) / "skipped" / "step_00000100").is_dir()
    assert (Path(root) / "skipped" / "latest").read_text().strip() == "step_00000003"
    assert not (Path(root) / "skipped" / "step_00000001").exists()
    # a newest step without metadata.json (another tool's interrupted save): set aside on resume, and
    # the run saves that step when it reaches it (left there, every resume stopped at it)
    (Path(root) / "skipped" / "step_00000004").mkdir()
    (Path(root) / "skipped" / "step_00000004" / "__0_0.distcp").write_bytes(b"cut")
    later.check_start(resume=True)
    assert (Path(root) / "skipped" / "step_00000004.incomplete" / "__0_0.distcp").is_file()
    assert later.latest().name == "step_00000100" and later.save(trainer, 4).name == "step_00000004"


@pytest.mark.dist
def test_kills_at_every_point_of_a_save_never_wedge_resume(tmp_path):
    run_workers(_kills, 1, str(tmp_path))


def _crafted(rank: int, world: int, root: str) -> None:
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from bapo_megatron.trainer.dist_ckpt import load_sharded, save_model, save_sharded
    from bapo_megatron.trainer.safe_load import UnsafeCheckpointError, read_metadata

    root = Path(root)
    marker = root / "marker"
    trainer, _ = _trainer()
    save_model(trainer.model, root / "plain")
    # .metadata: a field of the real metadata replaced by a command, the rest intact
    metadata = read_metadata(root / "plain")
    metadata.planner_data = Command(str(marker))
    (root / "plain" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refers to posix\.system"):
        trainer.load_weights(root / "plain")
    # a byte item of a .distcp: what Megatron's planner would torch.load(weights_only=False)
    save_sharded({"obj": ShardedObject("payload", Command(str(marker)), (1,), (0,), replica_id=0)}, root / "items")
    with pytest.raises(UnsafeCheckpointError, match=r"__0_0\.distcp: item 'payload/shard_0_1' is not plain data"):
        load_sharded({"obj": ShardedObject("payload", None, (1,), (0,), replica_id=0)}, root / "items")
    save_sharded(
        {"obj": ShardedObject("payload", {"step": torch.tensor([3])}, (1,), (0,), replica_id=0)}, root / "fine"
    )  # plain data still loads
    loaded = load_sharded({"obj": ShardedObject("payload", None, (1,), (0,), replica_id=0)}, root / "fine")
    assert loaded["obj"]["step"].item() == 3
    # the checkpoint tools on a converted checkpoint whose .metadata carries the command
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import convert_checkpoint
    import reshard

    from bapo_megatron.weights.convert import hf_to_mcore
    from tests.helpers import make_hf_model

    make_hf_model(root, "hf", ("qwen2", 2, False))
    hf_to_mcore(root / "hf", root / "mcore", progress=False)
    metadata = read_metadata(root / "mcore")
    metadata.planner_data = Command(str(marker))
    (root / "mcore" / ".metadata").write_bytes(pickle.dumps(metadata))
    runs = {
        "mcore-to-hf": lambda: convert_checkpoint.main(
            ["mcore-to-hf", "--mcore", str(root / "mcore"), "--out", str(root / "out1"), "--no-progress"]
        ),
        "verify": lambda: convert_checkpoint.main(["verify", "--hf", str(root / "hf"), "--mcore", str(root / "mcore")]),
        "reshard": lambda: reshard.main(["--mcore", str(root / "mcore"), "--out", str(root / "out2"), "--no-progress"]),
    }
    import contextlib
    import io

    for name, run in runs.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert run() == 2, name
        assert err.getvalue().startswith("error: ") and "mcore/.metadata: refers to posix.system" in err.getvalue()
        assert not (root / "out1").exists() and not (root / "out2").exists()
    assert not marker.exists()


@pytest.mark.dist
def test_crafted_checkpoint_files_are_refused_and_run_nothing(tmp_path):
    run_workers(_crafted, 1, str(tmp_path))
    assert not (tmp_path / "marker").exists()

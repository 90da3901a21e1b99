"""The kept tensors' file a run's checkpoints carry (trainer/checkpoint.py CarriedFile, through
trainer/dist_ckpt.save_sharded), on two ranks: hard-linked from the previous step instead of rewritten,
still checksummed, and written afresh when the previous step's recorded copy is not what this run wrote;
budgeted with the tensors, so a disk without room for it refuses the save before anything is written;
and a failed write of it on rank 0 raised on both ranks at once with one message naming the file, the
previous checkpoint untouched and nothing partial left for a resume to load. One launch; a stand-in
trainer holding one sharded tensor (what is tested is the files beside it)."""

import errno
import faulthandler
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests import toy_layouts as toys
from tests.dist.launch import run_workers

HANG_S = 300
"""A rank still waiting after this long is wedged in a collective (exit with its traceback)."""
TENSOR_BYTES = 2 * 1024 * 4  # the stand-in model: 1024 float32 a rank


class _Chunk(torch.nn.Module):
    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.rank, self.world, self.w = rank, world, torch.arange(1024.0) + rank

    def sharded_state_dict(self) -> dict:
        from megatron.core.dist_checkpointing import ShardedTensor

        return {"w": ShardedTensor.from_rank_offsets("w", self.w, (0, self.rank, self.world))}


class _Stateless:
    def sharded_state_dict(self, model_sd: dict, is_loading: bool = False) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}


def _trainer(rank: int, world: int, root: Path) -> SimpleNamespace:
    """What CheckpointManager.save reads of a trainer, carrying a multimodal model's vision tower."""
    import torch.distributed as dist

    from bapo_megatron.models.spec import ModelSpec
    from bapo_megatron.trainer.checkpoint import model_files

    if rank == 0:
        toys.multimodal_checkpoint(root / "vl")
    dist.barrier()
    files = model_files(ModelSpec.from_hf_dir(root / "vl"), str(root / "vl")) if rank == 0 else {}
    return SimpleNamespace(
        model=[_Chunk(rank, world)], optimizer=_Stateless(), scheduler=_Stateless(), reference=None, step=0,
        model_files=files,
    )  # fmt: skip


def _linked(rank: int, manager, trainer, ckpt: Path) -> None:
    """The second step links the first's copy; a step after a different recorded copy writes afresh."""
    from bapo_megatron.common.hf_io import KEPT_FILE
    from bapo_megatron.trainer.integrity import CHECKSUMS, read_checksums, verify_integrity

    manager.save(trainer, 1)
    manager.save(trainer, 2)
    first, second = ckpt / "step_00000001" / KEPT_FILE, ckpt / "step_00000002" / KEPT_FILE
    if rank == 0:
        assert os.stat(first).st_ino == os.stat(second).st_ino  # the same bytes, written once
        assert KEPT_FILE in read_checksums(ckpt / "step_00000002" / CHECKSUMS)
        verify_integrity(ckpt / "step_00000002")  # the link is checked as any file written
        carried = trainer.model_files[KEPT_FILE]
        carried.checksum = {**carried.checksum, "crc32": carried.checksum["crc32"] ^ 1}  # not what step 2 records
    manager.save(trainer, 3)
    if rank == 0:
        assert os.stat(ckpt / "step_00000003" / KEPT_FILE).st_ino != os.stat(second).st_ino
        verify_integrity(ckpt / "step_00000003")
        assert not first.exists()  # pruned (keep_last=2): its link in step 2 outlives it
        verify_integrity(ckpt / "step_00000002")


def _budgeted(rank: int, manager, trainer, ckpt: Path) -> None:
    """Room for the tensors but not for the kept file: refused on both ranks, nothing written."""
    from bapo_megatron.errors import DiskFull
    from bapo_megatron.trainer.dist_ckpt import SPACE_MARGIN

    free = int(TENSOR_BYTES * SPACE_MARGIN) + 4096
    if rank == 0:
        assert trainer.model_files["hf_kept.safetensors"].nbytes > 2 * 4096  # the vision tower does not fit
    real = shutil.disk_usage
    shutil.disk_usage = lambda path: SimpleNamespace(free=free)
    try:
        with pytest.raises(DiskFull, match=rf"no space for checkpoint {ckpt / 'step_00000004'}: it needs about"):
            manager.save(trainer, 4)
    finally:
        shutil.disk_usage = real
    assert not list(ckpt.glob("*step_00000004*"))


def _failed_on_rank0(rank: int, world: int, manager, trainer, ckpt: Path) -> None:
    """Rank 0's write of the kept file fails: both ranks raise the same one line, promptly; the previous
    step is untouched and what resumes; nothing of the failed one is left."""
    import torch.distributed as dist

    from bapo_megatron.trainer.dist_ckpt import SaveFailed
    from bapo_megatron.trainer.integrity import verify_integrity

    if rank == 0:
        carried = trainer.model_files["hf_kept.safetensors"]
        carried.last = None  # streamed from its source, which fails midway

        def failing(path: Path) -> None:
            path.write_bytes(b"partial")
            raise OSError(errno.EIO, "Input/output error")

        carried.source = SimpleNamespace(write=failing)
    before = sorted(p.name for p in (ckpt / "step_00000003").iterdir())
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    try:
        with pytest.raises(SaveFailed) as raised:
            manager.save(trainer, 5)
    finally:
        faulthandler.cancel_dump_traceback_later()
    message = str(raised.value)
    want = f"checkpoint {ckpt / 'step_00000005'}: writing hf_kept.safetensors failed ("
    assert message.startswith(want) and message.endswith("nothing of it was kept") and "\n" not in message
    messages = [None] * world
    dist.all_gather_object(messages, message)
    assert len(set(messages)) == 1, messages
    assert not list(ckpt.glob("*step_00000005*")) and manager.latest().name == "step_00000003"
    assert sorted(p.name for p in (ckpt / "step_00000003").iterdir()) == before
    verify_integrity(ckpt / "step_00000003")


def _all(rank: int, world: int, root: str) -> None:
    from bapo_megatron.config import CheckpointConfig
    from bapo_megatron.trainer.checkpoint import CheckpointManager
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim

    activate_cpu_shim()  # Megatron's writer synchronises CUDA
    toys.register()
    root = Path(root)
    trainer, ckpt = _trainer(rank, world, root), root / "ckpt"
    manager = CheckpointManager(CheckpointConfig(dir=str(ckpt), keep_last=2))
    _linked(rank, manager, trainer, ckpt)
    _budgeted(rank, manager, trainer, ckpt)
    _failed_on_rank0(rank, world, manager, trainer, ckpt)


@pytest.mark.dist
def test_the_kept_file_is_linked_budgeted_and_its_failure_raised_on_every_rank(tmp_path):
    run_workers(_all, 2, str(tmp_path))

"""No process outlives the trainer: Megatron's checkpoint writers, forked for each large save
(FileSystemWriterAsync.write_preloaded_data_multiproc), die with a trainer killed mid-save; a small
save forks none and writes what they would (trainer/save_writers.py).

The trainer here is one gloo process saving through trainer/dist_ckpt.save_sharded, its writer held
inside the write (as a slow disk holds it) until the test has killed the trainer with SIGKILL. Before
the fix the writer stayed (PPID 1, a copy of the trainer's memory, blocked on its queue; issue 34's F3).
Kills before the writers fork and after they end leave no child to check: the directory those leave
is test_checkpoint_faults.py's."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]


def test_a_trainer_killed_while_its_writers_write_leaves_no_writer(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.dist.test_checkpoint_writers", str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    writers = []
    try:
        for line in proc.stdout:
            if line.startswith("writer "):
                writers.append(int(line.split()[1]))
                break
        assert writers, "the save never reached its writers: nothing was tested"
        assert psutil.Process(writers[0]).ppid() == proc.pid  # the trainer's own child, writing
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while psutil.pid_exists(writers[0]) and psutil.Process(writers[0]).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"writer {writers[0]} outlived the trainer"
            time.sleep(0.1)
    finally:
        proc.kill()
        for pid in writers:  # a writer left by a failed check: not left running for the next test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not (tmp_path / "step").exists()  # nothing partial under the step's name


def test_a_small_save_forks_no_writer_and_writes_what_the_writers_would(tmp_path):
    """The same state saved twice in a world of one: in the saving process (no process started during
    the save) and by Megatron's forked writers (save_writers.IN_PROCESS_BYTES 0): the same files,
    byte for byte (.metadata: the same entries, where each item lies in which file), and the
    tensors load back."""
    from torch.distributed.checkpoint import FileSystemReader

    out = subprocess.run(
        [sys.executable, "-m", "tests.dist.test_checkpoint_writers", str(tmp_path), "both"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    started = dict(line.split() for line in out.stdout.splitlines() if line.startswith(("small", "large")))
    assert started == {"small": "0", "large": "2"}, out.stdout  # processes started during each save
    small, large = tmp_path / "small", tmp_path / "large"
    names = sorted(p.name for p in small.iterdir())
    assert names == sorted(p.name for p in large.iterdir()) and "__0_0.distcp" in names, names
    for name in set(names) - {".metadata", "checksums.json"}:  # (a random save id in one, its checksum in the other)
        assert (small / name).read_bytes() == (large / name).read_bytes(), name
    ours, theirs = FileSystemReader(str(small)).read_metadata(), FileSystemReader(str(large)).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata and ours.storage_data == theirs.storage_data
    assert "loaded equal" in out.stdout


def _world_of_one() -> None:
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim

    activate_cpu_shim()


def _state(scale: float) -> dict:
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor

    return {
        name: ShardedTensor.from_rank_offsets(name, torch.arange(n, dtype=dtype) * scale, replica_id=0)
        for name, n, dtype in [("w", 4096, torch.float32), ("b", 300, torch.bfloat16), ("step", 3, torch.int64)]
    }


def _save_both_ways(root: str) -> None:
    """`small` saved in this process, `large` by forked writers; how many processes each save started."""
    import multiprocessing.process

    import torch
    from megatron.core import dist_checkpointing

    from bapo_megatron.trainer import save_writers
    from bapo_megatron.trainer.dist_ckpt import save_sharded

    _world_of_one()
    started = []
    start = multiprocessing.process.BaseProcess.start

    def counted(self):
        started.append(self)
        return start(self)

    multiprocessing.process.BaseProcess.start = counted
    for name, limit in [("small", save_writers.IN_PROCESS_BYTES), ("large", 0)]:
        started.clear()
        save_writers.IN_PROCESS_BYTES = limit
        save_sharded(_state(1.0), Path(root) / name)
        print(name, len(started), flush=True)
    loaded = dist_checkpointing.load(_state(0.0), str(Path(root) / "small"))
    if all(torch.equal(loaded[k], v.data) for k, v in _state(1.0).items()):
        print("loaded equal", flush=True)


def _save_held_in_the_writer(root: str) -> None:
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from bapo_megatron.trainer import save_writers
    from bapo_megatron.trainer.dist_ckpt import save_sharded

    _world_of_one()
    save_writers.IN_PROCESS_BYTES = 0  # forked writers, as a large save's
    write = FileSystemWriterAsync.write_preloaded_data

    def held(*args, **kwargs):  # in the forked writer
        print(f"writer {os.getpid()}", flush=True)
        time.sleep(600)
        return write(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(held)
    save_sharded({"w": ShardedTensor.from_rank_offsets("w", torch.arange(4096.0), replica_id=0)}, Path(root) / "step")


if __name__ == "__main__":
    (_save_both_ways if sys.argv[2:] == ["both"] else _save_held_in_the_writer)(sys.argv[1])

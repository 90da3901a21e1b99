"""No process outlives the trainer: Megatron's checkpoint writers, forked for each save
(FileSystemWriterAsync.write_preloaded_data_multiproc), die with a trainer killed mid-save.

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


def _save_held_in_the_writer(root: str) -> None:
    import socket

    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.dist_ckpt import save_sharded

    activate_cpu_shim()
    write = FileSystemWriterAsync.write_preloaded_data

    def held(*args, **kwargs):  # in the forked writer
        print(f"writer {os.getpid()}", flush=True)
        time.sleep(600)
        return write(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(held)
    save_sharded({"w": ShardedTensor.from_rank_offsets("w", torch.arange(4096.0), replica_id=0)}, Path(root) / "step")


if __name__ == "__main__":
    _save_held_in_the_writer(sys.argv[1])

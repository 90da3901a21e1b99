"""Who writes a rank's checkpoint files: the saving process itself for a small save, forked writers for a large one.

Megatron's torch_dist strategy (megatron-core 0.16.1) writes each rank's files from processes it
forks for every save, a synchronous one too (FileSystemWriterAsync.write_preloaded_data_multiproc,
one a bucket, two buckets a rank). Each is a copy-on-write image of the trainer: for the demo's
model (a few MiB of tensors) the fork costs more than the write, and the two writers of a 0.6 GiB
trainer count 0.58 GiB of RSS each in a run's peak memory. A rank whose tensors come to at most
IN_PROCESS_BYTES writes its buckets itself, one after another, through the same per-bucket writer
(FileSystemWriterAsync.write_preloaded_data: the same files, bytes and write results, each file
fsync'd), and hands the results on as the forked writers do; a larger one keeps Megatron's parallel
writers. Where and how a save is published (temporary directory, checksums, rename) is
dist_ckpt.save_sharded's, the same either way. tests/dist/test_checkpoint_writers.py checks both
ways write the same files (and is the canary for megatron-core's writer internals used here).
"""

from __future__ import annotations

import functools
import queue

from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

IN_PROCESS_BYTES = 256 << 20
"""A rank's tensors up to this size are written by the saving process (see the module's docstring)."""


class SmallSavesInProcess(TorchDistSaveShardedStrategy):
    """Megatron's torch_dist save strategy, whose small saves write in the saving process."""

    def __init__(self) -> None:
        super().__init__("torch_dist", 1)  # Megatron's default save strategy's backend and version

    def _get_save_and_finalize_callbacks(self, writer: FileSystemWriterAsync, save_state_dict_ret) -> AsyncRequest:
        request = super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)
        if request.async_fn is None or bucket_bytes(writer.write_buckets) > IN_PROCESS_BYTES:
            return request  # nothing to write on this rank, or a save worth its parallel writers
        # the forked writers' function, called with upstream's own (transforms, use_msc)
        return request._replace(async_fn=functools.partial(write_in_process, *request.async_fn.args))


def bucket_bytes(buckets) -> int:
    """The bytes of the tensors in a writer's buckets, (file, key, (bytes items, tensor items)) each."""
    return sum(t.numel() * t.element_size() for _, _, (_, tensors) in buckets for _, t in tensors)


def write_in_process(transforms: list, use_msc: bool, rank: int, buckets: list, results: queue.Queue) -> None:
    """write_preloaded_data_multiproc's contract in this process: every bucket's write results by its
    index on `results`, or the first bucket's error (the later buckets are then not written)."""
    done, count = queue.Queue(), queue.Queue()
    outcome: dict | Exception = {}
    for index, bucket in enumerate(buckets):
        count.put(index)  # what write_preloaded_data marks done, as a writer process does
        FileSystemWriterAsync.write_preloaded_data(
            transforms, index, bucket, done, count, use_fsync=True, use_msc=use_msc
        )
        _, written = done.get_nowait()
        if isinstance(written, Exception):
            outcome = written
            break
        outcome[index] = written
    results.put(outcome)

"""The whole model's HF buckets on global rank 0, from a TP x PP x EP x DP trainer, for the weight sync.

Every rank of data-parallel rank 0 runs `hf_buckets_to_rank0` (the tensor-parallel gathers
are collectives of its stage); other data-parallel ranks hold copies and do nothing, unless
experts are split (EP > 1): the expert-parallel ranks of a stage are among its data-parallel
ranks, so every rank takes part in the expert gathers and data-parallel rank 0 sends. Rank 0
yields its own stage's buckets, then each later stage's, received from that stage's
tensor-parallel rank 0 over the pipeline group (one bucket at a time: metadata, then the
bucket's bytes as one tensor). So memory on rank 0 is one bucket beyond its own stage, and the
buckets arrive in the order the engines load them: embedding, layers, final norm, output layer.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from bapo_megatron.weights.export import Bucket, Part, stream_hf_buckets


def hf_buckets_to_rank0(trainer, bucket_bytes: int, part: Part = "model") -> Iterator[Bucket]:
    """On global rank 0: every HF bucket of the model (of a LoRA model: `part`, weights/export.py),
    stage by stage. On the ranks that help (data-parallel rank 0 of every stage): nothing is
    yielded; iterate it to the end all the same."""
    info = trainer.info
    if info.dp_rank != 0:
        if info.ep_size > 1:
            for _ in stream_hf_buckets(trainer.model, trainer.spec, info, bucket_bytes, part=part):
                pass  # this rank's part of the expert-parallel gathers
        return
    local = stream_hf_buckets(trainer.model, trainer.spec, info, bucket_bytes, part=part)
    stage_leaders = dist.get_process_group_ranks(info.pp_group) if info.pp_size > 1 else [0]
    me = dist.get_rank()
    if me == 0:
        yield from local
        for leader in stage_leaders[1:]:
            yield from _receive(leader, info.pp_group, trainer.device)
    elif info.tp_rank == 0 and me in stage_leaders:
        for bucket in local:
            _send(bucket, info.pp_group)
        dist.send_object_list([None], dst=0, group=info.pp_group, device=trainer.device)
    else:
        for _ in local:  # this rank's part of the tensor-parallel gathers
            pass


def _send(bucket: Bucket, group) -> None:
    meta = [(name, t.dtype, tuple(t.shape)) for name, t in bucket]
    dist.send_object_list([meta], dst=0, group=group, device=bucket[0][1].device)
    flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in bucket])
    dist.send(flat, dst=0, group=group)


def _receive(src: int, group, device: torch.device) -> Iterator[Bucket]:
    while True:
        box = [None]
        dist.recv_object_list(box, src=src, group=group, device=device)
        meta = box[0]
        if meta is None:
            return
        items = [torch.empty((), dtype=dtype).element_size() for _, dtype, _ in meta]
        sizes = [torch.Size(shape).numel() * item for (_, _, shape), item in zip(meta, items, strict=True)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dist.recv(flat, src=src, group=group)
        bucket, offset = [], 0
        for (name, dtype, shape), size, item in zip(meta, sizes, items, strict=True):
            part = flat[offset : offset + size]
            if offset % item:
                part = part.clone()  # viewed as `dtype`, its start must be aligned to the element size
            bucket.append((name, part.view(dtype).view(shape)))
            offset += size
        yield bucket

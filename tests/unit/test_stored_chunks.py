"""StoredChunks: the memory-mapped reader under mcore-to-hf, against torch DCP's own loader.

Plainly stored chunks are used in place (a view of the mapped file), unaligned ones are
copied once, anything else (here a transposed tensor, whose archive records its strides)
goes through torch.load; regions spanning several chunks are assembled. A missing or
truncated data file is an error before anything is read.
"""

import io
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from bapo_megatron.weights.mcore_io import StoredChunks


def _save(directory: Path, state: dict) -> None:
    dcp.save(
        state, storage_writer=FileSystemWriter(str(directory), single_file_per_rank=True, thread_count=1), no_dist=True
    )


def _reader(directory: Path) -> StoredChunks:
    return StoredChunks(directory, FileSystemReader(str(directory)).read_metadata())


def _dcp_load(directory: Path, key: str, like: torch.Tensor) -> torch.Tensor:
    out = {key: torch.empty_like(like, memory_format=torch.contiguous_format)}
    dcp.load(out, storage_reader=FileSystemReader(str(directory)), no_dist=True)
    return out[key]


def _maps_file(tensor: torch.Tensor, directory: Path) -> bool:
    return tensor.untyped_storage().nbytes() == (directory / "__0_0.distcp").stat().st_size


@pytest.mark.parametrize("odd_bytes", [0, 3])
def test_chunks_read_in_place_copied_or_loaded(tmp_path, odd_bytes):
    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(6, 10, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "t": torch.randn(10, 4, generator=g).t(),
    }  # transposed: strides recorded, not plain
    if odd_bytes:
        state["o"] = io.BytesIO(b"x" * odd_bytes)  # written first: the tensors' bytes start unaligned
    _save(tmp_path, state)
    chunks = _reader(tmp_path)
    for key in ("w", "b", "t"):
        want = state[key]
        got = chunks.read(key, (0,) * want.dim(), tuple(want.shape), want.dtype)
        assert torch.equal(got, want) and torch.equal(got, _dcp_load(tmp_path, key, want)), key
    w = chunks.read("w", (0, 0), (6, 10), torch.float32)
    t = chunks.read("t", (0, 0), (4, 10), torch.float32)
    assert not _maps_file(t, tmp_path)  # loaded
    start = (tmp_path / "__0_0.distcp").read_bytes().find(state["w"].numpy().tobytes())
    assert start >= 0 and (start % 4 == 0) == (odd_bytes == 0)  # the case this run means to cover
    assert _maps_file(w, tmp_path) == (odd_bytes == 0)  # in place when aligned, else one copy
    assert torch.equal(chunks.read("w", (2, 3), (3, 5), torch.float32), state["w"][2:5, 3:8])


def test_region_over_several_chunks(tmp_path):
    """Chunks as a TP=2 save leaves them: two halves of one key, read whole and across the seam."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    whole = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    halves = {0: whole[:4].clone(), 4: whole[4:].clone()}

    class Halves(DefaultSavePlanner):
        def create_local_plan(self):
            self.plan = SavePlan(
                [
                    WriteItem(
                        index=MetadataIndex("x", torch.Size((row, 0))),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(torch.Size((row, 0)), torch.Size((4, 6))),
                            properties=TensorProperties(dtype=torch.float32),
                            size=torch.Size((8, 6)),
                        ),
                    )
                    for row in halves
                ]
            )
            return self.plan

        def resolve_data(self, item):
            return halves[item.index.offset[0]]

    dcp.save(
        {},
        storage_writer=FileSystemWriter(str(tmp_path), single_file_per_rank=True, thread_count=1),
        planner=Halves(flatten_state_dict=False, flatten_sharded_tensors=False),
        no_dist=True,
    )
    chunks = _reader(tmp_path)
    assert torch.equal(chunks.read("x", (0, 0), (8, 6), torch.float32), whole)
    assert torch.equal(chunks.read("x", (3, 1), (3, 4), torch.float32), whole[3:6, 1:5])
    assert torch.equal(chunks.read("x", (4, 0), (4, 6), torch.float32), whole[4:])


def test_missing_or_truncated_data_file(tmp_path):
    _save(tmp_path, {"w": torch.randn(64, 64)})
    data = tmp_path / "__0_0.distcp"
    metadata = FileSystemReader(str(tmp_path)).read_metadata()
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"__0_0.distcp is truncated"):
        StoredChunks(tmp_path, metadata)
    data.unlink()
    with pytest.raises(ValueError, match=r"__0_0.distcp is missing"):
        StoredChunks(tmp_path, metadata)

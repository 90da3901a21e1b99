"""Colocated weight payloads (common/ipc.py): round trips through another process, files
removed when the block ends, and payloads that try anything but tensors refused."""

import base64
import os
import pickle
import subprocess
import sys

import pytest
import torch

from bapo_megatron.common import ipc

BUCKET = [
    ("a", torch.arange(6.0).reshape(2, 3)),
    ("empty", torch.zeros(0, 4)),
    ("b", torch.tensor([1.5, -2.0, 3.0], dtype=torch.bfloat16)),
]


def _receive(payload: str) -> list:
    code = (
        "import sys, torch; from bapo_megatron.common import ipc\n"
        "p = ipc.loads(sys.stdin.read())\n"
        "named = ipc.unflatten(p) if isinstance(p, dict) else p\n"
        "torch.save([(n, t.clone()) for n, t in named], sys.stdout.buffer)"
    )
    out = subprocess.run([sys.executable, "-c", code], input=payload.encode(), capture_output=True, check=True)
    import io

    return torch.load(io.BytesIO(out.stdout))


@pytest.mark.parametrize("flatten", [True, False])
def test_payload_round_trips_through_another_process_and_leaves_no_files(flatten):
    payload = ipc.flattened_bucket(BUCKET) if flatten else BUCKET
    with ipc.serialized(payload, copies=2) as (first, second):
        files = list(ipc._shm_dir().glob(f"bapo-{os.getpid()}-*"))
        assert len(files) == (1 if flatten else 2)  # written once for both copies; empty tensors need none
        for data in (first, second):
            got = _receive(data)
            assert [n for n, _ in got] == [n for n, _ in BUCKET]
            for (_, want), (_, t) in zip(BUCKET, got, strict=True):
                assert t.dtype == want.dtype and torch.equal(t, want)
    assert not any(f.exists() for f in files)


def test_flattened_bucket_rejects_unaligned_and_bad_metadata():
    with pytest.raises(ValueError, match="unaligned"):
        ipc.flattened_bucket([("h", torch.zeros(3, dtype=torch.bfloat16)), ("f", torch.zeros(2))])
    payload = ipc.flattened_bucket(BUCKET[:1])
    payload["metadata"][0].end_idx += 4
    with pytest.raises(ValueError, match="do not hold"):
        ipc.unflatten(payload)


class _Evil:
    def __reduce__(self):
        return os.system, ("true",)


def test_loads_refuses_code_and_foreign_files(tmp_path):
    evil = base64.b64encode(pickle.dumps([("w", _Evil())])).decode()
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        ipc.loads(evil)
    (tmp_path / "secret").write_bytes(b"\0" * 16)
    for path in (str(tmp_path / "secret"), "/etc/passwd", str(ipc._shm_dir() / "bapo-1-../../etc/passwd")):
        with pytest.raises(pickle.UnpicklingError, match="not a weight-payload file"):
            ipc.rebuild_shared(path, "float32", [4])


def test_a_link_in_the_shared_memory_directory_is_not_followed(tmp_path):
    import uuid

    (tmp_path / "secret").write_bytes(b"\1" * 16)
    link = ipc._shm_dir() / f"bapo-{os.getpid()}-{uuid.uuid4().hex}"  # a payload's name, pointing elsewhere
    link.symlink_to(tmp_path / "secret")
    try:
        with pytest.raises(pickle.UnpicklingError, match="cannot open it as a weight-payload file"):
            ipc.rebuild_shared(str(link), "float32", [4])
    finally:
        link.unlink()
    real = ipc._shm_dir() / f"bapo-{os.getpid()}-{uuid.uuid4().hex}"
    real.write_bytes(torch.arange(4.0).numpy().tobytes())
    try:
        tensor = ipc.rebuild_shared(str(real), "float32", [4])
        assert torch.equal(tensor, torch.arange(4.0))
        tensor += 1  # copy-on-write: the file keeps what the sender wrote
        assert real.read_bytes() == torch.arange(4.0).numpy().tobytes()
    finally:
        real.unlink()


def test_loads_refuses_a_payload_that_declares_more_than_it_holds_before_allocating_it():
    """A pickle's byte string is allocated at its declared length before it is read: 20 bytes that
    declare 10^12 of them were a MemoryError. Shapes other than lists of sizes >= 0 are refused too."""
    terabyte = b"\x80\x04\x8e" + (10**12).to_bytes(8, "little") + bytes(8)
    with pytest.raises(pickle.UnpicklingError, match="expected 1000000000000 bytes in a bytes8, but only 8 remain"):
        ipc.loads(base64.b64encode(terabyte).decode())
    with pytest.raises(pickle.UnpicklingError, match="not a whole pickle"):
        ipc.loads(base64.b64encode(pickle.dumps([1, 2])[:-1]).decode())
    for shape in ([-1, 0], [2.0], "ab", [True]):
        with pytest.raises(pickle.UnpicklingError, match="not a list of sizes >= 0"):
            ipc.rebuild_shared("", "float32", shape)
    assert ipc.loads(base64.b64encode(pickle.dumps([("w", 1.5)])).decode()) == [("w", 1.5)]


@pytest.mark.parametrize("payload", [8 << 20, True, 1.5, None, [1, 2], {"a": 1}])
def test_loads_refuses_a_payload_of_another_type_before_allocating_anything(payload):
    """A weight payload from a JSON body that is no string (probe G7): the integer 10^12 was
    bytes(10^12), a MemoryError that answered 500, and 2 x 10^8 allocated 200 MB before its 400.
    Refused for its type now, allocating nothing of the size it names."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(TypeError, match=f"a base64 string or bytes, not {type(payload).__name__}$"):
            ipc.loads(payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse it"

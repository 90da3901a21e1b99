"""The Arrow cache of a parquet file (data/records.py ArrowCache) as the disk leaves it: damaged,
truncated, emptied, another file's, or stale behind a file replaced with one of the same size and
time, each found on open and decoded again; a cache directory that cannot be used (a file, under a
file, read-only, full) is one ConfigError naming data.cache_dir and why, with nothing left behind."""

import collections
import errno
import os
import shutil
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bapo_megatron.data import arrow_cache, records
from bapo_megatron.errors import ConfigError

ROWS = [{"prompt": [i + 1, i + 2], "meta": {"k": i}} for i in range(10)]


@pytest.fixture(autouse=True)
def small_batches(monkeypatch):
    monkeypatch.setattr(arrow_cache, "CACHE_BATCH", 4)  # 10 rows: batches of 4, 4 and 2


def _parquet(path: Path, rows=ROWS) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3)
    return path


def _rows(path: Path, cache: Path) -> list[dict]:
    shard = records.ParquetShard(path, cache)
    return [shard.record(i) for i in range(len(shard))]


def _fresh(path: Path, cache: Path) -> list[dict]:
    """The rows, read with no warning: the cache opened as it is."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return _rows(path, cache)


def _batch_markers(data: bytes) -> list[int]:
    """Where the Arrow file's IPC messages start (their 0xFFFFFFFF continuation marker): the schema's,
    then one a batch (the rows hold no -1, so no marker hides in the data)."""
    found, at = [], data.find(b"\xff\xff\xff\xff")
    while at >= 0:
        found.append(at)
        at = data.find(b"\xff\xff\xff\xff", at + 4)
    return found


@pytest.mark.parametrize("damage", ["random", "truncated", "empty", "another-file"])
def test_a_damaged_or_foreign_cache_is_decoded_again(tmp_path, damage):
    path, cache = _parquet(tmp_path / "d.parquet"), tmp_path / "cache"
    assert _rows(path, cache) == ROWS
    (arrow,) = cache.glob("d-*.arrow")
    good = arrow.read_bytes()
    if damage == "random":
        arrow.write_bytes(os.urandom(len(good)))
    elif damage == "truncated":
        arrow.write_bytes(good[: len(good) // 2])
    elif damage == "empty":
        arrow.write_bytes(b"")
    else:  # the cache of another file's rows (as many) under this file's name
        other = _parquet(tmp_path / "other.parquet", [{**r, "prompt": [7, 7]} for r in ROWS])
        _rows(other, tmp_path / "other-cache")
        (made,) = (tmp_path / "other-cache").glob("*.arrow")
        shutil.copyfile(made, arrow)
    why = "was made from another file" if damage == "another-file" else "does not read as an Arrow file"
    with pytest.warns(UserWarning, match=rf"data.cache_dir: {arrow}, the Arrow cache of {path}, {why}"):
        assert _rows(path, cache) == ROWS
    assert _fresh(path, cache) == ROWS  # decoded again once: the next start trusts it
    assert [p.name for p in cache.iterdir()] == [arrow.name]  # nothing else left there


def test_a_batch_that_does_not_read_is_an_error_naming_the_cache_which_is_removed(tmp_path):
    """Damage inside a batch, past what the open checks (the footer, the key, the last batch): the
    draw that reads it is an error naming the record and the cache, and the next start decodes anew."""
    path, cache = _parquet(tmp_path / "d.parquet"), tmp_path / "cache"
    _rows(path, cache)
    (arrow,) = cache.glob("d-*.arrow")
    data = bytearray(arrow.read_bytes())
    _, first, second = _batch_markers(bytes(data))[:3]  # after the schema's
    data[first:second] = bytes(second - first)  # the first batch's message zeroed
    arrow.write_bytes(bytes(data))
    shard = records.ParquetShard(path, cache)
    assert shard.record(9) == ROWS[9]
    with pytest.raises(ValueError, match=rf"d.parquet record 2: its Arrow cache {arrow} is damaged \(batch 0: "):
        shard.record(1)
    assert not arrow.exists()
    assert _fresh(path, cache) == ROWS


def test_a_file_replaced_with_one_of_the_same_size_and_time_is_read_anew(tmp_path):
    """The cache is keyed by a hash of the parquet footer (schema, row groups, statistics) and the
    file's start, not only by its path, size and time."""
    path, cache = tmp_path / "d.parquet", tmp_path / "cache"
    pq.write_table(pa.table({"prompt": [[1, 2], [3, 4]]}), path)
    before = path.stat()
    assert _rows(path, cache) == [{"prompt": [1, 2]}, {"prompt": [3, 4]}]
    pq.write_table(pa.table({"prompt": [[5, 6], [7, 8]]}), path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert _fresh(path, cache) == [{"prompt": [5, 6]}, {"prompt": [7, 8]}]


def test_a_truncated_parquet_file_is_named(tmp_path):
    path = _parquet(tmp_path / "d.parquet")
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(ValueError, match=r"data.path: .*d.parquet: not a parquet file"):
        records.open_records(str(path), cache_dir=tmp_path / "cache")


def _no_space(monkeypatch, where: str) -> None:
    if where == "before":  # the decoded size is known from the footer: refused before writing
        usage = collections.namedtuple("usage", "total used free")
        monkeypatch.setattr(arrow_cache.shutil, "disk_usage", lambda _: usage(10**6, 10**6 - 100, 100))
        return
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    real = pa.OSFile  # the file being written: the device whose every write fails with ENOSPC
    monkeypatch.setattr(pa, "OSFile", lambda name, mode="r": real("/dev/full", mode) if mode == "wb" else real(name))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("a-file", r"data.cache_dir='.*/cache': a file, not a directory: parquet files are decoded there"),
        ("under-a-file", r"data.cache_dir='.*/cache/sub': cannot be made: .*/cache is a file"),
        ("read-only", r"data.cache_dir='.*/cache': cannot be written \(Permission denied\)"),
        ("full-before", r"data.cache_dir='.*/cache': 0 MiB free, .*d.parquet decodes to 0\+ MiB"),
        ("full-while", r"data.cache_dir='.*/cache': no space left to decode .*d.parquet \(.*No space left"),
    ],
)
def test_a_cache_dir_that_cannot_be_used_is_one_error_naming_it(tmp_path, monkeypatch, case, message):
    path, cache = _parquet(tmp_path / "d.parquet"), tmp_path / "cache"
    if case in ("a-file", "under-a-file"):
        cache.write_text("not a directory")
        cache = cache / "sub" if case == "under-a-file" else cache
    elif case == "read-only":  # as mkstemp fails there (root writes through a mode of 0o500)
        denied = PermissionError(errno.EACCES, "Permission denied")
        monkeypatch.setattr(arrow_cache, "temporary_sibling", lambda *a, **k: (_ for _ in ()).throw(denied))
    else:
        _no_space(monkeypatch, case.removeprefix("full-"))
    with pytest.raises(ConfigError, match=message) as caught:
        records.open_records(str(path), cache_dir=cache)
    assert "set data.cache_dir (or $BAPO_DATA_CACHE) to a directory this job can write" in str(caught.value)
    if cache.is_dir():
        assert list(cache.iterdir()) == []  # no temporary file left behind


def test_a_read_only_cache_dir_holding_the_cache_is_used(tmp_path, monkeypatch):
    path, cache = _parquet(tmp_path / "d.parquet"), tmp_path / "cache"
    _rows(path, cache)
    monkeypatch.setattr(arrow_cache, "temporary_sibling", lambda *a, **k: pytest.fail("nothing is written"))
    assert _fresh(path, cache) == ROWS

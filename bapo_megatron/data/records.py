"""Records of a data set, read where they lie: jsonl, JSON and parquet files, or shards of them.

`open_records(path, fmt, cache_dir)` takes a file, a directory (its files of the format, in name
order) or a glob pattern, and returns `Records`: len() and record(i) for any i, without reading
the whole set into Python objects.
- jsonl: the lines' byte ranges indexed by one scan in chunks (numpy, 16 bytes a record);
  record(i) reads and parses line i when it is drawn.
- parquet: decoded once into an uncompressed Arrow IPC file of 1,024-row batches under cache_dir
  (streamed a row group at a time, named by the file's path, size and modification time, so a
  second start reuses it); record(i) reads the batch that holds it. Parquet cannot be read at a
  row without decoding its pages, and a shuffled order touches every page; the Arrow file can.
  (Memory-mapping it instead made every random draw map about 2 MB of the file: the resident
  size grew by 2.8x the parquet file at 1M records.)
- json: a JSON array (or a jsonl file named .json), read whole: small files.

The format comes from the suffix when `fmt` is "auto". Field paths are dotted
(`reward_model.ground_truth`). Errors name the file and the record (line for jsonl).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from bapo_megatron.fsutil import json_record, publish, remove, temporary_sibling

SUFFIXES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
FORMATS = ("auto", *dict.fromkeys(SUFFIXES.values()))
SCAN_BYTES = 64 << 20
"""Bytes of a jsonl file scanned for line ends at a time."""


def data_files(path: str, fmt: str) -> list[tuple[Path, str]]:
    """(file, format) of every file `path` names: itself, a directory's files of the format (or
    of any one known suffix, when fmt is auto), or a glob pattern's matches; ValueError naming
    what is wrong."""
    if any(c in path for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(path) if Path(p).is_file())
        if not files:
            raise ValueError(f"data.path={path}: the pattern matches no file")
    elif Path(path).is_dir():
        files = sorted(p for p in Path(path).iterdir() if p.is_file() and p.suffix in SUFFIXES)
        if fmt != "auto":
            files = [p for p in files if SUFFIXES[p.suffix] == fmt or (fmt == "json" and p.suffix == ".jsonl")]
        if not files:
            raise ValueError(f"data.path={path}: a directory with no {fmt if fmt != 'auto' else ''} data files")
    elif Path(path).is_file():
        files = [Path(path)]
    else:
        raise ValueError(f"data.path={path}: no such file")
    out = []
    for file in files:
        kind = fmt if fmt != "auto" else SUFFIXES.get(file.suffix)
        if kind is None:
            raise ValueError(
                f"data.path: {file} has no known suffix ({', '.join(SUFFIXES)}): set data.format to one of "
                f"{', '.join(FORMATS[1:])}"
            )
        out.append((file, kind))
    kinds = {k for _, k in out}
    if len(kinds) > 1:
        raise ValueError(f"data.path={path}: shards of different formats ({', '.join(sorted(kinds))})")
    return out


class Shard:
    """One file's records."""

    path: Path

    def __len__(self) -> int:
        raise NotImplementedError

    def record(self, i: int) -> dict[str, Any]:
        raise NotImplementedError

    def where(self, i: int) -> str:
        return f"{self.path} record {i + 1}"


class JsonlShard(Shard):
    """A jsonl file and the byte range of each non-blank line, found by one scan in chunks (the
    file is never held whole: 16 bytes a record); record(i) reads its line with pread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        starts, ends, spaced = [np.zeros(1, np.int64)], [], []
        size, chunk = 0, bytearray(SCAN_BYTES)
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(chunk):
                view = np.frombuffer(chunk, dtype=np.uint8, count=n)
                newlines = np.flatnonzero(view == 10) + size
                # a line that starts with white space may be blank: looked at one by one below
                firsts = np.concatenate([starts[-1][-1:], newlines + 1]) - size
                inside = firsts[(firsts >= 0) & (firsts < n)]
                spaced.append(inside[np.isin(view[inside], (9, 13, 32))] + size)
                ends.append(newlines)
                starts.append(newlines + 1)
                size += n
        ends.append(np.array([size], np.int64))
        start, end = np.concatenate(starts), np.concatenate(ends)
        line = np.flatnonzero(end > start)  # 0-based numbers of the lines that hold bytes
        maybe = np.flatnonzero(np.isin(start, np.concatenate(spaced))) if spaced else np.zeros(0, np.int64)
        blank = [n for n in maybe.tolist() if end[n] > start[n] and not self._read(start[n], end[n]).strip()]
        self.line = np.setdiff1d(line, blank, assume_unique=True) if blank else line
        self.start, self.end = start[self.line], end[self.line]

    def _read(self, lo: int, hi: int) -> bytes:
        return os.pread(self._fd, int(hi - lo), int(lo))

    def __len__(self) -> int:
        return len(self.line)

    def record(self, i: int) -> dict[str, Any]:
        return json_record(self._read(self.start[i], self.end[i]), f"{self.path}:{self.line[i] + 1}")

    def where(self, i: int) -> str:
        return f"{self.path} record {i + 1} (line {self.line[i] + 1})"

    def __del__(self) -> None:
        with contextlib.suppress(AttributeError, OSError):
            os.close(self._fd)


class JsonShard(Shard):
    """A JSON file: an array of objects, or objects one a line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        text = path.read_text()
        if text.lstrip().startswith("["):
            try:
                records = json.loads(text)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: not JSON ({err.msg} at line {err.lineno})") from None
            bad = next((i for i, r in enumerate(records) if not isinstance(r, dict)), None)
            if bad is not None:
                raise ValueError(f"{path} record {bad + 1}: a record must be a JSON object")
            self.records = records
        else:
            from bapo_megatron.fsutil import read_jsonl

            self.records = read_jsonl(path)

    def __len__(self) -> int:
        return len(self.records)

    def record(self, i: int) -> dict[str, Any]:
        return self.records[i]


CACHE_BATCH = 1024
"""Rows a record batch of the Arrow cache holds (the last one fewer): record i is in batch i // CACHE_BATCH."""
CACHE_VERSION = "batches-1"


def arrow_cache(path: Path, cache_dir: Path) -> Path:
    """The Arrow IPC file holding parquet `path` decoded, in batches of CACHE_BATCH rows: made once
    (streamed a row group at a time, written under a temporary name and renamed into place), then
    reused while the parquet file keeps its path, size and modification time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    stat = path.stat()
    key = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{CACHE_VERSION}\0{CACHE_BATCH}"
    target = cache_dir / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:20]}.arrow"
    if target.is_file():
        return target
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{path}: not a parquet file ({err})") from None
    tmp = temporary_sibling(target, directory=False)
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, parquet.schema_arrow) as writer:
            carried = parquet.schema_arrow.empty_table()
            for group in range(parquet.num_row_groups):  # whole batches out, the rest carried on
                rows = pa.concat_tables([carried, parquet.read_row_group(group)]).combine_chunks()
                whole = rows.num_rows // CACHE_BATCH * CACHE_BATCH  # (one chunk: batches of exactly that many)
                if whole:
                    writer.write_table(rows.slice(0, whole), max_chunksize=CACHE_BATCH)
                carried = rows.slice(whole)
            if carried.num_rows:
                writer.write_table(carried, max_chunksize=CACHE_BATCH)
        publish(tmp, target)
    except pa.ArrowException as err:
        remove(tmp)
        raise ValueError(f"{path}: a row group does not decode ({err})") from None
    except BaseException:
        remove(tmp)
        raise
    return target


class ParquetShard(Shard):
    """A parquet file read through its Arrow cache: record i reads the one batch that holds it
    (positioned reads of about CACHE_BATCH rows; nothing mapped, so memory stays the batch's)."""

    def __init__(self, path: Path, cache_dir: Path) -> None:
        import pyarrow as pa

        self.path = path
        cache = arrow_cache(path, cache_dir)
        self.reader = pa.ipc.open_file(pa.OSFile(str(cache)))
        batches = self.reader.num_record_batches
        last = self.reader.get_batch(batches - 1).num_rows if batches else 0
        self.rows = (batches - 1) * CACHE_BATCH + last if batches else 0
        self._batch: tuple[int, Any] | None = None  # the last batch read (draws in file order reuse it)

    def __len__(self) -> int:
        return self.rows

    def record(self, i: int) -> dict[str, Any]:
        k = i // CACHE_BATCH
        cached = self._batch
        if cached is None or cached[0] != k:
            cached = self._batch = (k, self.reader.get_batch(k))
        return cached[1].slice(i % CACHE_BATCH, 1).to_pylist()[0]


class Records:
    """Shards end to end: record i of the whole set, and where it lies."""

    def __init__(self, shards: list[Shard]) -> None:
        self.shards = shards
        self.offsets = np.cumsum([0, *(len(s) for s in shards)])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _locate(self, i: int) -> tuple[Shard, int]:
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self.shards[k], i - int(self.offsets[k])

    def record(self, i: int) -> dict[str, Any]:
        shard, j = self._locate(i)
        return shard.record(j)

    def where(self, i: int) -> str:
        shard, j = self._locate(i)
        return shard.where(j)

    @property
    def name(self) -> str:
        return str(self.shards[0].path) if len(self.shards) == 1 else f"{len(self.shards)} shards"


def default_cache_dir() -> Path:
    """$BAPO_DATA_CACHE, else $XDG_CACHE_HOME/bapo-megatron/data, else ~/.cache/bapo-megatron/data."""
    if os.environ.get("BAPO_DATA_CACHE"):
        return Path(os.environ["BAPO_DATA_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "bapo-megatron" / "data"


def open_records(path: str, fmt: str = "auto", cache_dir: str | Path | None = None) -> Records:
    """The records `path` names (see the module's doc); ValueError naming what is wrong."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    shards: list[Shard] = []
    for file, kind in data_files(str(path), fmt):
        if kind == "jsonl":
            shards.append(JsonlShard(file))
        elif kind == "json":
            shards.append(JsonShard(file))
        else:
            shards.append(ParquetShard(file, cache))
    records = Records(shards)
    if not len(records):
        raise ValueError(f"data.path={path}: no records")
    return records

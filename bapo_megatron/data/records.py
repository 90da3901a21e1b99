"""Records of a data set, read where they lie: jsonl, JSON and parquet files, or shards of them.

`open_records(path, fmt, cache_dir, field)` takes a file, a directory (its files of the format, in
name order) or a glob pattern, and returns `Records`: len() and record(i) for any i, without
reading the whole set into Python objects.
- jsonl: the lines' byte ranges indexed by one scan in chunks (numpy, 16 bytes a record);
  record(i) reads and parses line i when it is drawn.
- parquet: decoded once into an uncompressed Arrow IPC file of 1,024-row batches under cache_dir
  (streamed a row group at a time) and reused by later starts while it matches the file: it is
  named by the file's path, size, modification time and a hash of its footer and first 64 KiB,
  and checked on every open (data/arrow_cache.py); record(i) reads the batch that holds it. Parquet
  cannot be read at a row without decoding its pages, and a shuffled order touches every page; the
  Arrow file can. (Memory-mapping it instead made every random draw map about 2 MB of the file:
  the resident size grew by 2.8x the parquet file at 1M records.) Without a usable cache_dir the
  data cannot be drawn from at random in bounded memory: ConfigError naming data.cache_dir.
- json: a JSON array (or a jsonl file named .json), read whole: small files.

`Records.first_of_each(field)` reads one field of every record cheaply (a parquet column, or
pyarrow's JSON parser over the jsonl lines, the field alone kept): the first record of each value.

The format comes from the suffix when `fmt` is "auto". Field paths are dotted
(`reward_model.ground_truth`). Errors name the config field (`field`), the file and the record
(line for jsonl).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from bapo_megatron.common.fields import MissingField, get_field
from bapo_megatron.data import arrow_cache
from bapo_megatron.errors import ConfigError
from bapo_megatron.fsutil import json_record

SUFFIXES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
FORMATS = ("auto", *dict.fromkeys(SUFFIXES.values()))
SCAN_BYTES = 64 << 20
"""Bytes of a jsonl file scanned for line ends at a time."""
FIELD_SCAN_BYTES = 4 << 20
"""Bytes of jsonl lines handed to pyarrow's JSON parser at a time by first_of_each."""


def data_files(path: str, fmt: str, field: str = "data.path") -> list[tuple[Path, str]]:
    """(file, format) of every file `path` names: itself, a directory's files of the format (or
    of any one known suffix, when fmt is auto), or a glob pattern's matches; ValueError naming
    `field` (the config key that gave the path) and what is wrong."""
    if any(c in path for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(path) if Path(p).is_file())
        if not files:
            raise ValueError(f"{field}={path}: the pattern matches no file")
    elif Path(path).is_dir():
        files = sorted(p for p in Path(path).iterdir() if p.is_file() and p.suffix in SUFFIXES)
        if fmt != "auto":
            files = [p for p in files if SUFFIXES[p.suffix] == fmt or (fmt == "json" and p.suffix == ".jsonl")]
        if not files:
            raise ValueError(f"{field}={path}: a directory with no {'' if fmt == 'auto' else fmt + ' '}data files")
    elif Path(path).is_file():
        files = [Path(path)]
    else:
        raise ValueError(f"{field}={path}: no such file")
    out = []
    for file in files:
        kind = fmt if fmt != "auto" else SUFFIXES.get(file.suffix)
        if kind is None:
            raise ValueError(
                f"{field}: {file} has no known suffix ({', '.join(SUFFIXES)}): set data.format to one of "
                f"{', '.join(FORMATS[1:])}"
            )
        out.append((file, kind))
    kinds = {k for _, k in out}
    if len(kinds) > 1:
        raise ValueError(f"{field}={path}: shards of different formats ({', '.join(sorted(kinds))})")
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

    def first_of_each(self, field: str) -> dict[str | None, int]:
        """str(value) of dotted `field` -> the first record holding it (None: absent or null). Here
        record by record; the shards override it with a read of the one field."""
        first: dict[str | None, int] = {}
        for i in range(len(self)):
            try:
                value = get_field(self.record(i), field)
            except MissingField:
                value = None
            first.setdefault(None if value is None else str(value), i)
        return first


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

    def first_of_each(self, field: str) -> dict[str | None, int]:
        """pyarrow's JSON parser over FIELD_SCAN_BYTES of lines at a time, keeping the field alone (as
        text); record by record where it cannot tell every value apart (a value that is not text, a
        line it does not parse, a top-level key holding the whole dotted name)."""
        import pyarrow as pa
        import pyarrow.json as pj

        parts = field.split(".")
        nested = pa.string()
        for part in reversed(parts[1:]):
            nested = pa.struct([(part, nested)])
        columns = [(parts[0], nested)] + ([(field, pa.string())] if len(parts) > 1 else [])
        options = pj.ParseOptions(explicit_schema=pa.schema(columns), unexpected_field_behavior="ignore")
        first: dict[str | None, int] = {}
        lo = 0
        while lo < len(self):
            hi = max(int(np.searchsorted(self.start, self.start[lo] + FIELD_SCAN_BYTES)), lo + 1)
            text = self._read(self.start[lo], self.end[hi - 1])
            try:
                table = pj.read_json(pa.py_buffer(text), parse_options=options)
            except pa.ArrowException:
                return super().first_of_each(field)
            if table.num_rows != hi - lo or (len(parts) > 1 and table.column(field).null_count < table.num_rows):
                return super().first_of_each(field)
            table = table.select([0])
            while field not in table.column_names:
                table = table.flatten()
            _first_of_each(table.column(field), lo, first)
            lo = hi
        return first

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


class ParquetShard(Shard):
    """A parquet file read through its Arrow cache: record i reads the one batch that holds it
    (positioned reads of about arrow_cache.CACHE_BATCH rows; nothing mapped, so memory stays the batch's). A
    batch that does not read is an error naming the cache, which is removed so that the next start
    decodes the file again."""

    def __init__(self, path: Path, cache_dir: Path) -> None:
        self.path = path
        self.cache = arrow_cache.ArrowCache(path, cache_dir)
        self.rows = self.cache.rows
        self._batch: tuple[int, Any] | None = None  # the last batch read (draws in file order reuse it)

    def __len__(self) -> int:
        return self.rows

    def record(self, i: int) -> dict[str, Any]:
        k = i // arrow_cache.CACHE_BATCH
        cached = self._batch
        if cached is None or cached[0] != k:
            cached = self._batch = (k, self._read_batch(k, i))
        return cached[1].slice(i % arrow_cache.CACHE_BATCH, 1).to_pylist()[0]

    def _read_batch(self, k: int, i: int):
        import pyarrow as pa

        want = min(arrow_cache.CACHE_BATCH, self.rows - k * arrow_cache.CACHE_BATCH)
        try:
            batch = self.cache.reader.get_batch(k)
            batch.validate()
            problem = None if batch.num_rows == want else f"{batch.num_rows} rows, not {want}"
        except (pa.ArrowException, OSError) as err:
            problem = str(err)
        if problem is None:
            return batch
        with contextlib.suppress(OSError):
            self.cache.file.unlink()
        raise ValueError(
            f"{self.where(i)}: its Arrow cache {self.cache.file} is damaged (batch {k}: {problem}); "
            "removed, the next start decodes the file again"
        )

    def first_of_each(self, field: str) -> dict[str | None, int]:
        """One read of the field's column (its top-level column, struct children flattened)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(self.path)
        names = parquet.schema_arrow.names
        top = field if field in names else field.split(".")[0]
        if top not in names:
            return {None: 0}  # a parquet file's records share one schema: none has it
        table = parquet.read(columns=[top], use_threads=False)
        while field not in table.column_names and any(pa.types.is_struct(t) for t in table.schema.types):
            table = table.flatten()
        if field not in table.column_names:
            return {None: 0}
        return _first_of_each(table.column(field))


def _first_of_each(column, offset: int = 0, first: dict | None = None) -> dict[str | None, int]:
    """str(value) -> the index of its first record (None for a null), for an Arrow column's values
    (from `offset`), added to `first`: deduplicated in Arrow (a dictionary and the first row of each
    entry), not as a million Python objects; values it cannot encode (objects, lists) one by one."""
    import pyarrow as pa
    import pyarrow.compute as pc

    first = {} if first is None else first
    try:
        encoded = pc.dictionary_encode(column.combine_chunks(), null_encoding="encode")
    except pa.ArrowNotImplementedError:
        for i, value in enumerate(column.to_pylist(), offset):
            first.setdefault(None if value is None else str(value), i)
        return first
    entries, rows = np.unique(encoded.indices.to_numpy(zero_copy_only=False), return_index=True)
    values = encoded.dictionary.to_pylist()
    for entry, row in sorted(zip(entries.tolist(), rows.tolist(), strict=True), key=lambda pair: pair[1]):
        first.setdefault(None if values[entry] is None else str(values[entry]), offset + row)
    return first


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

    def first_of_each(self, field: str) -> dict[str | None, int]:
        """str(value) of dotted `field` -> the first record (of the whole set) holding it, None for
        absent or null: every record's value, read without reading the records whole."""
        first: dict[str | None, int] = {}
        for shard, offset in zip(self.shards, self.offsets[:-1].tolist(), strict=True):
            for value, i in shard.first_of_each(field).items():
                first.setdefault(value, offset + i)
        return first

    @property
    def name(self) -> str:
        return str(self.shards[0].path) if len(self.shards) == 1 else f"{len(self.shards)} shards"


def default_cache_dir() -> Path:
    """$BAPO_DATA_CACHE, else $XDG_CACHE_HOME/bapo-megatron/data, else ~/.cache/bapo-megatron/data."""
    if os.environ.get("BAPO_DATA_CACHE"):
        return Path(os.environ["BAPO_DATA_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "bapo-megatron" / "data"


def open_records(
    path: str, fmt: str = "auto", cache_dir: str | Path | None = None, field: str = "data.path"
) -> Records:
    """The records `path` names (see the module's doc); ValueError naming `field` (the config key
    that gave the path) and what is wrong; ConfigError naming data.cache_dir when parquet files
    cannot be decoded there."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    shards: list[Shard] = []
    for file, kind in data_files(str(path), fmt, field):
        try:
            if kind == "jsonl":
                shards.append(JsonlShard(file))
            elif kind == "json":
                shards.append(JsonShard(file))
            else:
                shards.append(ParquetShard(file, cache))
        except ConfigError:
            raise
        except ValueError as err:
            raise ValueError(f"{field}: {err}") from None
    records = Records(shards)
    if not len(records):
        raise ValueError(f"{field}={path}: no records")
    return records

"""A parquet file decoded once into an Arrow IPC file of fixed-size record batches, kept under
data.cache_dir and trusted only while it matches its source (path, size, time and a hash of the
footer and first bytes, checked on every open); damaged or stale, it is decoded again."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

from bapo_megatron.errors import ConfigError
from bapo_megatron.fsutil import publish, remove, temporary_sibling

CACHE_BATCH = 1024
"""Rows a record batch of the Arrow cache holds (the last one fewer): record i is in batch i // CACHE_BATCH."""
CACHE_VERSION = "batches-2"
CACHE_KEY = b"bapo_megatron.source"
"""The Arrow file footer's entry naming what the cache was made from (ArrowCache.key)."""
HEAD_BYTES = 64 << 10
"""Bytes of a parquet file's start hashed with its footer (`parquet_fingerprint`)."""
MIB = 1 << 20


def parquet_fingerprint(path: Path) -> str:
    """sha256 of a parquet file's footer (its FileMetaData: schema, row groups with their offsets,
    sizes and statistics) and its first HEAD_BYTES: what tells one file's rows from another's of the
    same size and time, read in two small reads. ValueError when the file does not end as parquet does."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(size - 8, 0))
        tail = f.read(8)
        length = int.from_bytes(tail[:4], "little")
        if size < 12 or tail[4:] != b"PAR1" or length > size - 12:
            raise ValueError(f"{path}: not a parquet file (no parquet footer at its end)")
        f.seek(size - 8 - length)
        footer = f.read(length)
        f.seek(0)
        head = f.read(min(HEAD_BYTES, size - 8 - length))
    return hashlib.sha256(head + footer + tail).hexdigest()


def cache_unusable(cache_dir: Path, why: str) -> ConfigError:
    return ConfigError(
        "data.cache_dir",
        str(cache_dir),
        f"{why}: parquet files are decoded there once (they cannot be drawn from at random without it); "
        "set data.cache_dir (or $BAPO_DATA_CACHE) to a directory this job can write",
    )


def make_cache_dir(cache_dir: Path) -> None:
    """cache_dir made if absent; ConfigError naming data.cache_dir when it cannot be."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise cache_unusable(cache_dir, "a file, not a directory") from None
    except NotADirectoryError:
        blocking = next((p for p in cache_dir.parents if p.exists() and not p.is_dir()), cache_dir.parent)
        raise cache_unusable(cache_dir, f"cannot be made: {blocking} is a file") from None
    except OSError as err:
        raise cache_unusable(cache_dir, f"cannot be made ({err.strerror})") from None


class ArrowCache:
    """Parquet `path` decoded into an Arrow IPC file of CACHE_BATCH-row batches under cache_dir,
    named by the file's path, size, modification time and `parquet_fingerprint`, which its footer
    also holds. Checked on every open: it must open, hold that key, and have the parquet file's row
    count in whole batches; one that does not (damaged, truncated, another file's) is decoded again,
    with a warning naming it. `reader` reads it; `rows` is the parquet file's row count."""

    def __init__(self, path: Path, cache_dir: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        stat, fingerprint = path.stat(), parquet_fingerprint(path)
        try:
            parquet = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as err:
            raise ValueError(f"{path}: not a parquet file ({err})") from None
        self.path, self.rows = path, parquet.metadata.num_rows
        key = [str(path.resolve()), stat.st_size, stat.st_mtime_ns, fingerprint, CACHE_VERSION, CACHE_BATCH, self.rows]
        self.key = json.dumps(key).encode()
        self.file = cache_dir / f"{path.stem}-{hashlib.sha256(self.key).hexdigest()[:20]}.arrow"
        self.reader, problem = self._open() if self.file.exists() else (None, None)
        if self.reader is None:
            if problem is not None:
                why = f"data.cache_dir: {self.file}, the Arrow cache of {path}, {problem}: decoding it again"
                warnings.warn(why, stacklevel=2)
            self._decode(parquet)
            self.reader, problem = self._open()
            if self.reader is None:
                raise ValueError(f"{self.file}: the Arrow cache just written for {path} {problem}")

    def _open(self):
        """(reader, None) for a cache that holds what the key says, else (None, what is wrong)."""
        import pyarrow as pa

        try:
            reader = pa.ipc.open_file(pa.OSFile(str(self.file)))
            batches, want = reader.num_record_batches, -(-self.rows // CACHE_BATCH)
            if (reader.metadata or {}).get(CACHE_KEY) != self.key:
                return None, "was made from another file or version"
            if batches != want:
                return None, f"has {batches} batches, not the {want} of {self.rows} rows"
            last = reader.get_batch(batches - 1).num_rows if batches else 0
            if batches and last != self.rows - (batches - 1) * CACHE_BATCH:
                return None, f"ends in a batch of {last} rows"
        except (pa.ArrowException, OSError) as err:
            return None, f"does not read as an Arrow file ({err})"
        return reader, None

    def _decode(self, parquet) -> None:
        """Streamed a row group at a time (whole batches out, the rest carried on) into a temporary
        file renamed into place; ConfigError naming data.cache_dir when it cannot be written."""
        import pyarrow as pa

        cache_dir = self.file.parent
        make_cache_dir(cache_dir)
        need = sum(parquet.metadata.row_group(g).total_byte_size for g in range(parquet.num_row_groups))
        free = shutil.disk_usage(cache_dir).free
        if need > free:
            raise cache_unusable(cache_dir, f"{free / MIB:.0f} MiB free, {self.path} decodes to {need / MIB:.0f}+ MiB")
        try:
            tmp = temporary_sibling(self.file, directory=False)
        except OSError as err:
            raise cache_unusable(cache_dir, f"cannot be written ({err.strerror})") from None
        schema = parquet.schema_arrow
        try:
            with (
                pa.OSFile(str(tmp), "wb") as sink,
                pa.ipc.new_file(sink, schema, metadata={CACHE_KEY: self.key}) as out,
            ):
                carried = schema.empty_table()
                for group in range(parquet.num_row_groups):
                    rows = pa.concat_tables([carried, parquet.read_row_group(group)]).combine_chunks()
                    whole = rows.num_rows // CACHE_BATCH * CACHE_BATCH  # (one chunk: batches of exactly that many)
                    if whole:
                        out.write_table(rows.slice(0, whole), max_chunksize=CACHE_BATCH)
                    carried = rows.slice(whole)
                if carried.num_rows:
                    out.write_table(carried, max_chunksize=CACHE_BATCH)
            publish(tmp, self.file)
        except (pa.ArrowException, OSError) as err:
            remove(tmp)
            if getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
                raise cache_unusable(cache_dir, f"no space left to decode {self.path} ({err})") from None
            if getattr(err, "errno", None) in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise cache_unusable(cache_dir, f"cannot be written ({err})") from None
            raise ValueError(f"{self.path}: a row group does not decode ({err})") from None
        except BaseException:
            remove(tmp)
            raise

"""Durable, atomic file and directory writes: a fresh temporary sibling, fsync'd, renamed into place;
and the one jsonl reader (read_jsonl).

A temporary name is always new (never a fixed OUT.tmp that may be a user's file), lives beside
the target (same filesystem, so the rename is atomic), and is removed when the write fails.
After the rename the parent directory is fsync'd, so the new entry survives a power loss.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def temporary_sibling(path: Path, directory: bool) -> Path:
    """A new, unused name beside `path` (created empty: a directory, or a file), with the
    permissions a plain mkdir or open would give (tempfile's own are owner-only)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix, suffix = f".{path.name}.", ".tmp"
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=path.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=path.parent)
        os.close(fd)
        tmp = Path(name)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, (0o777 if directory else 0o666) & ~umask)
    return tmp


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename into it, the files in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, target: Path) -> None:
    """Rename a finished temporary into place, then fsync what the rename touched."""
    if tmp.is_dir():
        fsync_dir(tmp)
    os.replace(tmp, target)
    fsync_dir(target.parent)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def atomic_directory(out: str | Path) -> Iterator[Path]:
    """Write into a fresh temporary directory beside OUT; renamed to OUT only when the block
    completes (never a half-written OUT); FileExistsError if OUT exists."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists already; refusing to overwrite it")
    tmp = temporary_sibling(out, directory=True)
    try:
        yield tmp
    except BaseException:
        remove(tmp)
        raise
    publish(tmp, out)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace a small file's content atomically and durably."""
    tmp = temporary_sibling(path, directory=False)
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path)
    except BaseException:
        remove(tmp)
        raise


def json_record(line: str | bytes, where: str) -> dict:
    """One line of a jsonl file as its object; ValueError naming `where` (file:line) when it is not
    JSON or not an object."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{where}: not JSON ({getattr(err, 'msg', err)})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object")
    return record


def read_jsonl(path: Path, problem: Callable[[dict], str | None] | None = None) -> list[dict]:
    """The JSON objects of a jsonl file, one a line (blank lines skipped); ValueError naming the
    first line that is not JSON, not an object, or (with `problem`) whose record it finds wanting."""
    records = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json_record(line, f"{path}:{n}")
        wrong = problem(record) if problem is not None else None
        if wrong:
            raise ValueError(f"{path}:{n}: {wrong}")
        records.append(record)
    return records

"""A dist checkpoint's files: checksums written with it, and a check before anything loads it.

Every file of a checkpoint this project writes is listed in its `checksums.json` (CRC-32 and
size, computed by the rank that wrote it right after the write, gathered by rank 0). Before a
load, `verify_integrity` checks that the files the metadata refers to are there and long enough, and,
where the checkpoint lists checksums, that every file still matches: a truncated, corrupted or
missing file is named instead of loaded (or of failing deep inside torch). Checkpoints written
before checksums existed (or by other tools) get the presence and size checks only. A name in
`.metadata` or `checksums.json` that leads outside the checkpoint is refused before anything is
read (errors.inside).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

from bapo_megatron.errors import BadInputError, inside
from bapo_megatron.trainer.safe_load import METADATA_FILE, read_metadata

CHECKSUMS = "checksums.json"
REQUIRED = ("metadata.json", ".metadata", "common.pt")
_BLOCK = 16 << 20


class CorruptCheckpointError(BadInputError):
    """A checkpoint's files are missing, short, or differ from what was written."""


def file_checksum(path: Path) -> dict[str, int]:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return {"crc32": crc, "size": size}


def checksums(directory: Path, names: list[str]) -> dict[str, dict[str, int]]:
    return {name: file_checksum(directory / name) for name in names}


def write_checksums(directory: Path, entries: dict[str, dict[str, int]]) -> None:
    (directory / CHECKSUMS).write_text(json.dumps(dict(sorted(entries.items())), indent=1) + "\n")


def check_storage(directory: Path, metadata) -> None:
    """Every file the metadata stores data in is there and reaches the end of its last item."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        path = inside(directory, name, directory / METADATA_FILE)
        if not path.is_file():
            raise CorruptCheckpointError(f"checkpoint {directory}: {name} is missing")
        if path.stat().st_size < end:
            raise CorruptCheckpointError(
                f"checkpoint {directory}: {name} is truncated ({path.stat().st_size} bytes, its metadata needs {end})"
            )


def verify_integrity(directory: str | Path, check_contents: bool = True, files: list[str] | None = None):
    """The checkpoint's metadata (read without running code), once its files are checked;
    CorruptCheckpointError naming the first problem. `files`: verify only these checksummed
    files' contents (the others' presence and size are still checked)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CorruptCheckpointError(f"checkpoint {directory}: no such directory")
    for name in REQUIRED:
        if not (directory / name).is_file():
            raise CorruptCheckpointError(f"checkpoint {directory}: {name} is missing (an incomplete checkpoint?)")
    metadata = read_metadata(directory)
    check_storage(directory, metadata)
    listed = directory / CHECKSUMS
    if not check_contents or not listed.is_file():
        return metadata
    entries = read_checksums(listed)
    paths = {name: inside(directory, name, listed) for name in entries}  # every name, before any is read
    for name, want in sorted(entries.items()):
        path = paths[name]
        if not path.is_file():
            raise CorruptCheckpointError(f"checkpoint {directory}: {name} is missing")
        if path.stat().st_size != want["size"]:
            raise CorruptCheckpointError(
                f"checkpoint {directory}: {name} has {path.stat().st_size} bytes, {want['size']} were written"
            )
        if (files is None or name in files) and file_checksum(path)["crc32"] != want["crc32"]:
            raise CorruptCheckpointError(f"checkpoint {directory}: {name} differs from what was written (checksum)")
    return metadata


def read_checksums(listed: Path) -> dict[str, dict[str, int]]:
    """A checksums.json: {file name: {"crc32": int, "size": int}}; CorruptCheckpointError otherwise."""
    try:
        entries = json.loads(listed.read_text())
    except ValueError as err:
        raise CorruptCheckpointError(f"{listed}: not valid JSON ({err})") from None
    fields = {"crc32", "size"}
    if not isinstance(entries, dict) or not all(
        isinstance(want, dict) and fields <= want.keys() and all(isinstance(want[k], int) for k in fields)
        for want in entries.values()
    ):
        raise CorruptCheckpointError(f'{listed}: not a mapping of file names to {{"crc32": int, "size": int}}')
    return entries


def listed_files(directory: str | Path) -> list[str]:
    """The files a checkpoint's checksums list (empty for one written without them, or with a broken
    list: verify_integrity names its problem)."""
    listed = Path(directory) / CHECKSUMS
    try:
        return sorted(read_checksums(listed)) if listed.is_file() else []
    except CorruptCheckpointError:
        return []

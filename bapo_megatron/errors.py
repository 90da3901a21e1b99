"""Errors a user can cause, each naming the offending field or value, and the checks that raise them."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

UNKNOWN_KEY = object()
"""The `value` of a ConfigError about a key that no section defines."""


class ConfigError(ValueError):
    """A configuration value that cannot work; `field` is its dotted name."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        if value is UNKNOWN_KEY:
            super().__init__(f"{field}: unknown key; {reason}")
        else:
            super().__init__(f"{field}={value!r}: {reason}")

    def within(self, prefix: str) -> ConfigError:
        """The same error with its field named from an enclosing section."""
        return ConfigError(f"{prefix}.{self.field}" if prefix else self.field, self.value, self.reason)


class BadInputError(ValueError):
    """A file the user handed us that cannot be used (a checkpoint, a batch): the message names
    the file and what is wrong with it; entry points report it as one `error:` line."""


class OutsideDirectoryError(BadInputError):
    """A file of a checkpoint, a model directory or a cache names a path outside its own directory
    (absolute, through `..`, or a symbolic link leading out): refused before anything there is read."""


def inside(root: str | Path, name: object, source: str | Path, links_within: str | Path | None = None) -> Path:
    """root / name, for a file name that `source` (a file of root: a checkpoint's metadata, a model's
    index) gives; OutsideDirectoryError naming `source` and `name` unless it is a relative name without
    `..` whose path, symbolic links followed, stays under `links_within` (default: root; a cache whose
    entries link to blobs beside them passes the entry).

    Here rather than in fsutil: the error is a BadInputError, and the two modules import nothing of each other."""
    root = Path(root)
    if not isinstance(name, str) or not name or "\0" in name:
        raise OutsideDirectoryError(f"{source}: {name!r} is not a file name; refusing to read it")
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts:
        raise OutsideDirectoryError(f"{source}: {name!r} names a path outside {root}; refusing to read it")
    path = root / pure
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError):  # a loop of links (RuntimeError before Python 3.13)
        resolved = None
    if resolved is None or not resolved.is_relative_to(Path(links_within or root).resolve()):
        raise OutsideDirectoryError(f"{source}: {name!r} leads outside {root} (a symbolic link); refusing to read it")
    return path


class RunStopped(RuntimeError):
    """The run stopped itself rather than train on something wrong (engines not serving the trainer's
    weights, a sample the engines keep failing): entry points report it as one `error:` line, exit 1."""


class NonFiniteInputError(ValueError):
    """Non-finite values where a finite number is required (a step to skip, not a config bug)."""


def check(ok: bool, field: str, value: object, reason: str) -> None:
    """Raise ConfigError(field, value, reason) unless `ok`."""
    if not ok:
        raise ConfigError(field, value, reason)


class DiskFull(OSError, RunStopped):
    """No space left for what a run or a tool must write (ENOSPC), said before anything partial is
    kept: a run stops with it (exit 1, as RunStopped), a tool reports it (as any OSError)."""

    def __init__(self, message: str) -> None:
        import errno

        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return str(self.strerror)

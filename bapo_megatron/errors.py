"""Errors a user can cause, each naming the offending field or value."""

from __future__ import annotations

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

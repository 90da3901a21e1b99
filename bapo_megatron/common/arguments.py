"""Argument types the package's command lines share (argparse `type=` callables)."""

from __future__ import annotations

import argparse


def at_least_one(text: str) -> int:
    """A whole number of at least 1 (a count, a parallel size); argparse names the flag with the error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1")
    return value

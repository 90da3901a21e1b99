"""Upstream warnings that are known and harmless here, kept off the console and in the run's log.

On the CPU default every run would print about 30 lines before its first step: Megatron saying
Transformer Engine and Apex are missing (and falling back, as intended on a CPU), its own
deprecations, torch's distributed-checkpoint deprecations met through Megatron, transformers'
past_key_values notice; under torchrun, on every rank, Megatron's advice to set
CUDA_DEVICE_MAX_CONNECTIONS, torch's deprecation of the collectives its sequence parallelism
calls, and its note that a rank's common checkpoint state differs from rank 0's (the driver's
state is rank 0's alone, and rank 0's is what is saved). `hold_known_warnings()` (called first
thing by bapo-train, the demo and evaluate) keeps the warnings that match KNOWN, and the log
records that match KNOWN_LOGS, off stderr and holds them; `flush(run_dir, rank)` appends them to
run_dir/warnings.log once the run has a directory, each line tagged with its rank when one is
given (every rank appends to the same file). Every other warning shows as before, this package's
own as one `warning: ...` line. The fallbacks are harmless only without a GPU: with CUDA,
Transformer Engine's absence is shown.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from pathlib import Path

KNOWN: list[tuple[type[Warning], str, bool]] = [
    # (category, message pattern, only without CUDA)
    (UserWarning, r"Transformer Engine and Apex are not installed", True),
    (UserWarning, r"Apex is not installed\. Falling back to Torch Norm", True),
    (UserWarning, r"full scope is deprecated\. Use empty cuda_graph_scope", False),
    (FutureWarning, r"`load_state_dict` is deprecated and will be removed", False),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor", False),
    (Warning, r"past_key_values", False),
    (UserWarning, r"CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup", True),
    # torch's deprecations of the collectives Megatron's sequence parallelism calls (this package calls neither)
    (FutureWarning, r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated", False),
]
KNOWN_LOGS: list[tuple[str, str, bool]] = [
    # (logger, message pattern, only without CUDA): notices sent through logging, not warnings
    ("transformers.utils.generic", r"past_key_values", False),
    ("megatron.core.dist_checkpointing.validation", r"common state dict differs from rank 0", False),
]
_held: list[str] = []
_installed = False


def known(message: Warning | str, category: type[Warning], cuda: bool) -> bool:
    text = str(message)
    return any(
        issubclass(category, kind) and re.search(pattern, text) and not (cpu_only and cuda)
        for kind, pattern, cpu_only in KNOWN
    )


def hold_known_warnings(cuda: bool | None = None) -> None:
    """Hold known warnings instead of printing them (once per process; cuda: whether this process
    has CUDA, found with torch when None)."""
    global _installed
    if _installed:
        return
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if known(message, category, cuda):
            _held.append(warnings.formatwarning(message, category, filename, lineno, line).rstrip())
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    warnings.formatwarning = _formatter(warnings.formatwarning)
    for name, pattern, cpu_only in KNOWN_LOGS:
        if not (cpu_only and cuda):
            logging.getLogger(name).addFilter(_LogHolder(pattern))
    _installed = True


PACKAGE = str(Path(__file__).resolve().parents[1])


def _formatter(upstream):
    """This package's own warnings as one `warning: ...` line (they are addressed to the user, who
    has no use for the file and line that raised them); everyone else's as Python formats them."""

    def format_warning(message, category, filename, lineno, line=None):
        if str(filename).startswith(PACKAGE):
            return f"warning: {message}\n"
        return upstream(message, category, filename, lineno, line)

    return format_warning


class _LogHolder(logging.Filter):
    """Holds a logger's records that match `pattern` instead of letting its handlers print them."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not self.pattern.search(message):
            return True
        _held.append(f"{record.name}: {record.levelname}: {message}")
        return False


def flush(run_dir: str | Path | None, rank: int | None = None) -> int:
    """Append the warnings held so far to run_dir/warnings.log, each line tagged `[rank N]` when
    `rank` is given; how many. None: nowhere to keep them, dropped. A run directory that does not
    exist yet (another rank makes it) keeps them held for the next flush: 0."""
    count = len(_held)
    if not count or run_dir is None:
        _held.clear()
        return count
    path = Path(run_dir) / "warnings.log"
    if not path.parent.is_dir():
        return 0
    tag = "" if rank is None else f"[rank {rank}] "
    text = "".join(f"{tag}{line}\n" for entry in _held for line in entry.splitlines())
    # one write with O_APPEND: the ranks' appends to the one file do not interleave
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    _held.clear()
    return count

"""Upstream warnings that are known and harmless here, kept off the console and in the run's log.

On the CPU default every run would print about 30 lines before its first step: Megatron saying
Transformer Engine and Apex are missing (and falling back, as intended on a CPU), its own
deprecations, torch's distributed-checkpoint deprecations met through Megatron, transformers'
past_key_values notice. `install()` (called first thing by bapo-train and the demo) keeps the
warnings that match KNOWN off stderr and holds them; `flush(run_dir)` appends them to
run_dir/warnings.log once the run has a directory. Every other warning shows as before. The
fallbacks are harmless only without a GPU: with CUDA, Transformer Engine's absence is shown.
"""

from __future__ import annotations

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
]
_held: list[str] = []
_installed = False


def known(message: Warning | str, category: type[Warning], cuda: bool) -> bool:
    text = str(message)
    return any(
        issubclass(category, kind) and re.search(pattern, text) and not (cpu_only and cuda)
        for kind, pattern, cpu_only in KNOWN
    )


def install(cuda: bool | None = None) -> None:
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
    _installed = True


def flush(run_dir: str | Path | None) -> int:
    """Append the warnings held so far to run_dir/warnings.log (None: a rank that writes no log:
    dropped); how many."""
    count = len(_held)
    if not count or run_dir is None:
        _held.clear()
        return count
    with (Path(run_dir) / "warnings.log").open("a") as log:
        log.write("\n".join(_held) + "\n")
    _held.clear()
    return count

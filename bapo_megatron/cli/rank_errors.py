"""A user's mistake that every rank of a job makes, said once a node rather than once a rank.

Under torchrun or srun every rank reads the same config and files before the ranks join a process
group, so a config error or an unusable file is found by all of them at once: eight identical
`error:` lines a node, then torchrun's summary of eight failures. Here each node's first rank says
it and the others exit with the same code, quietly. Each node's, not only rank 0's: a file or a
package one node lacks is found there alone. Once the ranks have joined, an error may be one rank's
own: every rank says its own.
"""

from __future__ import annotations

import os
import sys
import time
from typing import NoReturn

QUIET_RANK_WAIT_S = 10.0
"""How long a quiet rank waits before it exits. torchrun stops every rank of the node once one exits
non-zero: a quiet rank that exited first could have the node's first rank stopped before it said
the error. The first rank exiting ends the wait (torchrun stops the rest); srun lets it run out."""


def exit_once(err: Exception, code: int) -> NoReturn:
    """Say `error: err` on stderr where it is to be read (says_it) and exit with `code`."""
    if says_it():
        print(f"error: {err}", file=sys.stderr, flush=True)
    else:
        time.sleep(QUIET_RANK_WAIT_S)
    raise SystemExit(code)


def says_it() -> bool:
    """Whether this process reports an error every rank makes: the only process, each node's first
    rank (torchrun's LOCAL_RANK, srun's SLURM_LOCALID), or any rank once a process group is up."""
    dist = sys.modules.get("torch.distributed")  # not imported: no group is up
    if dist is not None and dist.is_available() and dist.is_initialized():
        return True
    ranks = os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_STEP_NUM_TASKS") or "1"
    local = os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or "0"
    return int(ranks) == 1 or int(local) == 0

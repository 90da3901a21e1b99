"""What rank 0 of an online run hands every rank while a step's batch is made: one of four messages.

The driver answers each call for the next batch with Ready, Refit or GiveUp; rank 0 broadcasts
that answer (or Stop, when the driver stopped the run) and every rank, itself included, acts on
the same value (sources.OnlineFollower.next_batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bapo_megatron.common.batch import RolloutBatch


@dataclass(frozen=True)
class Ready:
    """The step's batch; `metrics` are rank 0's figures of its rollout (the other ranks get none)."""

    batch: RolloutBatch
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Refit:
    """No engine serves and one waits for the weights (back after a death): every rank helps send
    them, then asks again; the step's rollout goes on where it was."""


@dataclass(frozen=True)
class GiveUp:
    """A stop signal came before the batch was complete: the step is given up on every rank."""


@dataclass(frozen=True)
class Stop:
    """Rank 0 stopped the run (a reward that does not work, engines that cannot come back)."""

    reason: str


Handoff = Ready | Refit | GiveUp | Stop

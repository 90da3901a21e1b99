"""Groups whose rewards are all equal: set aside and generated again (rollout.filter_groups), or warned about.

A group whose rewards are all equal has every group-relative advantage exactly 0
(algo/advantages.py): it trains nothing, yet fills a place in the batch. With a random model and a
pass/fail reward that is every group, and the step trains on nothing.

`KeepAll` (the filter off) trains every complete group. `DropEqualRewards` (DAPO's dynamic
sampling; verl's algorithm.filter_groups, slime's dynamic sampling filter) sets such a group aside
as it completes (the buffer holds it: checkpoints carry it) and the strategy generates another
prompt in its place, until the step has prompts_per_step groups whose rewards differ or has seen
(1 + max_extra_rounds) x prompts_per_step complete groups. A step short of them then does what
rollout.filter_groups.on_shortfall says: "warn" and "fill" train on those whose rewards differ,
topped up to prompts_per_step with set-aside ones (the batch keeps its size, which the updates and
the data-parallel ranks divide), "warn" with a console line; "error" stops the run
(`FilterShortfall`, as verl does when max_num_gen_batches runs out). Every step's
rollout/filter_shortfall counts the groups topped up, rollout/flat_share the share of the step's
groups set aside. With none whose rewards differ the run stops whatever on_shortfall says
(NoSpread): every later step would train on nothing as well.

Either way a step whose every group has equal rewards is warned about on the console
(`warn_if_nothing`).
"""

from __future__ import annotations

import warnings

from bapo_megatron.config.rollout import OnShortfall
from bapo_megatron.errors import RunStopped
from bapo_megatron.rollout.buffer import GroupState, RolloutBuffer


class NoSpread(RunStopped):
    """rollout.filter_groups found no group whose rewards differ within its rounds."""


class FilterShortfall(RunStopped):
    """rollout.filter_groups ran out of its rounds short of groups whose rewards differ, with
    on_shortfall=error."""


class KeepAll:
    """rollout.filter_groups off: every complete group is trained."""

    def sift(self, buffer: RolloutBuffer) -> int:
        """Set aside the complete groups not to train; how many (each may be replaced)."""
        return 0

    def enough(self, buffer: RolloutBuffer, wanted: int) -> bool:
        """The step can take its `wanted` groups now (after `sift`)."""
        return buffer.complete >= wanted

    def held(self, buffer: RolloutBuffer, wanted: int) -> int:
        """Groups set aside that count against asynchronous admission as if queued."""
        return 0

    def figures(self, buffer: RolloutBuffer, wanted: int, step: int) -> dict[str, float]:
        """Before the step takes its groups (after `sift`): the filter's metrics."""
        return {}


class DropEqualRewards(KeepAll):
    """rollout.filter_groups on: groups whose rewards are all equal are set aside as they complete."""

    def __init__(self, max_extra_rounds: int, on_shortfall: OnShortfall = "warn") -> None:
        self.max_extra_rounds, self.on_shortfall = max_extra_rounds, on_shortfall

    def sift(self, buffer: RolloutBuffer) -> int:
        return buffer.set_aside_equal()

    def enough(self, buffer: RolloutBuffer, wanted: int) -> bool:
        """The step's groups whose rewards differ, or all the complete groups it may look at."""
        seen = buffer.complete + len(buffer.set_aside)
        return buffer.complete >= wanted or seen >= (1 + self.max_extra_rounds) * wanted

    def held(self, buffer: RolloutBuffer, wanted: int) -> int:
        """Those past the step's extra rounds: replaced freely within them, so that the step can see
        its (1 + max_extra_rounds) x wanted groups at any max_staleness; generation beyond that waits
        for the step to take its groups, as it does without the filter."""
        return max(0, len(buffer.set_aside) - self.max_extra_rounds * wanted)

    def figures(self, buffer: RolloutBuffer, wanted: int, step: int) -> dict[str, float]:
        """The filter's metrics; a step short of groups whose rewards differ is warned about, or
        stops the run (on_shortfall), and one with none of them stops it (NoSpread)."""
        kept, aside = min(buffer.complete, wanted), buffer.set_aside
        if kept == 0:
            raise NoSpread(self._why(aside, step))
        short, drawn = wanted - kept, kept + len(aside)
        figures = {
            "rollout/filtered_groups": float(len(aside) - short),  # set aside and not trained
            "rollout/filter_shortfall": float(short),  # trained with equal rewards: the rounds ran out
            "rollout/extra_rounds": (drawn - wanted) / wanted,  # groups beyond a step's, in steps
            "rollout/flat_share": len(aside) / drawn,  # of the groups the step looked at, set aside
        }
        if short and self.on_shortfall != "fill":
            self._short(kept, wanted, len(aside), figures, step)
        return figures

    def _short(self, kept: int, wanted: int, flat: int, figures: dict[str, float], step: int) -> None:
        """The console line of a step short of groups whose rewards differ, or the run's error line."""
        short, drawn = wanted - kept, kept + flat
        seen = (
            f"step {step} has {kept} of its {wanted} groups with rewards that differ after "
            f"{figures['rollout/extra_rounds']:g} extra rounds (rollout.filter_groups.max_extra_rounds="
            f"{self.max_extra_rounds}): {flat} of the {drawn} groups it drew had equal rewards "
            f"(flat share {figures['rollout/flat_share']:.3g})"
        )
        if self.on_shortfall == "error":
            raise FilterShortfall(
                f"rollout.filter_groups: {seen}, {short} short; rollout.filter_groups.on_shortfall=error stops "
                "here, as verl does when max_num_gen_batches runs out. Raise max_extra_rounds, or set "
                "on_shortfall=warn to train the step topped up with groups of equal rewards"
            )
        warnings.warn(
            f"{seen}; it trains with {short} of those in their place (advantage 0). "
            "rollout.filter_groups.on_shortfall=error stops instead (verl's max_num_gen_batches), =fill says nothing",
            stacklevel=3,
        )

    def _why(self, aside: list[GroupState], step: int) -> str:
        samples = [s for g in aside for s in g.samples]
        failed = [s.reward_error for s in samples if s.reward_error is not None]
        errors = f"; {len(failed)} of {len(samples)} reward calls failed, e.g. {failed[0][:200]}" if failed else ""
        return (
            f"rollout.filter_groups: none of the {len(aside)} groups generated for step {step} has rewards "
            f"that differ (rewards seen: {_values(aside)}{errors}), after max_extra_rounds={self.max_extra_rounds} "
            "extra rounds: nothing to train on, and the steps after would train on nothing as well. The "
            "prompts may be too hard or too easy for the model, or the reward wrong; or raise "
            "rollout.filter_groups.max_extra_rounds to look further"
        )


def warn_if_nothing(groups: list[GroupState], step: int) -> None:
    """A console warning when every group of a step has equal rewards: every advantage is 0, the
    step trains on nothing (its gradient is 0)."""
    if groups and all(g.equal_rewards for g in groups):
        warnings.warn(
            f"step {step} trains on nothing: within each of its {len(groups)} groups the rewards are all "
            f"equal (rewards seen: {_values(groups)}), so every advantage is 0. rollout.filter_groups."
            "enabled=true generates other groups in their place (DAPO's dynamic sampling)",
            stacklevel=2,
        )


def _values(groups: list[GroupState]) -> str:
    values = sorted({s.reward for g in groups for s in g.samples})
    return ", ".join(f"{v:g}" for v in values[:5]) + (f" and {len(values) - 5} more" if len(values) > 5 else "")

"""Dynamic sampling that runs short (rollout.filter_groups.on_shortfall), in every rollout mode.

Scripted rewards: group p1 alone has rewards that differ, every other group is flat (all 0). A step
of 2 groups with max_extra_rounds=1 looks at (1 + 1) x 2 groups and finds 1 to train: 1 short,
3 of the 4 groups it drew flat. "warn" tops the step up and says so in one console line, "fill"
tops it up without a word, "error" stops the run with one line naming the step, the flat share,
the rounds and the config key; every step reports rollout/filter_shortfall and rollout/flat_share.
"""

import asyncio
import warnings

import pytest

from bapo_megatron.common.protocol import Completion, SamplingParams
from bapo_megatron.config import load_config
from bapo_megatron.engines.pool import EnginePool
from bapo_megatron.errors import ConfigError, RunStopped
from bapo_megatron.rollout.buffer import RolloutBuffer
from bapo_megatron.rollout.core import RolloutCore
from bapo_megatron.rollout.filtering import DropEqualRewards, FilterShortfall
from bapo_megatron.rollout.modes import make_strategy
from bapo_megatron.rollout.strategies import AbortSteps, AsyncStream, DeterministicRounds

STOP = 0
MODES = ["sync", "deterministic", "async"]


class Engine:
    """Sample i of a group answers i + 1 tokens, then STOP."""

    async def generate(self, input_ids, sampling, rid, routes_from=None, together=None):
        await asyncio.sleep(0.001)
        out = [1] * (int(rid.partition("#")[0].rpartition("/")[2]) + 1) + [STOP]
        return Completion(rid, out, [-0.5] * len(out), "stop")

    async def abort(self, rid=None):
        pass

    async def health(self):
        return True


class ScriptedRewards:
    """RewardWorkers' interface: a group's rewards are its samples' lengths where its prompt's meta
    says `spread` (they differ), else all 0 (a flat group)."""

    failures = replaced = 0

    async def __call__(self, text, ids, meta):
        return (float(len(ids)) if meta["spread"] else 0.0), None

    async def score(self, calls):
        return [await self(*call) for call in calls]


def core_where(spread) -> RolloutCore:
    """2-sample groups p0, p1, ...: prompt i's rewards differ when spread(i); max_staleness 0 (the
    async producer may still look through the step's extra rounds)."""
    counter = iter(range(10_000))

    def prompts():
        i = next(counter)
        return f"p{i}", [7, 8, 9], {"spread": spread(i)}

    return RolloutCore(
        EnginePool([Engine()]),
        RolloutBuffer(2, max_new_tokens=12, max_staleness=0),
        prompts,
        ScriptedRewards(),
        SamplingParams(max_new_tokens=12, stop_token_ids=(STOP,)),
    )


def strategy(mode: str, core: RolloutCore, sieve: DropEqualRewards):
    return {
        "sync": lambda: AbortSteps(core, 2, filter_groups=sieve),
        "deterministic": lambda: DeterministicRounds(core, 2, filter_groups=sieve),
        "async": lambda: AsyncStream(core, 2, filter_groups=sieve),
    }[mode]()


def first_step(mode: str, on_shortfall: str, spread=lambda i: i == 1):
    """Step 1 (policy version 0) of a strategy of 2-group steps, max_extra_rounds=1."""
    steps = strategy(mode, core_where(spread), DropEqualRewards(1, on_shortfall))

    async def run():
        try:
            return await asyncio.wait_for(steps.batch(0), timeout=20)
        finally:
            await steps.close()

    return asyncio.run(run())


def flat_share(stats) -> float:
    """Of the groups the step looked at (trained or set aside), the share whose rewards were equal."""
    drawn = 2 + stats["rollout/filtered_groups"]
    return (stats["rollout/filter_shortfall"] + stats["rollout/filtered_groups"]) / drawn


@pytest.mark.parametrize("mode", MODES)
def test_a_step_short_of_groups_whose_rewards_differ_warns_in_one_line_and_trains_topped_up(mode):
    with pytest.warns(UserWarning) as caught:
        groups, stats = first_step(mode, "warn")
    shortfall = [str(w.message) for w in caught if "rewards that differ" in str(w.message)]
    assert len(shortfall) == 1 and "\n" not in shortfall[0]
    line = shortfall[0]
    assert "step 1 has 1 of its 2 groups with rewards that differ" in line
    assert f"after {stats['rollout/extra_rounds']:g} extra rounds (rollout.filter_groups.max_extra_rounds=1)" in line
    assert f"flat share {stats['rollout/flat_share']:.3g}" in line
    assert "trains with 1 of those in their place" in line
    assert len(groups) == 2 and groups[0].uid == "p1" and groups[1].equal_rewards  # topped up
    assert stats["rollout/filter_shortfall"] == 1
    assert stats["rollout/flat_share"] == pytest.approx(flat_share(stats))
    if mode != "async":  # (async counts the groups that completed as the step ended too)
        assert stats["rollout/flat_share"] == 0.75 and stats["rollout/extra_rounds"] == 1.0
        assert "3 of the 4 groups it drew had equal rewards (flat share 0.75)" in line


@pytest.mark.parametrize("mode", MODES)
def test_fill_tops_the_step_up_without_a_word(mode):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        groups, stats = first_step(mode, "fill")
    assert len(groups) == 2 and groups[0].uid == "p1" and groups[1].equal_rewards
    assert stats["rollout/filter_shortfall"] == 1 and stats["rollout/flat_share"] > 0.5


@pytest.mark.parametrize("mode", MODES)
def test_error_stops_the_run_with_one_line_naming_step_share_rounds_and_key(mode):
    with pytest.raises(FilterShortfall) as caught:
        first_step(mode, "error")
    line = str(caught.value)
    assert isinstance(caught.value, RunStopped)  # reported as the run's error, in status.json
    assert "\n" not in line and "step 1 has 1 of its 2 groups with rewards that differ" in line
    assert "max_extra_rounds=1" in line and "flat share 0." in line and "1 short" in line
    assert "rollout.filter_groups.on_shortfall=error" in line and "max_num_gen_batches" in line


@pytest.mark.parametrize("on_shortfall", ["warn", "fill", "error"])
def test_a_step_with_its_groups_is_not_short_whatever_on_shortfall_says(on_shortfall):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        groups, stats = first_step("sync", on_shortfall, spread=lambda i: i in (1, 2))
    assert [g.uid for g in groups] == ["p1", "p2"]
    assert stats["rollout/filter_shortfall"] == 0 and stats["rollout/flat_share"] == pytest.approx(1 / 3)


def test_on_shortfall_is_read_checked_and_given_to_the_strategy():
    core = core_where(lambda i: True)
    on = ["rollout.filter_groups.enabled=true"]
    assert make_strategy(load_config(None, on), core).filter_groups.on_shortfall == "warn"  # the default
    sieve = make_strategy(load_config(None, [*on, "rollout.filter_groups.on_shortfall=error"]), core).filter_groups
    assert sieve.on_shortfall == "error"
    with pytest.raises(ConfigError, match=r"rollout.filter_groups.on_shortfall='stop': must be one of"):
        load_config(None, [*on, "rollout.filter_groups.on_shortfall=stop"])
    with pytest.raises(ConfigError, match=r"rollout.filter_groups.on_shortfall='fill': applies with enabled=true"):
        load_config(None, ["rollout.filter_groups.on_shortfall=fill"])

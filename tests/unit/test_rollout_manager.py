"""The rollout manager's abort-mode step against an in-process engine whose samples have known
lengths: requests carry at most the token budget, a sample cut at its budget continues at once
while the step lacks complete groups (no round barrier), what is in flight when the step has its
groups is aborted and kept, and it continues next step from where it stopped."""

import asyncio

from bapo_megatron.common.protocol import Completion, SamplingParams
from bapo_megatron.rollout.manager import EnginePool, RolloutManager
from bapo_megatron.rollout.partial import PartialRolloutBuffer
from bapo_megatron.rollout.rewards import RewardWorkers

STOP = 0
# natural response lengths (then the stop token) per sample; 99: never stops within max_new_tokens
LENGTHS = {"p0/0": 2, "p0/1": 9, "p1/0": 99, "p1/1": 3, "p2/0": 99, "p2/1": 99}
SLOW = {"p1/0": 3, "p2/0": 3, "p2/1": 3}  # ticks per token (else 1)
TICK = 0.02


class ScriptedEngine:
    """Emits token 1 + position until the sample's length, then STOP, one token per SLOW ticks;
    an aborted request returns what it has."""

    def __init__(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        self.sent: list[tuple[str, int, int, float]] = []  # rid, response tokens in its input, max_new, start
        self.aborted: set[str] = set()
        self.events: list[tuple[str, str]] = []  # ("sent" | "returned", rid), in the order they happened

    async def generate(self, input_ids, sampling, rid):
        uid = rid.partition("#")[0]
        done = len(input_ids) - self.prompt_len
        self.sent.append((rid, done, sampling.max_new_tokens, asyncio.get_running_loop().time()))
        self.events.append(("sent", rid))
        out, finish = [], "length"
        while len(out) < sampling.max_new_tokens:
            await asyncio.sleep(TICK * SLOW.get(uid, 1))
            if rid in self.aborted:
                finish = "abort"
                break
            position = done + len(out)
            out.append(STOP if position == LENGTHS[uid] else 1 + position)
            if out[-1] == STOP:
                finish = "stop"
                break
        self.events.append(("returned", rid))
        return Completion(rid, out, [-0.5] * len(out), finish)

    async def abort(self, rid=None):
        self.aborted.add(rid)

    def first(self, kind: str, uid: str, nth: int = 0) -> int:
        """The position in `events` of the nth `kind` event of sample uid."""
        return [i for i, (k, rid) in enumerate(self.events) if k == kind and rid.startswith(uid + "#")][nth]

    async def health(self):
        return True

    def requests(self, uid):
        return [(done, max_new, start) for rid, done, max_new, start in self.sent if rid.startswith(uid + "#")]


def make_manager(engines, answer_ids, budget=None, **options) -> RolloutManager:
    """A manager of two-sample groups of the prompt [7, 8, 9] (uids p0, p1, ...), 12 new tokens at most,
    one group per step, scored inline by exact_ids against `answer_ids`."""
    counter = iter(range(10))

    def prompts():
        i = next(counter)
        return f"p{i}", [7, 8, 9], {"answer_ids": answer_ids}

    return RolloutManager(
        EnginePool(engines),
        PartialRolloutBuffer(samples_per_prompt=2, max_new_tokens=12, token_budget=budget, max_staleness=3),
        prompts,
        RewardWorkers("exact_ids", inline=True),
        SamplingParams(max_new_tokens=12, stop_token_ids=(STOP,)),
        prompts_per_step=1,
        **options,
    )


def test_budgeted_requests_continue_at_once_and_the_rest_is_kept_for_next_step():
    engine = ScriptedEngine(prompt_len=3)
    manager = make_manager([engine], [STOP], budget=4, oversample=2)
    buffer = manager.buffer

    async def run():
        first = await manager.step(1)
        stats = dict(manager.stats)
        kept = list(buffer.groups["p1"].samples[0].response_ids)
        second = await manager.step(2)
        return first, stats, kept, second

    first, stats, kept, second = asyncio.run(run())
    assert all(max_new <= 4 for _, _, max_new, _ in engine.sent)  # no request beyond the budget
    # step 1: p0/1 (9 tokens, then STOP) takes three requests, the later two sent as the one
    # before returns: no round barrier waits for p1/0's slow first request (12 ticks)
    assert [g.uid for g in first] == ["p0"] and stats["rollout/rounds"] == 3
    assert {s.uid: s.response_ids for s in first[0].samples} == {"p0/0": [1, 2, STOP], "p0/1": [*range(1, 10), STOP]}
    assert all(s.versions == [1] * len(s.response_ids) for s in first[0].samples)
    p01 = engine.requests("p0/1")
    assert [(done, n) for done, n, _ in p01] == [(0, 4), (4, 4), (8, 4)]
    assert engine.first("sent", "p0/1", 1) < engine.first("returned", "p1/0")  # p1/0's first request: 12 ticks
    # p1/0 was generating when p0 completed: aborted, its tokens kept (under version 1) ...
    assert 1 <= len(kept) < 12 and kept == list(range(1, len(kept) + 1)) and stats["rollout/in_buffer"] == 1
    # ... and continued in step 2 from there (under version 2), while the new p2 generates beside it
    assert [g.uid for g in second] == ["p1"]
    long = next(s for s in second[0].samples if s.uid == "p1/0")
    assert long.finish == "length" and long.response_ids == list(range(1, 13))
    assert long.versions == [1] * len(kept) + [2] * (12 - len(kept))
    sent = [done for done, _, _ in engine.requests("p1/0")]
    assert len(kept) in sent and sent == sorted(set(sent))  # resumed where it stopped, nothing resent
    assert engine.requests("p2/0") and set(buffer.groups) == {"p2"}


def test_progress_reports_complete_groups_and_tokens_as_the_step_goes():
    engine = ScriptedEngine(prompt_len=3)
    manager = make_manager([engine], [STOP], budget=4, oversample=2)
    manager.prompts_per_step = 2
    seen: list[tuple[int, int]] = []
    manager.on_progress = lambda groups, tokens: seen.append((groups, tokens))
    asyncio.run(manager.step(1))
    groups, tokens = zip(*seen, strict=True)
    assert list(groups) == sorted(groups) and groups[0] == 0 and groups[-1] == 2  # never past the step's groups
    assert list(tokens) == sorted(tokens) and tokens[-1] <= manager.stats["rollout/tokens"]


class FailingEngine:
    """Answers every request with one token and an abort carrying an error status, `fail` times per
    sample, then generates the sample to its end (two tokens, then STOP)."""

    def __init__(self, fail: int) -> None:
        self.fail, self.calls, self.seeds = fail, {}, []

    async def generate(self, input_ids, sampling, rid):
        uid = rid.partition("#")[0]
        self.calls[uid] = self.calls.get(uid, 0) + 1
        self.seeds.append((uid, len(input_ids), sampling.sampling_seed))
        if self.calls[uid] <= self.fail:
            return Completion(rid, [5], [-0.1], "abort", error="InternalError (HTTP 500): sampling failed")
        return Completion(rid, [1, 2, STOP], [-0.1] * 3, "stop")

    async def abort(self, rid=None):
        pass

    async def health(self):
        return True


def _manager(engine, deterministic_seed=None):
    return make_manager([engine], [1, 2], deterministic_seed=deterministic_seed)


def test_a_sample_the_engine_keeps_failing_stops_the_rollout_with_its_error():
    import pytest

    from bapo_megatron.rollout.manager import MAX_SAMPLE_FAILURES, RolloutError

    engine = FailingEngine(fail=100)
    with pytest.raises(RolloutError, match="failed it 3 times in a row, last: InternalError .HTTP 500.: sampling"):
        asyncio.run(_manager(engine).step(0))
    assert max(engine.calls.values()) == MAX_SAMPLE_FAILURES  # never resubmitted for ever


def test_failures_short_of_the_limit_are_resubmitted_and_keep_their_tokens():
    engine = FailingEngine(fail=2)
    groups = asyncio.run(_manager(engine).step(0))
    for s in groups[0].samples:  # two failed answers kept a token each, then the sample finished
        assert s.response_ids == [5, 5, 1, 2, STOP] and s.finish == "stop" and s.reward == 0.0


def test_deterministic_mode_seeds_each_request_from_the_run_seed_and_the_sample():
    runs = []
    for seed in (7, 7, 8):
        engine = FailingEngine(fail=1)
        asyncio.run(_manager(engine, deterministic_seed=seed).step(0))
        runs.append(sorted(engine.seeds))
    assert runs[0] == runs[1] and runs[0] != runs[2]  # the run's seed decides them
    seeds = [seed for _, _, seed in runs[0]]
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds) and len(set(seeds)) == len(seeds)
    engine = FailingEngine(fail=0)
    asyncio.run(_manager(engine).step(0))  # the default: the engine seeds each request itself
    assert engine.seeds and all(seed is None for _, _, seed in engine.seeds)


def test_a_continued_sample_goes_back_to_the_engine_holding_its_prefix():
    """Prefix-cache affinity: each of a sample's later requests goes to the engine that generated its
    earlier tokens (two engines, equally loaded, so the least-loaded choice alone would not)."""
    engines = [ScriptedEngine(prompt_len=3), ScriptedEngine(prompt_len=3)]
    manager = make_manager(engines, [STOP], budget=4)
    asyncio.run(manager.step(1))
    for uid in ("p0/0", "p0/1"):
        served = [i for i, e in enumerate(engines) if e.requests(uid)]
        assert len(served) == 1, (uid, served)  # every request of the sample on one engine
    assert len(engines[0].requests("p0/1")) + len(engines[1].requests("p0/1")) == 3  # 9 tokens: 3 requests

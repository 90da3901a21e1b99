"""The rollout strategies against in-process engines whose samples have known lengths.

Sync, abort mode: requests carry at most the token budget, a sample cut at its budget continues
at once while the step lacks complete groups (no round barrier), what is in flight when the step
has its groups is aborted and kept, and it continues next step from where it stopped.

Async: the producer generates while nobody asks for a batch; admission keeps what is queued and
generating trainable within max_staleness versions; no batch holds a token older than the bound,
also when a slow group is overtaken; each pause mode keeps every token with the version that
sampled it; drain leaves nothing in flight and the buffer's state resumes exactly.
"""

import asyncio
import zlib

import pytest

from bapo_megatron.common.protocol import Completion, SamplingParams
from bapo_megatron.engines.client import EngineUnavailable
from bapo_megatron.engines.pool import EnginePool
from bapo_megatron.rewards.workers import RewardWorkers
from bapo_megatron.rollout.buffer import RolloutBuffer
from bapo_megatron.rollout.core import MAX_SAMPLE_FAILURES, RolloutCore, RolloutError
from bapo_megatron.rollout.strategies import AbortSteps, AsyncStream, DeterministicRounds

# the existing modes' tests score single-answer groups: their steps train on nothing, as warned
pytestmark = pytest.mark.filterwarnings("ignore:step .* trains on nothing:UserWarning")

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

    async def generate(self, input_ids, sampling, rid, routes_from=None, together=None):
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


def make_core(engines, answer_ids, budget=None, deterministic_seed=None, max_staleness=3, samples=2, max_new=12):
    """`samples`-sample groups of the prompt [7, 8, 9] (uids p0, p1, ...), max_new new tokens at most,
    scored inline by exact_ids against `answer_ids`."""
    counter = iter(range(10_000))

    def prompts():
        i = next(counter)
        return f"p{i}", [7, 8, 9], {"answer_ids": answer_ids}

    return RolloutCore(
        EnginePool(engines),
        RolloutBuffer(samples, max_new_tokens=max_new, token_budget=budget, max_staleness=max_staleness),
        prompts,
        RewardWorkers("exact_ids", inline=True),
        SamplingParams(max_new_tokens=max_new, stop_token_ids=(STOP,)),
        deterministic_seed=deterministic_seed,
    )


def make_steps(engines, answer_ids, budget=None, oversample=1.0, prompts_per_step=1, deterministic_seed=None):
    """Sync steps of `prompts_per_step` groups: abort mode (partial output kept), or deterministic rounds."""
    core = make_core(engines, answer_ids, budget, deterministic_seed)
    if deterministic_seed is not None:
        return DeterministicRounds(core, prompts_per_step, oversample)
    return AbortSteps(core, prompts_per_step, oversample, keep=True)


def test_budgeted_requests_continue_at_once_and_the_rest_is_kept_for_next_step():
    engine = ScriptedEngine(prompt_len=3)
    steps = make_steps([engine], [STOP], budget=4, oversample=2)
    buffer = steps.buffer

    async def run():
        first, stats = await steps.batch(1)
        kept = list(buffer.groups["p1"].samples[0].response_ids)
        second, _ = await steps.batch(2)
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
    steps = make_steps([engine], [STOP], budget=4, prompts_per_step=2)
    seen: list[tuple[int, int]] = []
    steps.core.on_progress = lambda groups, tokens: seen.append((groups, tokens))
    _, stats = asyncio.run(steps.batch(1))
    groups, tokens = zip(*seen, strict=True)
    assert list(groups) == sorted(groups) and groups[0] == 0 and groups[-1] == 2
    assert list(tokens) == sorted(tokens) and tokens[-1] <= stats["rollout/tokens"]


class FailingEngine:
    """Answers every request with one token and an abort carrying an error status, `fail` times per
    sample, then generates the sample to its end (two tokens, then STOP)."""

    def __init__(self, fail: int) -> None:
        self.fail, self.calls, self.seeds = fail, {}, []

    async def generate(self, input_ids, sampling, rid, routes_from=None, together=None):
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


def test_a_sample_the_engine_keeps_failing_stops_the_rollout_with_its_error():
    engine = FailingEngine(fail=100)
    with pytest.raises(RolloutError, match="failed it 3 times in a row, last: InternalError .HTTP 500.: sampling"):
        asyncio.run(make_steps([engine], [1, 2]).batch(0))
    assert max(engine.calls.values()) == MAX_SAMPLE_FAILURES  # never resubmitted for ever


def test_failures_short_of_the_limit_are_resubmitted_and_keep_their_tokens():
    engine = FailingEngine(fail=2)
    groups, _ = asyncio.run(make_steps([engine], [1, 2]).batch(0))
    for s in groups[0].samples:  # two failed answers kept a token each, then the sample finished
        assert s.response_ids == [5, 5, 1, 2, STOP] and s.finish == "stop" and s.reward == 0.0


def test_deterministic_mode_seeds_each_request_from_the_run_seed_and_the_sample():
    runs = []
    for seed in (7, 7, 8):
        engine = FailingEngine(fail=1)
        asyncio.run(make_steps([engine], [1, 2], deterministic_seed=seed).batch(0))
        runs.append(sorted(engine.seeds))
    assert runs[0] == runs[1] and runs[0] != runs[2]  # the run's seed decides them
    seeds = [seed for _, _, seed in runs[0]]
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds) and len(set(seeds)) == len(seeds)
    engine = FailingEngine(fail=0)
    asyncio.run(make_steps([engine], [1, 2]).batch(0))  # the default: the engine seeds each request itself
    assert engine.seeds and all(seed is None for _, _, seed in engine.seeds)


def test_a_continued_sample_goes_back_to_the_engine_holding_its_prefix():
    """Prefix-cache affinity: each of a sample's later requests goes to the engine that generated its
    earlier tokens (two engines, equally loaded, so the least-loaded choice alone would not)."""
    engines = [ScriptedEngine(prompt_len=3), ScriptedEngine(prompt_len=3)]
    asyncio.run(make_steps(engines, [STOP], budget=4).batch(1))
    for uid in ("p0/0", "p0/1"):
        served = [i for i, e in enumerate(engines) if e.requests(uid)]
        assert len(served) == 1, (uid, served)  # every request of the sample on one engine
    assert len(engines[0].requests("p0/1")) + len(engines[1].requests("p0/1")) == 3  # 9 tokens: 3 requests


# ----------------------------------------------------------------------------------------------
# Asynchronous.


class VersionedEngine:
    """An engine with a weight version and SGLang's pauses: one token per tick for every running
    request (a sample's length from its uid: 4-23 tokens, then STOP; `slow` uids never stop), each
    token reported with the version live when it was sampled (weight_versions spans). Paused in
    abort mode, running requests return what they have; in retract or in_place mode they wait,
    as do requests that arrive while paused."""

    def __init__(self, prompt_len: int = 3, slow: frozenset[str] = frozenset()) -> None:
        self.prompt_len, self.slow = prompt_len, slow
        self.version = 0
        self.running: set[str] = set()
        self.aborted: set[str] = set()
        self.paused = asyncio.Event()
        self.paused.set()  # set: not paused
        self.pauses: list[str] = []
        self.sent_while_paused = 0

    def length(self, uid: str) -> int:
        return 10**6 if uid in self.slow else 4 + zlib.crc32(uid.encode()) % 20

    async def generate(self, input_ids, sampling, rid, routes_from=None, together=None):
        uid = rid.partition("#")[0]
        if not self.paused.is_set():
            self.sent_while_paused += 1
        await self.paused.wait()
        done = len(input_ids) - self.prompt_len
        out, spans, finish = [], [], "length"
        self.running.add(rid)
        try:
            while len(out) < sampling.max_new_tokens:
                await asyncio.sleep(0.002)
                await self.paused.wait()
                if rid in self.aborted:
                    finish = "abort"
                    break
                position = done + len(out)
                out.append(STOP if position == self.length(uid) else 1 + position)
                version = str(self.version)
                if spans and spans[-1][0] == version:
                    spans[-1] = (version, spans[-1][1], len(out))
                else:
                    spans.append((version, len(out) - 1, len(out)))
                if out[-1] == STOP:
                    finish = "stop"
                    break
        finally:
            self.running.discard(rid)
        return Completion(rid, out, [-0.5] * len(out), finish, version_spans=spans)

    async def abort(self, rid=None):
        self.aborted.add(rid)

    async def pause(self, mode):
        self.pauses.append(mode)
        self.paused.clear()
        if mode == "abort":
            self.aborted |= self.running

    async def resume(self):
        self.paused.set()

    async def health(self):
        return True


def async_stream(engine, prompts_per_step=2, oversample=1.5, max_staleness=1, pause_mode="retract", max_new=30):
    core = make_core([engine], [STOP], max_staleness=max_staleness, samples=2, max_new=max_new)
    return AsyncStream(core, prompts_per_step, oversample, pause_mode)


async def _train(stream, engine, version, ticks=15):
    """What the loop does between batches: 'training' (the producer runs meanwhile), then the update,
    once requests are in flight where there are any to send (so that samples span versions)."""
    await asyncio.sleep(0.002 * ticks)
    for _ in range(200):
        if engine.running:
            break
        await asyncio.sleep(0.002)
    async with stream.paused(version + 1):
        engine.version = version + 1


@pytest.mark.parametrize("pause_mode", ["retract", "abort", "in_place"])
def test_async_batches_keep_the_staleness_bound_and_generation_goes_on_between_them(pause_mode):
    engine = VersionedEngine()
    stream = async_stream(engine, pause_mode=pause_mode)
    P, K = stream.prompts_per_step, stream.buffer.max_staleness

    async def run():
        seen, produced_while_training, spanning = [], [], 0
        for version in range(8):
            groups, _ = await stream.batch(version)
            buffer = stream.buffer
            assert buffer.taken + buffer.in_flight <= (version + K + 1) * P  # admission: AReaL's rule
            seen += [g.uid for g in groups]
            for s in (s for g in groups for s in g.samples):
                assert min(s.versions) >= version - K, (version, s.uid, s.versions)  # the bound
                assert len(s.versions) == len(s.response_ids) == len(s.logprobs) and s.reward is not None
                spanning += len(set(s.versions)) > 1
            before = stream.core.tokens
            await _train(stream, engine, version)
            produced_while_training.append(stream.core.tokens - before)
        await stream.close()
        spanning += sum(len(set(s.versions)) > 1 for s in stream.buffer.samples())
        return seen, produced_while_training, spanning

    seen, produced, spanning = asyncio.run(run())
    assert len(seen) == len(set(seen)) == 16  # no group twice
    assert sum(n > 0 for n in produced) >= 6  # the engine generated while nobody asked
    assert spanning > 0  # samples continued across weight updates, each token with its own version
    assert set(engine.pauses) == {pause_mode} and len(engine.pauses) == 8
    assert engine.sent_while_paused == 0  # nothing goes out while the engines are paused


def test_admission_at_max_staleness_0_waits_for_each_new_version():
    """K = 0: a group may start only if it can be trained by the version that starts it, so the
    producer never runs ahead of the trainer: one group a version, every token of that version."""
    engine = VersionedEngine()
    stream = async_stream(engine, prompts_per_step=1, oversample=2.0, max_staleness=0)

    async def run():
        first, _ = await stream.batch(0)
        await asyncio.sleep(0.05)  # time enough to start more, were it allowed
        admitted_at_0 = stream.buffer.counters["groups_added"]
        await _train(stream, engine, 0)
        second, _ = await stream.batch(1)
        await stream.close()
        return first, admitted_at_0, second

    first, admitted_at_0, second = asyncio.run(run())
    assert admitted_at_0 == 1  # (0 + 0 + 1) x 1: p0 only, taken at version 0; nothing started after it
    assert [g.uid for g in first] == ["p0"] and [g.uid for g in second] == ["p1"]
    assert all(set(s.versions) == {1} for s in second[0].samples)


class SlowEngine(VersionedEngine):
    """`slow` samples take ten ticks a token: they cannot finish within a few versions."""

    async def generate(self, input_ids, sampling, rid, routes_from=None, together=None):
        if rid.partition("#")[0] in self.slow:
            sampling = SamplingParams(max_new_tokens=min(sampling.max_new_tokens, 1), stop_token_ids=(STOP,))
            await asyncio.sleep(0.02)
        return await super().generate(input_ids, sampling, rid)

    def length(self, uid: str) -> int:
        return 40 if uid in self.slow else super().length(uid)


def test_a_group_that_falls_behind_the_bound_is_generated_again_never_trained_stale():
    """p0/0 needs about 40 x 22 ms, many versions: its tokens fall out of max_staleness 1 while the
    other groups overtake it; each time it is reset and started again (dropped_stale), and no batch
    ever holds a token older than the bound."""
    engine = SlowEngine(slow=frozenset({"p0/0"}))
    stream = async_stream(engine, prompts_per_step=1, oversample=2.0, max_staleness=1, max_new=40)

    async def run():
        taken = []
        for version in range(6):
            groups, _ = await stream.batch(version)
            for s in (s for g in groups for s in g.samples):
                assert min(s.versions) >= version - 1, (version, s.uid, s.versions)
            taken += [g.uid for g in groups]
            await _train(stream, engine, version)
        await stream.close()
        return taken, stream.buffer.counters["dropped_stale"], stream.buffer.groups["p0"].samples[0]

    taken, dropped, stuck = asyncio.run(run())
    assert "p0" not in taken and len(taken) == 6  # overtaken, and the steps went on without it
    assert dropped >= 2 and stuck.regenerated >= 2
    assert not stuck.versions or min(stuck.versions) >= 6 - 1  # what it holds now is still trainable


def test_async_drain_leaves_nothing_in_flight_and_the_state_resumes_exactly():
    import json

    engine = VersionedEngine()
    stream = async_stream(engine, pause_mode="abort")

    async def run():
        await stream.batch(0)
        await asyncio.sleep(0.01)  # requests in flight, part-way
        await stream.drain()
        in_flight = len(stream.core.running) + len(stream.core.cutting) + len(stream.core.scoring)
        state = json.loads(json.dumps(stream.buffer.state_dict()))
        tokens = sum(len(s.response_ids) for s in stream.buffer.samples())
        await asyncio.sleep(0.01)
        still = sum(len(s.response_ids) for s in stream.buffer.samples())  # nothing generates while drained
        await stream.resume()
        await stream.close()
        return in_flight, state, tokens, still

    in_flight, state, tokens, still = asyncio.run(run())
    assert in_flight == 0 and tokens == still > 0 and not engine.running
    restored = RolloutBuffer(2, max_new_tokens=30, max_staleness=1)
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    resumed = AsyncStream(
        RolloutCore(
            EnginePool([VersionedEngine()]),
            restored,
            iter([]).__next__,  # no new prompts: what was saved must complete by itself
            RewardWorkers("exact_ids", inline=True),
            SamplingParams(max_new_tokens=30, stop_token_ids=(STOP,)),
        ),
        prompts_per_step=1,
    )

    async def finish():
        resumed.admit = lambda: False
        groups, _ = await resumed.batch(0)
        await resumed.close()
        return groups

    groups = asyncio.run(finish())
    saved = {g["uid"]: g for g in state["groups"]}
    for g in groups:  # each continued from its saved tokens
        for s, before in zip(g.samples, saved[g.uid]["samples"], strict=True):
            assert s.response_ids[: len(before["response_ids"])] == before["response_ids"]


def test_with_no_engine_serving_for_wait_s_the_pool_stops_the_run():
    """Dead, or back but without the current weights: neither is picked; after wait_s, RunStopped
    naming both; an error the supervisor set (an engine that cannot come back) stops it at once."""
    from bapo_megatron.engines.client import EngineClient
    from bapo_megatron.errors import RunStopped

    pool = EnginePool(
        [EngineClient("http://127.0.0.1:9"), EngineClient("http://127.0.0.1:10")], wait_s=0.3, probe_s=0.05
    )
    pool.mark_dead(0)
    pool.mark_dead(1)
    pool.came_back(1)
    with pytest.raises(
        RunStopped,
        match=r"no engine served for 0 s .*not answering: http://127.0.0.1:9; waiting for "
        r"the weights: http://127.0.0.1:10",
    ):
        asyncio.run(pool.pick())
    pool.revive(1)
    assert asyncio.run(pool.pick()) == 1
    pool.mark_dead(1)
    pool.error = "engine X did not come back"
    with pytest.raises(RunStopped, match="engine X did not come back"):
        asyncio.run(pool.pick())


class SlowRewards:
    """RewardWorkers' interface, each call taking `seconds`: calls are in progress when a drain comes."""

    failures = replaced = 0

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def __call__(self, text, ids, meta):
        await asyncio.sleep(self.seconds)
        return 1.0, None

    async def score(self, calls):
        return [await self(*call) for call in calls]


def test_async_drain_with_rewards_in_flight_leaves_the_producer_running():
    """A checkpoint's drain cancels the reward calls in progress while the producer waits on them: the
    producer must not take their cancellation for its own (it died, and the next batch ended the run
    with a CancelledError, issue 34's F1). Every batch after as many drains is complete."""
    engine = VersionedEngine()
    stream = async_stream(engine, pause_mode="abort")
    stream.core.reward = SlowRewards(0.05)

    async def run():
        batches = []
        for version in range(4):
            batches.append(await stream.batch(version))
            for _ in range(500):  # until a reward call is in progress
                if stream.core.scoring:
                    break
                await asyncio.sleep(0.002)
            assert stream.core.scoring, "no reward in progress: the drain below tests nothing"
            await stream.drain()
            await stream.resume()
            async with stream.paused(version + 1):  # the update: the engine serves the next version
                engine.version = version + 1
        await stream.close()
        return batches

    batches = asyncio.run(run())
    assert [len(groups) for groups, _ in batches] == [stream.prompts_per_step] * 4


class DyingEngine(VersionedEngine):
    """Dies on `die()`: its requests then fail as a dead engine's do (a moment later, after the
    client's retries) and it answers nothing, aborts included."""

    dead = False

    def die(self):
        self.dead = True

    async def generate(self, input_ids, sampling, rid, routes_from=None, together=None):
        if self.dead:
            raise EngineUnavailable("dead")
        task = asyncio.ensure_future(super().generate(input_ids, sampling, rid))
        while not task.done():
            await asyncio.sleep(0.002)
            if self.dead:
                task.cancel()
                await asyncio.sleep(0.01)  # the client's retries
                raise EngineUnavailable("dead")
        return task.result()

    async def abort(self, rid=None):
        if self.dead:
            raise EngineUnavailable("dead")
        await super().abort(rid)

    async def health(self):
        return not self.dead


@pytest.mark.parametrize("died", ["as-cut", "before"])
def test_a_drain_does_not_wait_for_an_engine_that_died_under_its_requests(died):
    """An engine that dies as its requests are cut (a checkpoint, or a run stopping on a signal,
    issue 34's F2): their abort fails and they fail over to the pool, where no engine serves; or it
    died before, and they wait there for one. Cut, they are given up (nothing they generated there
    is kept), not resubmitted, so the drain returns at once instead of waiting
    rollout.engines.wait_s for an engine."""
    engine = DyingEngine()
    stream = async_stream(engine)
    stream.pool.wait_s = 3600.0

    async def run():
        first = asyncio.ensure_future(stream.batch(0))
        for _ in range(1000):
            if engine.running:
                break
            await asyncio.sleep(0.002)
        assert engine.running, "nothing in flight: the drain below tests nothing"
        engine.die()
        while died == "before" and not stream.pool.dead:  # the requests failed over: they wait for an engine
            await asyncio.sleep(0.002)
        await asyncio.wait_for(stream.drain(), timeout=30)  # hangs for an hour if the cut requests wait
        flights = len(stream.core.running) + len(stream.core.cutting)
        first.cancel()
        await stream.close()
        return flights

    assert asyncio.run(run()) == 0


# ----------------------------------------------------------------------------------------------
# rollout.filter_groups: groups whose rewards are all equal are set aside and generated again.


class QuickEngine:
    """Sample i of a group answers i + 1 tokens, then STOP, after `ticks` of 1 ms."""

    def __init__(self, ticks: int = 1) -> None:
        self.ticks = ticks

    async def generate(self, input_ids, sampling, rid, routes_from=None, together=None):
        await asyncio.sleep(0.001 * self.ticks)
        out = [1] * (int(rid.partition("#")[0].rpartition("/")[2]) + 1) + [STOP]
        return Completion(rid, out, [-0.5] * len(out), "stop")

    async def abort(self, rid=None):
        pass

    async def health(self):
        return True


class SpreadRewards:
    """RewardWorkers' interface: a group's rewards differ (the response lengths) when its prompt's
    meta says `spread`, else they are all 0."""

    failures = replaced = 0

    async def __call__(self, text, ids, meta):
        return (float(len(ids)) if meta["spread"] else 0.0), None

    async def score(self, calls):
        return [await self(*call) for call in calls]


def spread_core(engine, spread, max_staleness=3, max_new=12):
    """2-sample groups p0, p1, ...; prompt i's rewards differ when spread(i)."""
    counter = iter(range(10_000))

    def prompts():
        i = next(counter)
        return f"p{i}", [7, 8, 9], {"spread": spread(i)}

    core = make_core([engine], [STOP], max_staleness=max_staleness, max_new=max_new)
    core.prompts, core.reward = prompts, SpreadRewards()
    return core


def differ(group) -> bool:
    return len({s.reward for s in group.samples}) > 1


def test_sync_steps_set_equal_reward_groups_aside_and_generate_others_in_their_place():
    from bapo_megatron.rollout.filtering import DropEqualRewards

    steps = AbortSteps(spread_core(QuickEngine(), lambda i: i % 2 == 1), 2, filter_groups=DropEqualRewards(2))
    groups, stats = asyncio.run(steps.batch(0))
    # p0 and p2 came back with equal rewards: each replaced by a new prompt (p2, then p3)
    assert [g.uid for g in groups] == ["p1", "p3"] and all(differ(g) for g in groups)
    assert stats["rollout/filtered_groups"] == 2 and stats["rollout/filter_shortfall"] == 0
    assert stats["rollout/extra_rounds"] == 1.0  # 4 groups for a step of 2
    assert steps.buffer.counters["set_aside"] == 2 and steps.buffer.set_aside == []  # discarded by the take


def test_sync_steps_stop_looking_after_max_extra_rounds_and_fill_with_equal_reward_groups():
    from bapo_megatron.rollout.filtering import DropEqualRewards

    steps = AbortSteps(spread_core(QuickEngine(), lambda i: i == 1), 2, filter_groups=DropEqualRewards(1))
    groups, stats = asyncio.run(steps.batch(0))
    assert [g.uid for g in groups] == ["p1", "p0"]  # the one that differs, then the oldest set aside
    assert stats["rollout/filter_shortfall"] == 1 and stats["rollout/filtered_groups"] == 2
    assert stats["rollout/extra_rounds"] == 1.0 and steps.buffer.counters["groups_added"] == 4  # (1 + 1) x 2


@pytest.mark.parametrize("mode", ["sync", "deterministic", "async"])
def test_no_group_whose_rewards_differ_within_the_rounds_stops_the_run(mode):
    from bapo_megatron.rollout.filtering import DropEqualRewards, NoSpread

    core = spread_core(QuickEngine(), lambda i: False, max_staleness=0)
    sieve = DropEqualRewards(2)
    strategy = {
        "sync": lambda: AbortSteps(core, 2, filter_groups=sieve),
        "deterministic": lambda: DeterministicRounds(core, 2, filter_groups=sieve),
        "async": lambda: AsyncStream(core, 2, filter_groups=sieve),  # admission at max_staleness 0 lets it look
    }[mode]()

    async def run():
        try:
            return await asyncio.wait_for(strategy.batch(0), timeout=20)
        finally:
            await strategy.close()

    with pytest.raises(NoSpread, match=r"none of the \d+ groups generated for step 1 has rewards that differ .rewards"):
        asyncio.run(run())
    assert 6 <= core.buffer.counters["set_aside"] <= 8  # (1 + 2) x 2, and what completed at once


def test_deterministic_rounds_with_the_filter_resume_exactly():
    from bapo_megatron.rollout.filtering import DropEqualRewards

    def rounds(start=0, state=None):
        core = spread_core(QuickEngine(), lambda i: i % 3 == 0)
        counter = iter(range(start, 10_000))
        core.prompts = lambda: (f"p{(i := next(counter))}", [7, 8, 9], {"spread": i % 3 == 0})
        if state is not None:
            core.buffer.load_state_dict(state)
        return DeterministicRounds(core, 2, oversample=1.5, filter_groups=DropEqualRewards(3))

    async def steps(strategy, versions):
        return [[(g.uid, [s.response_ids for s in g.samples]) for g in (await strategy.batch(v))[0]] for v in versions]

    straight = asyncio.run(steps(rounds(), range(3)))
    first = rounds()
    head = asyncio.run(steps(first, [0]))
    import json

    state = json.loads(json.dumps(first.buffer.state_dict()))
    tail = asyncio.run(steps(rounds(first.buffer.counters["groups_added"], state), [1, 2]))
    assert head + tail == straight
    assert all(int(uid[1:]) % 3 == 0 for step in straight for uid, _ in step)  # only groups whose rewards differ


def test_async_batches_with_the_filter_train_groups_whose_rewards_differ_within_the_bounds():
    from bapo_megatron.rollout.filtering import DropEqualRewards

    engine = VersionedEngine()
    core = spread_core(engine, lambda i: i % 2 == 0, max_staleness=1, max_new=30)
    stream = AsyncStream(core, 2, 1.5, filter_groups=DropEqualRewards(2))
    P, K = 2, 1

    async def run():
        filtered = 0
        for version in range(4):
            groups, stats = await stream.batch(version)
            buffer = stream.buffer
            held = stream.filter_groups.held(buffer, P)
            assert buffer.taken + buffer.in_flight + held <= (version + K + 1) * P  # admission
            assert len(groups) == P and stats["rollout/filter_shortfall"] == 0
            for g in groups:
                assert int(g.uid[1:]) % 2 == 0 and all(min(s.versions) >= version - K for s in g.samples)
            filtered += stats["rollout/filtered_groups"]
            await _train(stream, engine, version)
        for _ in range(1000):  # until the producer has set a group aside for the next step
            if stream.buffer.set_aside:
                break
            await asyncio.sleep(0.002)
        await stream.drain()
        state = stream.buffer.state_dict()
        await stream.close()
        return filtered, state

    filtered, state = asyncio.run(run())
    assert filtered >= 4 and state["set_aside"]  # the odd prompts, set aside and replaced
    restored = RolloutBuffer(2, max_new_tokens=30, max_staleness=1)
    restored.load_state_dict(state)
    assert restored.state_dict() == state  # the groups set aside since the last take, too


def test_a_step_whose_every_group_has_equal_rewards_is_warned_about():
    with pytest.warns(UserWarning, match=r"step 4 trains on nothing: within each of its 2 groups .*rewards seen: 0\)"):
        asyncio.run(AbortSteps(spread_core(QuickEngine(), lambda i: False), 2).batch(3))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        asyncio.run(AbortSteps(spread_core(QuickEngine(), lambda i: i == 1), 2).batch(3))  # one group differs


def test_the_filter_config_is_checked_and_chooses_the_strategys_filter():
    from bapo_megatron.config import load_config
    from bapo_megatron.errors import ConfigError
    from bapo_megatron.rollout.filtering import DropEqualRewards, KeepAll
    from bapo_megatron.rollout.modes import make_strategy

    core = spread_core(QuickEngine(), lambda i: True)
    cfg = load_config(None, ["rollout.filter_groups.enabled=true", "rollout.filter_groups.max_extra_rounds=3"])
    sieve = make_strategy(cfg, core).filter_groups
    assert isinstance(sieve, DropEqualRewards) and sieve.max_extra_rounds == 3
    assert type(make_strategy(load_config(None, ["rollout.mode=async"]), core).filter_groups) is KeepAll
    with pytest.raises(ConfigError, match="max_extra_rounds"):
        load_config(None, ["rollout.filter_groups.max_extra_rounds=-1"])
    with pytest.raises(ConfigError, match="no effect with rollout.replay"):
        load_config(None, ["rollout.filter_groups.enabled=true", "rollout.replay=x.safetensors"])

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

    async def generate(self, input_ids, sampling, rid):
        uid = rid.partition("#")[0]
        done = len(input_ids) - self.prompt_len
        self.sent.append((rid, done, sampling.max_new_tokens, asyncio.get_running_loop().time()))
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
        return Completion(rid, out, [-0.5] * len(out), finish)

    async def abort(self, rid=None):
        self.aborted.add(rid)

    async def health(self):
        return True

    def requests(self, uid):
        return [(done, max_new, start) for rid, done, max_new, start in self.sent if rid.startswith(uid + "#")]


def test_budgeted_requests_continue_at_once_and_the_rest_is_kept_for_next_step():
    engine = ScriptedEngine(prompt_len=3)
    counter = iter(range(10))

    def prompts():
        i = next(counter)
        return f"p{i}", [7, 8, 9], {"answer_ids": [STOP]}

    buffer = PartialRolloutBuffer(samples_per_prompt=2, max_new_tokens=12, token_budget=4, max_staleness=3)
    manager = RolloutManager(
        EnginePool([engine]),
        buffer,
        prompts,
        RewardWorkers("exact_ids", inline=True),
        SamplingParams(max_new_tokens=12, stop_token_ids=(STOP,)),
        prompts_per_step=1,
        oversample=2,
    )

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
    assert p01[1][2] - p01[0][2] < 8 * TICK
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

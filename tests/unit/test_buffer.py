"""The rollout buffer: budgets and rounds, resumption, versions, the staleness bound, round trip; and rewards."""

import json

import pytest

from bapo_megatron.common.protocol import Completion
from bapo_megatron.config import load_config
from bapo_megatron.rewards.functions import last_boxed, score
from bapo_megatron.rewards.workers import RewardWorkers
from bapo_megatron.rollout.buffer import RolloutBuffer


def _completion(n: int, finish: str, version: str, start: int = 0) -> Completion:
    ids = list(range(start, start + n))
    return Completion(
        rid="r", output_ids=ids, logprobs=[-0.1 * (i + 1) for i in ids], finish=finish, weight_version=version
    )


def _step(buffer: RolloutBuffer, version: int, finish: str = "length") -> None:
    buffer.drop_stale(version)
    for req in buffer.begin_requests():
        buffer.record(req, _completion(req.max_new_tokens, finish, str(version), len(req.sample.response_ids)), version)


def test_budgeted_requests_resume_with_the_partial_response():
    buffer = RolloutBuffer(samples_per_prompt=2, max_new_tokens=10, token_budget=4, max_staleness=5)
    buffer.add_group("p", [7, 8, 9])
    first = buffer.begin_requests()
    assert [r.max_new_tokens for r in first] == [4, 4] and first[0].input_ids == [7, 8, 9]
    _step(buffer, 0)
    second = buffer.begin_requests()
    assert second[0].input_ids == [7, 8, 9, 0, 1, 2, 3] and second[0].max_new_tokens == 4
    _step(buffer, 1)
    third = buffer.begin_requests()
    assert [r.max_new_tokens for r in third] == [2, 2]  # the remaining allowance, not the budget
    _step(buffer, 2)
    sample = buffer.groups["p"].samples[0]
    assert sample.finished and sample.finish == "length" and sample.response_ids == list(range(10))
    assert sample.versions == [0] * 4 + [1] * 4 + [2] * 2
    assert buffer.counters["resumed"] == 4
    assert buffer.take(10) == []  # no rewards yet
    for s in buffer.groups["p"].samples:
        s.reward = 1.0
    assert [g.uid for g in buffer.take(10)] == ["p"] and buffer.in_flight == 0


def test_stop_finishes_abort_does_not_and_duplicates_are_refused():
    buffer = RolloutBuffer(samples_per_prompt=1, max_new_tokens=10)
    buffer.add_group("p", [1])
    req = buffer.begin_requests()[0]
    buffer.record(req, _completion(3, "abort", "0"), 0)
    assert not req.sample.finished and len(req.sample.response_ids) == 3
    req = buffer.begin_requests()[0]
    buffer.record(req, _completion(2, "stop", "0", 3), 0)
    assert req.sample.finish == "stop"
    with pytest.raises(RuntimeError, match="duplicate completion"):
        buffer.record(req, _completion(1, "stop", "0"), 0)
    assert buffer.begin_requests() == []


def test_versions_come_from_the_engine_spans():
    buffer = RolloutBuffer(samples_per_prompt=1, max_new_tokens=10)
    buffer.add_group("p", [1])
    req = buffer.begin_requests()[0]
    completion = _completion(5, "length", "4")
    completion.version_spans = [("3", 0, 2), ("4", 2, 5)]
    buffer.record(req, completion, 3)
    assert req.sample.versions == [3, 3, 4, 4, 4]


def test_staleness_drops_exactly_when_the_oldest_token_is_too_old():
    buffer = RolloutBuffer(samples_per_prompt=2, max_new_tokens=20, token_budget=2, max_staleness=2)
    buffer.add_group("p", [1, 2])
    _step(buffer, 0)  # tokens of version 0
    _step(buffer, 1)
    _step(buffer, 2)  # version 2 - 0 = 2: not yet stale
    assert buffer.counters["dropped_stale"] == 0
    busy = frozenset({"p/1"})
    assert buffer.drop_stale(3, busy) == 1  # 3 - 0 > 2: p/0 dropped and restarted; p/1 is generating: kept
    requests = buffer.begin_requests(busy)
    assert buffer.counters["dropped_stale"] == 1 and [r.sample.uid for r in requests] == ["p/0"]
    assert requests[0].input_ids == [1, 2] and buffer.groups["p"].samples[0].regenerated == 1
    assert len(buffer.groups["p"].samples[1].response_ids) == 6


def test_state_dict_round_trip_is_exact():
    buffer = RolloutBuffer(samples_per_prompt=3, max_new_tokens=9, token_budget=3, max_staleness=1)
    buffer.add_group("a", [1, 2], {"answer": "4"})
    buffer.add_group("b", [3])
    _step(buffer, 0)
    buffer.groups["a"].samples[1].reward = 0.5
    state = json.loads(json.dumps(buffer.state_dict()))  # it is plain JSON
    restored = RolloutBuffer(samples_per_prompt=3, max_new_tokens=9, token_budget=3, max_staleness=1)
    restored.load_state_dict(state)
    assert restored.state_dict() == buffer.state_dict()
    assert [r.input_ids for r in restored.begin_requests()] == [r.input_ids for r in buffer.begin_requests()]
    other = RolloutBuffer(samples_per_prompt=3, max_new_tokens=12, token_budget=3, max_staleness=1)
    with pytest.raises(ValueError, match="saved with"):
        other.load_state_dict(state)


def test_groups_with_equal_rewards_are_set_aside_fill_a_short_take_and_round_trip():
    buffer = RolloutBuffer(samples_per_prompt=2, max_new_tokens=2, max_staleness=1)
    for uid, rewards in (("a", (0.0, 0.0)), ("b", (0.0, 1.0)), ("c", (1.0, 1.0)), ("d", ())):  # d: unscored
        buffer.add_group(uid, [1])
        _step(buffer, 0, "stop")  # a version-0 token each
        for s, r in zip(buffer.groups[uid].samples, rewards, strict=False):
            buffer.apply_reward(s, s.response_ids, (r, None))
    assert buffer.set_aside_equal() == 2 and [g.uid for g in buffer.set_aside] == ["a", "c"]
    assert list(buffer.groups) == ["b", "d"] and buffer.complete == 1 and buffer.counters["set_aside"] == 2
    state = json.loads(json.dumps(buffer.state_dict()))
    restored = RolloutBuffer(samples_per_prompt=2, max_new_tokens=2, max_staleness=1)
    restored.load_state_dict(state)
    assert restored.state_dict() == state and [g.uid for g in restored.set_aside] == ["a", "c"]
    old = dict(state, counters={k: v for k, v in state["counters"].items() if k != "set_aside"})
    del old["set_aside"]  # a checkpoint written before the filter
    restored.load_state_dict(old)
    assert restored.set_aside == [] and restored.counters["set_aside"] == 0
    assert [g.uid for g in buffer.take(3)] == ["b", "a", "c"]  # the one that differs, then the oldest set aside
    assert buffer.set_aside == [] and buffer.taken == 3
    buffer.add_group("e", [1])
    _step(buffer, 0, "stop")
    for s in buffer.groups["e"].samples:
        buffer.apply_reward(s, s.response_ids, (0.0, None))
    buffer.set_aside_equal()
    buffer.drop_stale(2)  # its version-0 tokens are too old for version 2: never trained, discarded
    assert buffer.set_aside == [] and buffer.take(1) == []


def test_the_bound_masks_instead_of_dropping_with_mask_stale_prefix():
    masked = RolloutBuffer(1, max_new_tokens=20, token_budget=2, max_staleness=2, mask_stale_prefix=True)
    plain = RolloutBuffer(1, max_new_tokens=20, token_budget=2, max_staleness=2)
    for buffer in (masked, plain):
        buffer.add_group("p", [1])
        for version in (1, 2, 3):
            _step(buffer, version)  # each drops first: nothing is stale yet at 3 - 2
    assert [s.versions for s in masked.samples()] == [[1, 1, 2, 2, 3, 3]]
    assert masked.drop_stale(4) == 0 and plain.drop_stale(4) == 1  # 4 - 1 > 2: dropped, or kept for masking
    sample = next(masked.samples())
    assert masked.loss_mask(sample, 4) == [0, 0, 1, 1, 1, 1]  # only versions >= 4 - 2 train at version 4
    assert masked.loss_mask(sample, 3) == [1] * 6 and plain.loss_mask(sample, 4) is None


def test_rounds_begin_at_each_step_and_when_a_round_is_used_up():
    buffer = RolloutBuffer(samples_per_prompt=1, max_new_tokens=20, token_budget=4)
    buffer.add_group("p", [1])
    buffer.begin_step()
    (req,) = buffer.begin_requests()
    buffer.record(req, _completion(3, "abort", "0"), 0)  # cut short inside its round
    (req,) = buffer.begin_requests()
    assert req.max_new_tokens == 1 and buffer.rounds == 1  # the rest of the round, not a new one
    buffer.record(req, _completion(1, "length", "0", 3), 0)
    (req,) = buffer.begin_requests()
    assert req.max_new_tokens == 4 and buffer.rounds == 2  # used up: the next round
    buffer.record(req, _completion(2, "abort", "0", 4), 0)
    buffer.begin_step()  # a new step begins a new round, whatever is left of the last one
    (req,) = buffer.begin_requests()
    assert req.max_new_tokens == 4 and buffer.rounds == 1


def test_finished_groups_become_the_training_batch(tmp_path):
    from bapo_megatron.common.batch import RolloutBatch

    buffer = RolloutBuffer(samples_per_prompt=2, max_new_tokens=6, token_budget=3, max_staleness=5)
    buffer.add_group("a", [7, 8])
    buffer.add_group("b", [9])
    for version in (1, 2):
        _step(buffer, version)
    for g in buffer.groups.values():
        for i, s in enumerate(g.samples):
            s.reward = float(i)
    with pytest.raises(ValueError, match="group 'a' is not complete"):
        buffer.groups["a"].samples[0].reward = None
        RolloutBatch.from_groups(list(buffer.groups.values()), temperature=0.7)
    buffer.groups["a"].samples[0].reward = 0.0
    groups = buffer.take(10)
    masks = [[[0, 0, 0, 1, 1, 1]] * 2] * 2
    batch = RolloutBatch.from_groups(groups, temperature=0.7, metadata={"step": "3"}, loss_masks=masks)
    assert [s.group for s in batch.samples] == [0, 0, 1, 1] and [s.reward for s in batch.samples] == [0, 1, 0, 1]
    first = batch.samples[0]
    assert first.prompt_ids == [7, 8] and first.response_ids == list(range(6))
    assert first.versions == [1, 1, 1, 2, 2, 2] and first.loss_mask == [0, 0, 0, 1, 1, 1]
    assert first.behaviour_logprobs == groups[0].samples[0].logprobs
    assert json.loads(batch.metadata["group_uids"]) == ["a", "b"] and batch.metadata["step"] == "3"
    assert RolloutBatch.from_groups(groups, temperature=0.7).samples[0].loss_mask is None  # every token counts
    batch.save(tmp_path / "step3.safetensors")
    loaded = RolloutBatch.load(tmp_path / "step3.safetensors")
    assert loaded.temperature == 0.7 and loaded.metadata == batch.metadata
    for got, want in zip(loaded.samples, batch.samples, strict=True):  # log-probs stored as float32
        assert got.behaviour_logprobs == pytest.approx(want.behaviour_logprobs, rel=1e-7)
        assert (got.prompt_ids, got.response_ids, got.versions, got.loss_mask, got.reward, got.group) == (
            want.prompt_ids,
            want.response_ids,
            want.versions,
            want.loss_mask,
            want.reward,
            want.group,
        )


def test_rewards_boxed_math_and_failures():
    assert last_boxed(r"so \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert score("math", r"The answer is \boxed{\frac{1}{2}}.", [], {"answer": "0.5"}) == (1.0, None)
    assert score("math", r"The answer is \boxed{3}.", [], {"answer": "0.5"}) == (0.0, None)
    assert score("exact_ids", "", [5, 6, 2], {"answer_ids": [5, 6], "stop_ids": [2]}) == (1.0, None)
    value, error = score("exact_ids", "", [5], {})  # no answer_ids: the verifier throws
    assert value == 0.0 and error.startswith("KeyError")
    import asyncio

    workers = RewardWorkers("exact_ids", inline=True)
    assert asyncio.run(workers("", [1], {})).value == 0.0 and workers.failures == 1
    with pytest.raises(ValueError, match="unknown reward"):
        RewardWorkers("nope")


def test_routes_are_recorded_across_a_resumption_and_kept_in_checkpoints():
    """A MoE sample keeps the routes of every position it ran, as its engine's client checked and
    decoded them (Completion.routes; engines/client.py): a continuation asks for every position again
    and its answer's routes replace the held ones (the engine ran the prefix again, maybe under new
    weights that route it otherwise, and computed the new tokens over that run); a completion without
    them keeps nothing; a reset forgets them; the checkpoint state holds them (torch's weights-only
    loader reads it back)."""
    import io

    import torch

    from bapo_megatron.common.batch import RolloutBatch
    from bapo_megatron.common.routes import RouteShape

    shape = RouteShape(num_layers=3, sparse_layers=(1, 2), top_k=2, num_experts=4)
    buffer = RolloutBuffer(samples_per_prompt=1, max_new_tokens=5, token_budget=3, max_staleness=5, routes=shape)
    buffer.add_group("p", [7, 8, 9])

    def checked_routes(first: int, last: int, shift: int = 0) -> bytes:  # position t: (t % 4, (t + 1) % 4) shifted
        return shape.to_bytes(torch.tensor([[[(t + shift) % 4, (t + shift + 1) % 4]] * 2 for t in range(first, last)]))

    req = buffer.begin_requests()[0]
    assert req.routes_from == 0
    done = _completion(3, "length", "0")
    done.routes = checked_routes(0, 5)  # 3 prompt + 3 output tokens: positions 0..4 ran
    buffer.record(req, done, 0)
    req = buffer.begin_requests()[0]
    assert req.routes_from == 0 and req.input_ids == [7, 8, 9, 0, 1, 2]
    queued = _completion(0, "abort", "0")
    queued.routes = b""  # aborted while queued: ran no position, the routes held stay
    buffer.record(req, queued, 0)
    assert shape.positions(req.sample.routes) == 5
    with pytest.raises(RuntimeError, match="p/0: a completion without the routes its request asked for"):
        buffer.record(req, _completion(2, "stop", "0", 3), 0)
    assert len(req.sample.response_ids) == 3  # nothing of it was kept
    done = _completion(2, "stop", "0", 3)
    done.routes = checked_routes(0, 7, shift=1)  # the prefix routed otherwise this time
    buffer.record(req, done, 0)
    sample = req.sample
    routes = shape.from_bytes(sample.routes)
    assert routes.dtype == torch.uint8 and routes.shape == (7, 2, 2)
    assert routes[:, 0, 0].tolist() == [(t + 1) % 4 for t in range(7)]  # the latest run's, every position
    held = io.BytesIO()
    torch.save(buffer.state_dict(), held)
    held.seek(0)
    restored = RolloutBuffer(samples_per_prompt=1, max_new_tokens=5, token_budget=3, max_staleness=5, routes=shape)
    restored.load_state_dict(torch.load(held, weights_only=True))
    assert restored.groups["p"].samples[0].routes == sample.routes
    sample.reward = 1.0
    batch = RolloutBatch.from_groups(buffer.take(1), 1.0, routes=shape)
    assert torch.equal(batch.samples[0].routes, routes)  # one per position but the last

    sample.reset()
    assert sample.routes == b""


def test_a_steps_groups_become_its_batch_and_figures_under_the_staleness_bound():
    """The buffer hands a step its batch (the stale prefix masked, the version in the metadata) and
    the figures of what it trains on: staleness per token at the policy version, the share beyond
    the bound, truncation at max_new_tokens."""
    buffer = RolloutBuffer(2, max_new_tokens=6, token_budget=2, max_staleness=1, mask_stale_prefix=True)
    buffer.add_group("p", [1])
    for version in (1, 2, 3):
        _step(buffer, version)  # each sample: versions [1, 1, 2, 2, 3, 3], truncated at 6
    for i, s in enumerate(buffer.groups["p"].samples):
        s.reward = float(i)
    groups = buffer.take(1)
    batch = buffer.batch(groups, 3, temperature=0.5)
    assert batch.metadata["version"] == "3" and batch.temperature == 0.5
    assert [s.loss_mask for s in batch.samples] == [[0, 0, 1, 1, 1, 1]] * 2  # 3 - 1: versions 2 and 3 train
    figures = buffer.batch_figures(groups, 3)
    assert figures["rollout/reward_mean"] == 0.5 and figures["rollout/truncated"] == 1.0
    assert figures["rollout/token_staleness_max"] == 2.0 and figures["rollout/stale_masked_share"] == 1 / 3
    assert [figures[f"rollout/staleness_share/{k}"] for k in range(3)] == [1 / 3] * 3
    assert figures["rollout/response_length"] == 6 and figures["rollout/token_staleness_mean"] == 1.0
    plain = RolloutBuffer.from_config(load_config(None, ["rollout.max_staleness=7"]).rollout)
    assert (plain.max_staleness, plain.mask_stale_prefix, plain.routes) == (7, False, None)

"""A group's requests in one /generate call (SGLang's batch form, common/generate_batch.py).

The body the client sends is taken by SGLang 0.5.23's own GenerateReqInput (compiled from its wheel,
normalize_batch_and_arguments) as exactly the requests it stands for; the embedded engine spreads a
batch as SGLang does, refuses a batch with one bad row whole (nothing queued, no adapter held), and
answers each row as it answers the same request alone; a row stays abortable by its rid. The client
checks each row's answer as a single answer and fails every row of an answer that is no list of one
per row; a caller that gives up has its row aborted while the rest of the call goes on. A sync
rollout step sends each group's samples in one call; the modes that cut part of a group send one
call a sample.
"""

import asyncio
import json

import pytest

from bapo_megatron.common import generate_batch, protocol
from bapo_megatron.common.protocol import SamplingParams
from bapo_megatron.engines.client import BadAnswer, EngineClient, EngineError
from bapo_megatron.engines.pool import EnginePool
from bapo_megatron.rewards.workers import RewardWorkers
from bapo_megatron.rollout.buffer import RolloutBuffer
from bapo_megatron.rollout.core import Calls, RolloutCore
from bapo_megatron.rollout.filtering import DropEqualRewards
from bapo_megatron.rollout.strategies import AbortSteps, AsyncStream, DeterministicRounds, RetractSteps
from tests.sglang_wheel import load_defs

NAME = "qwen2-gqa2"


def _sglang_request_class(wheel):
    """SGLang's GenerateReqInput, its code unchanged; the names its batch path never reaches are stubs."""

    class Stub:
        pass

    import copy
    import uuid
    from collections import Counter

    names = {
        "copy": copy,
        "uuid": uuid,
        "Counter": Counter,
        "has_valid_data": lambda data: data is not None,
        "get_return_hidden_states_mode": lambda mode: mode,
        "decode_kv_hints_envelope": lambda value: value,
        "KvHintsEnvelope": Stub,
        "PositionalEmbeds": Stub,
    }
    return load_defs(wheel, {"managers/io_struct.py": ["GenerateReqInput"]}, names)["GenerateReqInput"]


def _rows() -> list[dict]:
    """Three requests of one group as the rollout sends them: their own lengths, budgets and seeds,
    an adapter named by two (a request across an adapter update may name the older one)."""
    rows = []
    for i, (ids, lora) in enumerate([([5, 9, 17], "policy-v3"), ([5, 9, 17, 4], None), ([5, 9], "policy-v2")]):
        sampling = SamplingParams(max_new_tokens=6 - i, temperature=0.7, stop_token_ids=(2,), sampling_seed=40 + i)
        row = protocol.generate_request(ids, sampling, f"p0/{i}#{i + 1}", routed_experts_start_len=0)
        if lora is not None:
            row["lora_path"] = lora
        rows.append(row)
    return rows


SGLANG_ROW_FIELDS = ("rid", "input_ids", "sampling_params", "lora_path", "return_logprob", "logprob_start_len")
SGLANG_SHARED_FIELDS = ("stream", "return_routed_experts", "routed_experts_start_len")


def test_sglang_takes_our_batch_as_exactly_the_requests_it_holds(wheel):
    request_class = _sglang_request_class(wheel)
    rows = _rows()
    body = generate_batch.batch_request(rows)
    obj = request_class(**body)
    obj.normalize_batch_and_arguments()
    assert not obj.is_single and obj.batch_size == len(rows)
    for i, row in enumerate(rows):
        single = request_class(**row)
        single.normalize_batch_and_arguments()
        assert single.is_single
        for name in SGLANG_ROW_FIELDS + SGLANG_SHARED_FIELDS:  # the batch's row i is the request sent alone
            assert getattr(obj[i], name) == getattr(single, name), (i, name)
    assert generate_batch.split_batch(body) == rows  # and the embedded engine's reading of it


def test_the_embedded_engine_spreads_a_batch_as_sglang_does(wheel):
    """Fields given once for all rows (a rid prefix, one sampling dict, one adapter) hold for every row,
    as SGLang spreads them; a rid list of another length and a rid repeated are refused by both."""
    request_class = _sglang_request_class(wheel)
    body = {
        "input_ids": [[1, 2], [3], [4, 5, 6]],
        "rid": "g",
        "sampling_params": {"max_new_tokens": 2},
        "lora_path": "a1",
        "return_logprob": True,
    }
    obj = request_class(**json.loads(json.dumps(body)))
    obj.normalize_batch_and_arguments()
    for i, row in enumerate(generate_batch.split_batch(body)):
        assert {name: getattr(obj[i], name) for name in row} == row
    for bad in ({"rid": ["a", "b"]}, {"rid": ["a", "b", "a"]}):
        with pytest.raises(ValueError):
            generate_batch.split_batch({**body, **bad})
        with pytest.raises(ValueError):
            request_class(**{**body, **bad}).normalize_batch_and_arguments()
    with pytest.raises(ValueError, match="sampling_params: 2 values for a batch of 3"):
        generate_batch.split_batch({**body, "sampling_params": [{}, {}]})
    with pytest.raises(ValueError, match=r"rows differ in \['routed_experts_start_len'\]"):
        generate_batch.batch_request([_rows()[0], {**_rows()[1], "routed_experts_start_len": 2}])


# -- the embedded engine, in-process over HTTP ----------------------------------------------------------
@pytest.fixture(scope="module")
def core(hf_model):
    from bapo_megatron.engines.embedded.core import EngineCore

    return EngineCore(hf_model(NAME), max_batch=8, batch_invariant=True)  # alone or together: the same bits


def _serve(core, fn):
    """fn(client, server) against a fresh embedded server over `core`, over HTTP, counting /generate calls."""
    from aiohttp.test_utils import TestServer

    from bapo_megatron.engines.embedded.server import EmbeddedServer

    async def run():
        server = EmbeddedServer(core)
        async with TestServer(server.app()) as http, EngineClient(str(http.make_url("")), retries=0) as client:
            calls, request = [], client.request

            async def counted(path, body=None, *args, **kwargs):
                if path == "/generate":
                    calls.append(body)
                return await request(path, body, *args, **kwargs)

            client.request = counted
            return await fn(client, server, calls)

    return asyncio.run(run())


def _seeded(i: int, n: int = 5) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.9, ignore_eos=True, sampling_seed=7 + i)


PROMPTS = ([5, 9, 17], [3, 1, 4, 1, 5], [8, 8])


def test_a_batch_is_answered_as_its_requests_one_by_one(core):
    async def run(client, server, calls):
        alone = [await client.generate(p, _seeded(i), f"alone-{i}") for i, p in enumerate(PROMPTS)]
        sent = len(calls)
        together = await asyncio.gather(
            *(client.generate(p, _seeded(i), f"g/{i}", together="g") for i, p in enumerate(PROMPTS))
        )
        return alone, together, calls[sent:]

    alone, together, calls = _serve(core, run)
    assert len(calls) == 1 and generate_batch.is_batch(calls[0]) and calls[0]["rid"] == ["g/0", "g/1", "g/2"]
    for a, b, i in zip(alone, together, range(3), strict=True):
        assert b.rid == f"g/{i}" and len(b.output_ids) == 5
        assert (a.output_ids, a.logprobs) == (b.output_ids, b.logprobs)  # seeded: the same tokens and log-probs
        assert b.weight_version == a.weight_version and b.prompt_tokens == len(PROMPTS[i])


def test_a_batch_with_one_bad_row_is_refused_whole_and_nothing_runs(core):
    """The third row names an adapter that is not loaded: 400 naming it; no row was queued."""

    async def run(client, server, calls):
        bodies = [protocol.generate_request(p, _seeded(i), f"r{i}") for i, p in enumerate(PROMPTS)]
        bodies[2]["lora_path"] = "missing"
        with pytest.raises(EngineError, match="lora_path='missing': no adapter of that name") as err:
            await client.request("/generate", generate_batch.batch_request(bodies), retry=False)
        too_long = [*bodies[:2], protocol.generate_request([1] * 10, SamplingParams(max_new_tokens=1 << 20), "r9")]
        with pytest.raises(EngineError, match="exceed the model's context length"):
            await client.request("/generate", generate_batch.batch_request(too_long), retry=False)
        return err.value.status, core.busy, dict(server.loras._users)

    status, busy, users = _serve(core, run)
    assert status == 400 and not busy and users == {}


def test_a_row_aborted_by_its_rid_ends_alone_and_the_rest_of_its_call_runs_on(core):
    async def run(client, server, calls):
        await client.pause("in_place")  # rows wait in the queue until we continue
        rows = [client.generate(p, _seeded(i, 4), f"h/{i}", together="h") for i, p in enumerate(PROMPTS)]
        answers = asyncio.gather(*rows)
        while len(core.queue.matching(None)) < 3:  # all three queued
            await asyncio.sleep(0.01)
        await client.abort("h/1")
        await client.resume()
        return await answers

    first, aborted, last = _serve(core, run)
    assert aborted.finish == "abort" and aborted.output_ids == []
    assert first.finish == last.finish == "length" and len(first.output_ids) == len(last.output_ids) == 4


def test_a_client_that_goes_away_stops_every_row_of_its_batch(core):
    async def run(client, server, calls):
        long = SamplingParams(max_new_tokens=2000, ignore_eos=True)
        rows = [protocol.generate_request([1, 2, 3], long, f"gone/{i}") for i in range(2)]
        request = asyncio.ensure_future(client.request("/generate", generate_batch.batch_request(rows), retry=False))
        while len(core.running) < 2:
            await asyncio.sleep(0.01)
        request.cancel()  # the connection closes mid-generation
        for _ in range(3000):  # a state to reach, not a time to wait: up to 30 s on a busy machine
            if not core.busy:
                return True
            await asyncio.sleep(0.01)
        return False

    assert _serve(core, run), "the rows kept generating after their client went away"


# -- the client, against an engine that answers as it is told ------------------------------------------
class Scripted:
    """/generate answers each row with one token (`spoil(rows, answers)` may change them before they go),
    once `release` is set; /abort_request records the rid."""

    def __init__(self, spoil=None) -> None:
        self.spoil, self.release, self.aborted, self.calls = spoil, asyncio.Event(), [], []

    def app(self):
        from aiohttp import web

        async def generate(request):
            body = await request.json()
            self.calls.append(body)
            batch = generate_batch.is_batch(body)
            rows = generate_batch.split_batch(body) if batch else [body]
            await self.release.wait()
            answers = [
                protocol.generate_response(r["rid"], [3], [-0.5], {"type": "length"}, len(r["input_ids"]), "0", [])
                for r in rows
            ]
            if self.spoil is not None:
                answers = self.spoil(rows, answers)
            return web.json_response(answers if batch else answers[0])

        async def abort(request):
            self.aborted.append((await request.json())["rid"])
            return web.Response(status=200)

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_post("/abort_request", abort)
        return app


def _client_run(engine: Scripted, fn):
    from aiohttp.test_utils import TestServer

    async def run():
        async with TestServer(engine.app()) as http, EngineClient(str(http.make_url("")), retries=0) as client:
            return await fn(client)

    return asyncio.run(run())


def _ask(client, engine, n=3, key="k"):
    tasks = [
        asyncio.ensure_future(client.generate([4, 5], SamplingParams(2), f"q/{i}", together=key)) for i in range(n)
    ]
    engine.release.set()
    return asyncio.gather(*tasks, return_exceptions=True)


SPOILED = {
    "no list": (lambda rows, answers: answers[0], "a batch of 3: dict, not one answer a row"),
    "a row short": (lambda rows, answers: answers[:2], "a batch of 3: a list of 2, not one answer a row"),
    "out of order": (lambda rows, answers: answers[::-1], "the answer in its place is for"),
}


@pytest.mark.parametrize("name", list(SPOILED))
def test_an_answer_that_is_no_list_of_one_per_row_fails_every_row(name):
    spoil, phrase = SPOILED[name]
    engine = Scripted(spoil)
    results = _client_run(engine, lambda client: _ask(client, engine))
    assert len(engine.calls) == 1
    if name == "out of order":  # the middle row is in its place
        results = [results[0], results[2]]
    assert all(isinstance(r, BadAnswer) and phrase in str(r) for r in results), results


def test_one_wrong_row_fails_alone():
    def spoil(rows, answers):
        answers[1]["output_ids"] = [3, 3, 3]  # more than max_new_tokens 2
        answers[1]["meta_info"]["output_token_logprobs"] = [[-0.5, 3, None]] * 3
        return answers

    engine = Scripted(spoil)
    first, wrong, last = _client_run(engine, lambda client: _ask(client, engine))
    assert isinstance(wrong, BadAnswer) and "q/1: 3 output tokens for max_new_tokens 2" in str(wrong)
    assert first.output_ids == last.output_ids == [3]


def test_a_caller_that_gives_up_has_its_row_aborted_and_the_others_are_answered():
    engine = Scripted()

    async def run(client):
        tasks = [
            asyncio.ensure_future(client.generate([4], SamplingParams(2), f"c/{i}", together="c")) for i in range(3)
        ]
        while not engine.calls:
            await asyncio.sleep(0.01)
        tasks[0].cancel()
        while not engine.aborted:
            await asyncio.sleep(0.01)
        engine.release.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    cancelled, *answered = _client_run(engine, run)
    assert isinstance(cancelled, asyncio.CancelledError) and engine.aborted == ["c/0"]
    assert [a.rid for a in answered] == ["c/1", "c/2"] and len(engine.calls) == 1


# -- the rollout -------------------------------------------------------------------------------------------
def _strategy(kind, url, **options):
    counter = iter(range(100))
    core = RolloutCore(
        EnginePool([EngineClient(url, retries=0)]),
        RolloutBuffer(4, max_new_tokens=2, token_budget=None, max_staleness=1),
        lambda: (f"p{next(counter)}", [4, 5], {"answer_ids": [3]}),
        RewardWorkers("exact_ids", inline=True),
        SamplingParams(max_new_tokens=2),
    )
    return kind(core, prompts_per_step=2, **options)


CALLS = {  # a strategy and its options -> requests a call: "group" (a group's four), "round" (all), 1
    "AbortSteps": (AbortSteps, {}, "group"),
    "AbortSteps round": (AbortSteps, {"round_calls": True}, "round"),
    "AbortSteps round oversampled": (AbortSteps, {"round_calls": True, "oversample": 1.5}, "group"),
    "DeterministicRounds": (DeterministicRounds, {}, "group"),
    "DeterministicRounds round": (DeterministicRounds, {"round_calls": True}, "round"),
    "RetractSteps": (RetractSteps, {}, 1),
    "AsyncStream": (AsyncStream, {}, 1),
}


@pytest.mark.filterwarnings("ignore:step .* trains on nothing:UserWarning")
@pytest.mark.parametrize("name", list(CALLS))
def test_requests_share_the_calls_their_strategy_waits_for_together(name):
    """A sync step sends a group's requests in one call; with round calls, all of a round's where the
    step needs every group it draws (else a group's: an oversampled or filtered step cuts or replaces
    groups while others run); the cutting and asynchronous modes one call a sample."""
    kind, options, calls = CALLS[name]
    engine = Scripted()
    engine.release.set()

    async def run(client):
        steps = _strategy(kind, str(client.base_url), **options)
        groups, _ = await steps.batch(0)
        await steps.close()
        for c in steps.pool.clients:
            await c.close()
        return groups

    groups = _client_run(engine, run)
    assert [g.uid for g in groups] == ["p0", "p1"]
    rids = [body["rid"] if isinstance(body["rid"], list) else [body["rid"]] for body in engine.calls]
    if calls == "round":  # (the engine answers one token: two rounds) every request of a round in one call
        assert len(rids) == 2 and all(len(r) == 8 for r in rids), rids
    elif calls == "group":
        assert all(len(r) == 4 for r in rids)  # every round of a group's four samples in one call
        assert all(len({rid.partition("/")[0] for rid in r}) == 1 for r in rids)  # one group a call
    else:
        assert all(len(r) == 1 for r in rids) and len(rids) >= 8


def test_round_calls_fall_back_to_a_group_a_call_where_a_step_replaces_groups():
    filtered = _strategy(AbortSteps, "http://127.0.0.1:9", round_calls=True, filter_groups=DropEqualRewards(1))
    assert filtered.calls is Calls.GROUP
    assert _strategy(AbortSteps, "http://127.0.0.1:9", round_calls=True).calls is Calls.ROUND

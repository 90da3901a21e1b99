"""Engine answers checked in full on arrival, and saved batches on load, against the model's shape.

An engine (HTTP, in this process) answers /generate with one thing wrong at a time; the client
raises BadAnswer naming the engine's URL, the request and what is wrong, and keeps nothing of it.
Before: a token outside the vocabulary (999 for a 250-token model) was trained on through a
padding row of the embedding, and routes naming one expert twice in a top-k were replayed and
trained on, silently; routes out of range, not base64 or one position short ended the run with
a traceback blamed on our side ("internal"). In a rollout the engine that answered wrongly is
retired and its request goes to another; the third retirement of a run stops it with one line.
So in a held-out evaluation and in the weight probe: before, there a wrong answer only marked its
engine dead, unnamed and uncounted, and an external engine (never restarted) came back, was given
the weights and answered wrongly again, without end.

A saved batch whose routes do not fit the model (expert 4 of 4, 2 MoE layers for 3, top-3 for
top-2) passed the batch checks and failed inside Megatron's router once the model was built;
`RolloutBatch.problem` now names it before any model is built.
"""

import asyncio
import base64
import json
import math
import types

import pytest
import torch
from aiohttp.test_utils import TestServer

from bapo_megatron.common import protocol
from bapo_megatron.common.batch import RolloutBatch, Sample
from bapo_megatron.common.generate_batch import is_batch, split_batch
from bapo_megatron.common.protocol import SamplingParams
from bapo_megatron.common.routes import RouteShape
from bapo_megatron.config import load_config
from bapo_megatron.engines.client import BadAnswer, EngineClient, ServedModel
from bapo_megatron.engines.loop import EngineLoop
from bapo_megatron.engines.pool import MAX_RETIRED, EnginePool
from bapo_megatron.errors import RunStopped
from bapo_megatron.models.spec import tiny_spec
from bapo_megatron.rewards.workers import RewardWorkers
from bapo_megatron.rollout.buffer import RolloutBuffer
from bapo_megatron.rollout.core import RolloutCore
from bapo_megatron.rollout.evaluation import EvalSet, HeldOut
from bapo_megatron.rollout.strategies import AbortSteps
from bapo_megatron.weights.engine_updates import EngineUpdates

MOE = tiny_spec("qwen3_moe")  # 250 tokens; 4 layers, MoE in 1-3, 4 experts, top-2
SHAPE = RouteShape.of(MOE)
PROMPT = [7, 8, 9]
OUTPUT = [5, 6, 2]


def routes_of(positions: int, first: int = 0) -> torch.Tensor:
    """Position t's experts, (t % 4, (t + 1) % 4) in every MoE layer, zeros in the dense one (SGLang's)."""
    rows = [[[0, 0]] + [[t % 4, (t + 1) % 4]] * 3 for t in range(first, first + positions)]
    return torch.tensor(rows, dtype=torch.int32)


def answer(rid: str, routes_from: int | None, input_len: int) -> dict:
    """A right answer to a request of input_len tokens: OUTPUT, and the routes of every position run."""
    positions = input_len + len(OUTPUT) - 1 - (routes_from or 0)
    routes = protocol.encode_routed_experts(routes_of(positions)) if routes_from is not None else None
    return protocol.generate_response(rid, OUTPUT, [-0.5, -1.5, -0.25], {"type": "stop"}, input_len, "0", [], routes)


def set_token(body: dict, index: int, token) -> None:
    body["output_ids"][index] = token
    body["meta_info"]["output_token_logprobs"][index][1] = token


def set_logprob(body: dict, index: int, value) -> None:
    body["meta_info"]["output_token_logprobs"][index][0] = value


def set_routes(body: dict, routes: torch.Tensor) -> None:
    body["meta_info"]["routed_experts"] = protocol.encode_routed_experts(routes)


def repeated_expert(body: dict) -> None:
    routes = routes_of(5)
    routes[3, 2] = torch.tensor([1, 1])  # position 3, MoE layer 2: expert 1 twice
    set_routes(body, routes)


def expert_past_the_last(body: dict) -> None:
    routes = routes_of(5)
    routes[1, 3, 0] = 4  # 4 experts: ids 0-3
    set_routes(body, routes)


WRONG = {
    "token outside the vocabulary": (
        lambda b: set_token(b, 1, 999),
        "output_ids: token id 999 outside the model's vocabulary [0, 250) (at index 1)",
    ),
    "negative token": (lambda b: set_token(b, 0, -3), "token id -3 is not an integer >= 0"),
    "fractional token": (lambda b: set_token(b, 2, 5.5), "token id 5.5 is not an integer >= 0"),
    "nan log-prob": (lambda b: set_logprob(b, 0, math.nan), "log-prob nan is not a finite number <= 0"),
    "infinite log-prob": (lambda b: set_logprob(b, 1, -math.inf), "log-prob -inf is not a finite number <= 0"),
    "positive log-prob": (lambda b: set_logprob(b, 2, 0.01), "log-prob 0.01 is not a finite number <= 0"),
    "one log-prob short": (
        lambda b: b["meta_info"]["output_token_logprobs"].pop(),
        "3 output ids but 2 output_token_logprobs",
    ),
    "more tokens than asked": (
        lambda b: [b["output_ids"].append(4), b["meta_info"]["output_token_logprobs"].append([-1.0, 4, None])],
        "4 output tokens for max_new_tokens 3",
    ),
    "routes repeating an expert": (
        repeated_expert,
        "routes name one expert twice in a top-2 (position 3, MoE layer 2: experts [1, 1])",
    ),
    "routes past the experts": (expert_past_the_last, "routes hold expert ids in [0, 4], not [0, 4)"),
    "routes not base64": (
        lambda b: b["meta_info"].update(routed_experts="%%%"),
        "meta_info.routed_experts: not base64",
    ),
    "routes one position short": (
        lambda b: set_routes(b, routes_of(4)),
        "meta_info: routed_experts for 4 positions, expected 5",
    ),
    "routes of another layer count": (
        lambda b: b["meta_info"].update(routed_experts=base64.b64encode(bytes(4 * 5 * 3 * 2)).decode()),
        "120 bytes are no whole number of positions of 4 layers x top-2",
    ),
    "routes missing": (lambda b: b["meta_info"].pop("routed_experts"), "meta_info.routed_experts: missing"),
}


class Engine:
    """An engine in this process: /generate answers right, unless `wrong` spoils the answer; abort answers."""

    def __init__(self, wrong=None) -> None:
        self.wrong = wrong
        self.answered = 0

    def one(self, body: dict) -> dict:
        routes_from = body.get("routed_experts_start_len") if body.get("return_routed_experts") else None
        out = answer(body["rid"], routes_from, len(body["input_ids"]))
        if self.wrong is not None:
            self.wrong(out)
        self.answered += 1
        return out

    def app(self):
        from aiohttp import web

        async def generate(request):
            body = await request.json()
            batch = is_batch(body)  # a group's requests in one call (SGLang's batch form): a list back
            outs = [self.one(row) for row in (split_batch(body) if batch else [body])]
            # json.dumps writes NaN and Infinity as Python (and aiohttp's client) reads them back
            return web.Response(text=json.dumps(outs if batch else outs[0]), content_type="application/json")

        async def abort(request):
            return web.Response(status=200)

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_post("/abort_request", abort)
        return app


async def serving(engines: list[Engine], run):
    """run(urls) with each engine answering on a port of its own."""
    from aiohttp.test_utils import TestServer

    servers = [TestServer(e.app()) for e in engines]
    for server in servers:
        await server.start_server()
    try:
        return await run([str(server.make_url("")).rstrip("/") for server in servers])
    finally:
        for server in servers:
            await server.close()


def ask(wrong, routes_from: int | None = 0, max_new_tokens: int = 3):
    """One /generate call, with routes from position routes_from on, to an engine answering `wrong`ly."""

    async def run(urls):
        async with EngineClient(urls[0], retries=0, served=ServedModel.of(MOE, SHAPE)) as client:
            return urls[0], await client.generate(PROMPT, SamplingParams(max_new_tokens), "p0/1#4", routes_from)

    return asyncio.run(serving([Engine(wrong)], run))


def test_a_right_answer_passes_with_its_routes():
    _, completion = ask(None)
    assert completion.output_ids == OUTPUT and completion.logprobs == [-0.5, -1.5, -0.25]
    # kept decoded, as a sample stores them: the MoE layers' rows of the 5 positions run
    assert torch.equal(SHAPE.from_bytes(completion.routes), routes_of(5)[:, 1:].to(torch.uint8))
    assert ask(None, routes_from=None)[1].routes is None  # none asked for
    _, tiny_above_zero = ask(lambda b: set_logprob(b, 0, 1e-7))  # a kernel's rounding: let through, as it came
    assert tiny_above_zero.logprobs[0] == 1e-7


@pytest.mark.parametrize("name", list(WRONG))
def test_a_wrong_answer_is_one_error_naming_the_engine_and_what_is_wrong(name):
    wrong, phrase = WRONG[name]
    with pytest.raises(BadAnswer) as err:
        ask(wrong)
    message = str(err.value)
    assert message.startswith("http://127.0.0.1:") and "/generate response for p0/1#4" in message, message
    assert phrase in message and "\n" not in message, message


def test_routes_of_a_continued_sample_are_counted_from_where_they_start():
    """routed_experts_start_len 2 of 3 input tokens: 1 + 3 - 1 positions ran, and are checked as such."""
    _, completion = ask(lambda b: set_routes(b, routes_of(3)), routes_from=2)
    assert completion.output_ids == OUTPUT
    with pytest.raises(BadAnswer, match="routed_experts for 5 positions, expected 3"):
        ask(lambda b: set_routes(b, routes_of(5)), routes_from=2)  # routes from position 0, as if not asked


@pytest.mark.parametrize("routes", [None, ""], ids=["none-sent-sglang", "none-run-embedded"])
@pytest.mark.parametrize("routes_from", [0, 1])
def test_a_request_aborted_before_it_ran_answers_no_routes(routes, routes_from):
    """A request aborted while it waited in the engine's queue (a weight update's pause in abort mode,
    a step's end) ran no position: SGLang answers it without routed_experts, the embedded engine with
    the routes of none. Before, the client expected the routes of every input position, retired the
    engine and stopped the run at the third (async runs at max_batch 1 of DeepSeek-V3, Qwen3.5-MoE)."""

    def queued(body: dict) -> None:
        body.update(protocol.generate_response("p0/1#4", [], [], {"type": "abort"}, len(PROMPT), "0", [], routes))

    _, completion = ask(queued, routes_from=routes_from)
    assert completion.output_ids == [] and completion.finish == "abort" and completion.routes == b""

    def one_token(body: dict) -> None:  # a token sampled: the positions before it ran, and have routes
        body.update(protocol.generate_response("p0/1#4", [5], [-1.0], {"type": "abort"}, len(PROMPT), "0", [], routes))

    with pytest.raises(BadAnswer, match="routed_experts"):
        ask(one_token, routes_from=routes_from)


def rollout(urls: list[str]) -> AbortSteps:
    """Sync steps of one 2-sample group of PROMPT over engines at `urls`, checked against MOE."""
    clients = [EngineClient(url, retries=0, served=ServedModel.of(MOE, SHAPE)) for url in urls]
    counter = iter(range(100))
    core = RolloutCore(
        EnginePool(clients, wait_s=5, probe_s=0.01),
        RolloutBuffer(2, max_new_tokens=3, token_budget=None, max_staleness=3, routes=SHAPE),
        lambda: (f"p{next(counter)}", PROMPT, {"answer_ids": [5]}),
        RewardWorkers("exact_ids", inline=True),
        SamplingParams(max_new_tokens=3),
    )
    return AbortSteps(core, prompts_per_step=1)


@pytest.mark.filterwarnings("ignore:step .* trains on nothing:UserWarning")
def test_an_engine_answering_wrongly_is_retired_and_its_requests_go_to_another():
    bad, good = Engine(WRONG["token outside the vocabulary"][0]), Engine()

    async def run(urls):
        steps = rollout(urls)
        steps.pool.load[1] = 5  # the bad engine is picked first
        groups, stats = await steps.batch(0)
        for client in steps.pool.clients:
            await client.close()
        return steps.pool, groups, stats

    pool, groups, stats = asyncio.run(serving([bad, good], run))
    assert bad.answered >= 1 and pool.dead == {0} and pool.retired == 1
    assert stats["rollout/engine_failures"] == 1
    batch = RolloutBatch.from_groups(groups, 1.0, routes=SHAPE)
    assert [s.response_ids for s in batch.samples] == [OUTPUT, OUTPUT]  # the good engine's, nothing of 999
    assert all(s.routes is not None and s.routes.shape == (5, 3, 2) for s in batch.samples)
    assert batch.problem(MOE) is None


def test_the_runs_third_wrong_answer_stops_it_with_that_answer_as_its_one_line():
    engines = [Engine(WRONG["routes repeating an expert"][0]) for _ in range(MAX_RETIRED)]

    async def run(urls):
        steps = rollout(urls)
        try:
            with pytest.raises(RunStopped) as err:
                await steps.batch(0)
        finally:
            await steps.core.cut(list(steps.core.running), keep=False)
            for client in steps.pool.clients:
                await client.close()
        return urls, steps.pool, str(err.value)

    urls, pool, message = asyncio.run(serving(engines, run))
    assert pool.retired == MAX_RETIRED and len(pool.dead) == MAX_RETIRED - 1
    assert "\n" not in message and any(message.startswith(f"{url}/generate response for p0/") for url in urls)
    assert "routes name one expert twice in a top-2" in message
    assert f"the engines answered wrongly {MAX_RETIRED} times in this run" in message


def test_a_wrong_answer_to_a_held_out_evaluation_retires_the_engine_by_name(capsys):
    bad, good = Engine(WRONG["token outside the vocabulary"][0]), Engine()
    cfg = load_config(None, [])
    held = EvalSet("eval/", [(PROMPT, {"answer_ids": OUTPUT})], samples=1, greedy=False)
    evaluation = HeldOut([held], cfg.eval, cfg.rollout.sampling, 0, RewardWorkers("exact_ids", inline=True), str, 1)

    async def run(urls):
        pool = EnginePool([EngineClient(url, retries=0, served=ServedModel.of(MOE, SHAPE)) for url in urls], wait_s=5)
        try:
            return urls, pool, await evaluation.run(pool, 3)  # the one prompt prefers engine 0: the bad one
        finally:
            for client in pool.clients:
                await client.close()

    urls, pool, figures = asyncio.run(serving([bad, good], run))
    assert bad.answered == 1 and pool.dead == {0} and pool.retired == 1
    assert figures["eval/avg@1"] == 1.0  # the good engine's answer
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"{urls[0]}/generate response for eval-0-0-0-") and "token id 999" in line, line
    assert f"retiring {urls[0]} (1 of {MAX_RETIRED} wrong answers stop the run)" in line, line


def test_a_wrong_answer_to_the_probe_of_a_refit_retires_the_engine_by_name(capsys):
    """An engine back from a death, given the weights, answers the probe wrongly: it is retired and
    counted (it was waiting for the weights, not live: the answer is to the probe, not an old request)."""
    loop = EngineLoop()
    engines = [Engine(), Engine(WRONG["positive log-prob"][0])]
    servers, clients = [TestServer(e.app()) for e in engines], []
    try:
        for server in servers:
            loop.run(server.start_server())
        urls = [str(server.make_url("")).rstrip("/") for server in servers]
        clients = [EngineClient(url, retries=0, served=ServedModel.of(MOE, None)) for url in urls]
        pool = EnginePool(clients)
        fleet = types.SimpleNamespace(loop=loop, pool=pool, clients=clients)
        prompts = types.SimpleNamespace(first=lambda n: [(PROMPT, {})])
        cfg = load_config(None, ["rollout.engines.colocate=true"])
        updates = EngineUpdates(cfg, fleet, types.SimpleNamespace(restarts=0), prompts, None, lambda: None)
        pool.mark_dead(1)
        pool.came_back(1)  # waits for the weights: probed before it serves again
        assert updates.probe(1) is None and pool.dead == {1} and pool.retired == 1
        assert updates.probe(None).response_ids == OUTPUT  # the live engine answers right
    finally:
        for client in clients:
            loop.run(client.close())
        for server in servers:
            loop.run(server.close())
        loop.close()
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"{urls[1]}/generate response for probe-") and "log-prob 0.01" in line, line
    assert f"retiring {urls[1]} (1 of {MAX_RETIRED} wrong answers stop the run)" in line, line


# -- saved batches --------------------------------------------------------------------------------


def batch_with(routes: torch.Tensor | None = None, response=(4, 5), logprob: float = -0.5) -> RolloutBatch:
    """One sample of PROMPT and `response`, with `routes` ([positions, MoE layers, top_k], compact)."""
    response = list(response)
    sample = Sample(PROMPT, response, [logprob] * len(response), [0] * len(response), 1.0, 0, routes=routes)
    return RolloutBatch([sample])


def compact(positions: int = 4) -> torch.Tensor:
    return routes_of(positions)[:, 1:].to(torch.uint8)


@pytest.mark.parametrize(
    ("routes", "phrase"),
    [
        (compact().index_fill_(2, torch.tensor([1]), 4), "routes hold expert ids in [0, 4], not [0, 4)"),
        (compact()[:, :2], "routes of shape [4, 2, 2], not [positions, 3, 2] (the model's 3 MoE layers, top-2)"),
        (torch.cat([compact(), compact()[:, :, :1]], dim=2), "routes of shape [4, 3, 3], not [positions, 3, 2]"),
        (compact().index_fill_(2, torch.tensor([1]), 0), "routes name one expert twice in a top-2"),
    ],
    ids=["expert-4-of-4", "2-moe-layers-of-3", "top-3-of-top-2", "repeated-expert"],
)
def test_saved_routes_that_do_not_fit_the_model_are_named_before_any_model(tmp_path, routes, phrase):
    path = tmp_path / "b.safetensors"
    batch_with(routes).save(path)
    problem = RolloutBatch.load(path).problem(MOE)
    assert problem is not None and problem.startswith("sample 0: ") and phrase in problem, problem
    assert batch_with(compact()).problem(MOE) is None


def test_saved_tokens_and_logprobs_are_checked_as_engine_answers_are():
    assert batch_with(response=(4, 999)).problem(MOE) == (
        "sample 0: response token id 999 outside the model's vocabulary [0, 250) (at index 1)"
    )
    assert "behaviour log-prob 0.01 is not a finite number <= 0" in batch_with(logprob=0.01).problem(MOE)
    assert batch_with(logprob=1e-7).problem(MOE) is None  # the same slack as on arrival
    dense = tiny_spec("qwen2")
    assert "carries routed experts, but the model (qwen2) has no experts" in batch_with(compact()).problem(dense)

"""The embedded engine's batching shortcuts keep its answers exact: finishes compacted once per decode
step, a prefill's rows slotted in one copy, the prefix store's running count of positions, and an idle
engine gathering a burst of arrivals into one prefill."""

import pytest
import torch
import transformers

from bapo_megatron.common.protocol import SamplingParams
from bapo_megatron.engines.embedded import decode
from bapo_megatron.engines.embedded.core import EngineCore
from bapo_megatron.engines.embedded.request_queue import EngineRequest
from bapo_megatron.tasks import write_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("tiny") / "model", seed=3)


def _request(i: int, prompt_length: int, max_new: int) -> EngineRequest:
    prompt = [(5 * i + j) % 13 + 2 for j in range(prompt_length)]
    return EngineRequest(f"r{i}", prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True))


def _reference_logprobs(model, request: EngineRequest) -> torch.Tensor:
    """Each output token's log-prob at temperature 1 from one teacher-forced transformers forward."""
    with torch.no_grad():
        logits = model(torch.tensor([request.input_ids + request.output_ids])).logits[0]
    logprobs = torch.log_softmax(logits[len(request.input_ids) - 1 : -1], -1)
    return logprobs.gather(1, torch.tensor(request.output_ids)[:, None])[:, 0]


def test_finishes_in_one_decode_step_leave_the_others_exact(model_dir):
    """Four of eight requests end in the same step (slots 0, 2, 4, 7): the ones left move into the
    freed slots together, and every token's log-prob is still transformers' own."""
    core = EngineCore(model_dir, max_batch=8)
    lengths = [3, 9, 3, 9, 3, 9, 9, 3]
    requests = [_request(i, 4 + i, n) for i, n in enumerate(lengths)]  # prompts of 4-11 tokens
    for request in requests:
        core.add(request)
    steps = 0
    while core.busy:
        core.step()
        steps += 1
        if steps == 3:  # the short ones finished this step: the long ones fill slots 0..3
            assert sorted(r.rid for r in core.running) == ["r1", "r3", "r5", "r6"]
    # the slots hold what the requests can reach (r6: 10 + 9 positions), not a growth's 64
    assert core.kv.capacity == max(len(r.input_ids) + n for r, n in zip(requests, lengths, strict=True)) == 19
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for request, n in zip(requests, lengths, strict=True):
        assert request.finish["type"] == "length" and len(request.output_ids) == n
        torch.testing.assert_close(
            torch.tensor(request.logprobs), _reference_logprobs(model, request), rtol=0, atol=1e-5
        )


def test_a_resumed_prefix_leaves_the_store_room_for_the_next(model_dir):
    """The store counts its positions as it goes: a prefix taken back frees its positions, so the next
    one cut short is kept (one slot's store room of 64 positions holds one prefix of 39; the cache
    itself holds the 40 positions its requests reach)."""
    core = EngineCore(model_dir, max_batch=1)
    first = _request(0, 30, 10)
    core.add(first)
    while core.busy:
        core.step()
    again = EngineRequest("again", first.input_ids + first.output_ids, SamplingParams(max_new_tokens=1))
    core.add(again)  # resumes from the stored prefix, which leaves the store
    while core.busy:
        core.step()
    assert core.counters["prefix_hits"] == 1 and len(core.prefixes) == 1  # `again`'s own, cut at 1 token
    second = _request(1, 10, 10)
    core.add(second)
    while core.busy:
        core.step()
    assert core.kv.capacity == 40 and core.kv.store_room == 64
    assert [len(key) for key in core.prefixes] == [40, 19]  # both fit: 59 positions of 64


def test_an_idle_engine_gathers_a_burst_into_one_prefill(model_dir, monkeypatch):
    """Requests arriving while an idle engine waits (each wait lets one more in) prefill in one forward;
    the wait ends at the first gap with no arrival, and an engine with requests running never waits."""
    core = EngineCore(model_dir, max_batch=8)
    arrivals = [_request(i, 6, 4) for i in range(5)]
    waits = []

    def sleep(seconds):
        waits.append(seconds)
        if arrivals:
            core.add(arrivals.pop(0))

    monkeypatch.setattr(decode.time, "sleep", sleep)
    core.add(_request(9, 6, 4))
    core.step()
    assert core.counters["prefill_forwards"] == 1 and core.counters["prefill_requests"] == 6
    assert len(waits) == 6  # five arrivals, then one gap without
    core.step()  # a decode step of the six running: no wait
    assert len(waits) == 6 and core.counters["decode_steps"] == 1


def test_a_groups_samples_share_their_prefill_row_and_draw_their_own_tokens(model_dir):
    """Three prompts of four samples each prefill as three rows of one forward; each sample copies its
    row's keys and values into a slot of its own and samples its own tokens, whose log-probs are
    still transformers' own."""
    core = EngineCore(model_dir, max_batch=12)
    prompts = [[(3 * p + j) % 11 + 2 for j in range(7)] for p in range(3)]
    requests = [
        EngineRequest(f"p{p}/{s}", list(prompts[p]), SamplingParams(max_new_tokens=6, ignore_eos=True))
        for p in range(3)
        for s in range(4)
    ]
    for request in requests:
        core.add(request)
    while core.busy:
        core.step()
    assert core.counters["prefill_forwards"] == 1 and core.counters["prefill_requests"] == 12
    assert core.counters["prefill_positions"] == 3 * 7  # one row a prompt
    assert len({tuple(r.output_ids) for r in requests}) > 3  # a group's samples drew apart
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for request in requests:
        torch.testing.assert_close(
            torch.tensor(request.logprobs), _reference_logprobs(model, request), rtol=0, atol=1e-5
        )


def test_an_engine_idle_between_bursts_keeps_its_cache(model_dir, monkeypatch):
    """Between two bursts (a sync loop's train step) the served engine keeps its slotted cache: the
    second runs in the same tensors, not in memory freed and faulted back in (it is given back after
    server.IDLE_SHRINK_S idle: tests/e2e/test_engine_bad_input.py waits for that)."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from bapo_megatron.engines.embedded import server

    monkeypatch.setattr(server, "IDLE_SHRINK_S", 3600.0)
    core = EngineCore(model_dir, max_batch=4)
    body = {"input_ids": [[1, 2, 3]] * 4, "sampling_params": {"max_new_tokens": 3}}

    async def run():
        async with TestClient(TestServer(server.EmbeddedServer(core).app())) as client:
            assert (await client.post("/generate", json=body)).status == 200
            first = core.kv.keys[0]
            for _ in range(20):  # let the idle engine's loop run on (it gave the cache back here at once)
                await asyncio.sleep(0.01)
            assert (await client.post("/generate", json=body)).status == 200
            return first, core.kv.keys[0]

    first, second = asyncio.run(run())
    assert second is first

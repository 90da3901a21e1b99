"""The client against the embedded engine over real HTTP on localhost.

Log-probs equal transformers' log_softmax(logits / T) for the sampled tokens; abort returns
partial output; pause holds new requests until continue; weights from disk change the
model; a keyed engine refuses unauthenticated control calls and changes nothing.
"""

import asyncio
import shutil

import pytest
import torch

from bapo_megatron.common.protocol import SamplingParams
from bapo_megatron.engines.client import EngineClient, EngineError
from bapo_megatron.engines.launcher import embedded_server
from tests.engine_state import generating, until

pytestmark = pytest.mark.e2e
NAME = "qwen2-gqa2"
ADMIN = "s3cret-admin-key"


@pytest.fixture(scope="module")
def model_dir(hf_model):
    return hf_model(NAME)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    proc = embedded_server(model_dir, tmp_path_factory.mktemp("logs") / "engine.log").start().wait_ready(120)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def keyed(model_dir, tmp_path_factory):
    proc = (
        embedded_server(model_dir, tmp_path_factory.mktemp("logs") / "keyed.log", admin_key=ADMIN)
        .start()
        .wait_ready(120)
    )
    yield proc
    proc.stop()


def _reference_logprobs(model_dir, prompt, output, temperature):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def test_generation_logprobs_match_transformers(server, model_dir):
    prompts = [[5, 9, 17], [3, 1, 4, 1, 5, 9, 2, 6], [100, 200], [7] * 12]
    lengths = [24, 6, 40, 15]

    async def run():
        async with EngineClient(server.url) as client:
            sampling = [SamplingParams(max_new_tokens=n, temperature=0.7, ignore_eos=True) for n in lengths]
            return await asyncio.gather(
                *(client.generate(p, s, f"r{i}") for i, (p, s) in enumerate(zip(prompts, sampling, strict=True)))
            )

    results = asyncio.run(run())
    for prompt, n, result in zip(prompts, lengths, results, strict=True):
        assert result.finish == "length" and len(result.output_ids) == n
        assert result.token_versions() == ["0"] * n
        want = _reference_logprobs(model_dir, prompt, result.output_ids, 0.7)
        torch.testing.assert_close(torch.tensor(result.logprobs), want, rtol=0, atol=1e-5)


def test_abort_returns_partial_output_and_pause_holds_requests(server):
    async def run():
        async with EngineClient(server.url) as client:
            long = asyncio.create_task(
                client.generate([1, 2, 3], SamplingParams(max_new_tokens=4000, ignore_eos=True), "long")
            )
            await generating(client, at_least=2)
            await client.abort("long")
            partial = await long
            await client.pause("in_place")
            held = asyncio.create_task(client.generate([4, 5], SamplingParams(max_new_tokens=4), "held"))
            await until(client, lambda m: m["waiting_requests"] + m["running_requests"] >= 1, "the held request queued")
            was_done = held.done()
            await client.resume()
            return partial, was_done, await held

    partial, was_done, held = asyncio.run(run())
    assert partial.finish == "abort" and 0 < len(partial.output_ids) < 5000
    assert len(partial.logprobs) == len(partial.output_ids)
    assert not was_done and held.finish in ("length", "stop") and len(held.output_ids) >= 1


def test_weights_from_disk_and_version(server, model_dir, tmp_path):
    new_dir = tmp_path / "new"
    shutil.copytree(model_dir, new_dir)
    from safetensors.torch import load_file, save_file

    for file in new_dir.glob("*.safetensors"):
        tensors = {k: v * 1.5 if "proj" in k else v for k, v in load_file(str(file)).items()}
        save_file(tensors, str(file), metadata={"format": "pt"})

    async def run():
        async with EngineClient(server.url) as client:
            await client.update_weights_from_disk(str(new_dir), "7")
            info = await client.model_info()
            result = await client.generate(
                [8, 9, 10], SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True), "after"
            )
            await client.update_weights_from_disk(str(model_dir), "8")  # back, for the other tests
            return info, result

    info, result = asyncio.run(run())
    assert info["weight_version"] == "7" and result.weight_version == "7"
    want = _reference_logprobs(new_dir, [8, 9, 10], result.output_ids, 1.0)
    torch.testing.assert_close(torch.tensor(result.logprobs), want, rtol=0, atol=1e-5)


def test_distributed_update_needs_a_session(server):
    async def run():
        async with EngineClient(server.url) as client:
            with pytest.raises(EngineError, match="begin_weight_update first"):
                await client.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]], "9")

    asyncio.run(run())


def test_keyed_engine_refuses_unauthenticated_control(keyed, model_dir, tmp_path):
    broken = tmp_path / "zeros"
    shutil.copytree(model_dir, broken)
    from safetensors.torch import load_file, save_file

    for file in broken.glob("*.safetensors"):
        save_file({k: torch.zeros_like(v) for k, v in load_file(str(file)).items()}, str(file))
    sampling = SamplingParams(max_new_tokens=6, temperature=0.0)

    async def run():
        async with (
            EngineClient(keyed.url) as anonymous,
            EngineClient(keyed.url, admin_key="wrong") as wrong,
            EngineClient(keyed.url, admin_key=ADMIN) as admin,
        ):
            before = await anonymous.generate([3, 4, 5], sampling, "a")  # generation is not a control endpoint
            for client in (anonymous, wrong):
                for call in (
                    client.pause("abort"),
                    client.update_weights_from_disk(str(broken), "x"),
                    client.abort(),
                    client.release_memory(),
                ):
                    with pytest.raises(EngineError) as err:
                        await call
                    assert err.value.status == 401
            after = await anonymous.generate([3, 4, 5], sampling, "b")  # not paused, weights unchanged
            info = await anonymous.model_info()
            await admin.pause("abort")
            await admin.resume()
            return before, after, info

    before, after, info = asyncio.run(run())
    assert before.output_ids == after.output_ids and before.logprobs == after.logprobs
    assert info["weight_version"] == "0"


def test_memory_released_and_resumed_as_a_colocated_trainer_does(server, model_dir):
    """Release needs an idle engine; while the KV cache or the weights are released, and after
    the weights come back until they are loaded, generation is refused; resuming what is not
    released is an error; once loaded, log-probs are transformers' again."""
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True)

    async def run():
        async with EngineClient(server.url) as client:
            busy = asyncio.create_task(
                client.generate([1, 2, 3], SamplingParams(max_new_tokens=4000, ignore_eos=True), "busy")
            )
            await generating(client)
            with pytest.raises(EngineError, match="only when the engine is idle"):
                await client.release_memory()
            await client.abort("busy")
            await busy
            await client.release_memory()  # every tag
            with pytest.raises(EngineError, match="memory released"):
                await client.generate([4, 5], sampling, "released")
            await client.resume_memory(["weights"])
            with pytest.raises(EngineError, match=r"memory released \(cuda_graph, kv_cache\)"):
                await client.generate([4, 5], sampling, "kv-released")
            await client.resume_memory(["kv_cache", "cuda_graph"])
            with pytest.raises(EngineError, match="update the weights first"):
                await client.generate([4, 5], sampling, "not-loaded")
            with pytest.raises(EngineError, match=r"cannot resume \['kv_cache'\]: not released"):
                await client.resume_memory(["kv_cache"])
            with pytest.raises(ValueError, match="memory tags"):
                await client.release_memory(["optimizer"])
            await client.update_weights_from_disk(str(model_dir), "11")
            return await client.generate([8, 9, 10], sampling, "loaded")

    result = asyncio.run(run())
    assert result.weight_version == "11"
    want = _reference_logprobs(model_dir, [8, 9, 10], result.output_ids, 1.0)
    torch.testing.assert_close(torch.tensor(result.logprobs), want, rtol=0, atol=1e-5)


def test_released_memory_is_freed(model_dir):
    """The engine core gives the memory back: no parameter storage, no cache, no prefix store."""
    from bapo_megatron.engines.embedded.core import EngineCore
    from bapo_megatron.engines.embedded.request_queue import EngineRequest

    core = EngineCore(model_dir, max_batch=2)
    request = EngineRequest("r", [5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))
    core.add(request)
    core.step()  # prefill: the cache exists
    with pytest.raises(ValueError, match="idle"):
        core.release_memory(["kv_cache"])
    core.abort("r")
    assert core.kv.keys and core.prefixes  # the aborted request left its prefix
    parameters = list(core.model.parameters())
    core.release_memory(["kv_cache", "weights"])
    assert not core.kv.keys and not core.prefixes
    assert all(p.untyped_storage().nbytes() == 0 for p in parameters)
    core.resume_memory(["weights", "kv_cache"])
    assert [p.numel() for p in parameters] == [p.numel() for p in core.model.parameters()] and all(
        p.numel() > 0 for p in parameters
    )
    assert "update the weights" in core.can_generate()


def test_a_failing_step_fails_its_requests_instead_of_hanging(model_dir):
    from aiohttp.test_utils import TestClient, TestServer

    from bapo_megatron.engines.embedded.core import EngineCore
    from bapo_megatron.engines.embedded.server import EmbeddedServer

    core = EngineCore(model_dir)

    def broken_step():
        raise RuntimeError("simulated kernel failure")

    core.step = broken_step

    async def run():
        async with TestClient(TestServer(EmbeddedServer(core).app())) as client:
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "rid": "x"}
            resp = await asyncio.wait_for(client.post("/generate", json=body), 30)
            return await resp.json()

    meta = asyncio.run(run())["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["finish_reason"]["status_code"] == 500
    message = meta["finish_reason"]["message"]
    assert message == "engine step failed: RuntimeError" and "Traceback" not in message  # details: the log
    assert not core.busy


def test_slotted_cache_under_arrivals_finishes_retracts_and_growth(model_dir):
    """The engine loop itself: requests arriving while others decode, a waiting queue (3 slots),
    finishes that move slots, a retract (caches dropped mid-generation) and caches growing past
    their first capacity; every token's log-prob is still transformers' own."""
    from bapo_megatron.engines.embedded.core import EngineCore
    from bapo_megatron.engines.embedded.request_queue import EngineRequest

    core = EngineCore(model_dir, max_batch=3)
    lengths = [150, 7, 90, 3, 40, 12]
    requests = [
        EngineRequest(
            f"r{i}",
            [(11 * i + j) % 90 + 1 for j in range(2 + 3 * i)],
            SamplingParams(max_new_tokens=n, temperature=0.8, ignore_eos=True),
        )
        for i, n in enumerate(lengths)
    ]
    core.add(requests[0])
    core.add(requests[1])
    steps = 0
    while core.busy or steps < 4:
        if steps in (2, 5, 9, 30):
            core.add(requests[2 + [2, 5, 9, 30].index(steps)])
        if steps == 60:
            assert core.running, "a retract should meet running requests"
            core.drop_caches()
        core.step()
        assert len(core.running) <= 3
        steps += 1
    assert core.kv.capacity >= 64 * 2  # grown (from 64) for the longest request
    for request, n in zip(requests, lengths, strict=True):
        assert request.finish["type"] == "length" and len(request.output_ids) == n
        want = _reference_logprobs(model_dir, request.input_ids, request.output_ids, 0.8)
        torch.testing.assert_close(torch.tensor(request.logprobs), want, rtol=0, atol=1e-5)


def test_resubmitted_partial_response_reuses_its_cache_until_weights_change(model_dir):
    """Partial rollout's next round resubmits prompt + partial response: its cached keys and
    values are taken back (no prefill, also after the idle engine gave its cache's memory back)
    and the log-probs are still transformers' own; after a weight load the store is empty and
    it is prefilled again."""
    from bapo_megatron.engines.embedded.core import EngineCore
    from bapo_megatron.engines.embedded.request_queue import EngineRequest

    core = EngineCore(model_dir, max_batch=4)

    def run(rid, ids, n):
        request = EngineRequest(rid, ids, SamplingParams(max_new_tokens=n, temperature=0.8, ignore_eos=True))
        core.add(request)
        while core.busy:
            core.step()
        return request

    prompt = [4, 8, 15, 16, 23, 42]
    first = run("a", prompt, 10)
    core.shrink()  # idle between steps: the slotted cache gives its memory back, the prefix store stays
    assert core.kv.capacity == 0
    second = run("a#2", prompt + first.output_ids, 12)
    assert core.counters["prefix_hits"] == 1
    core.load_weights([])  # a (here empty) weight update empties the store
    third = run("a#3", prompt + first.output_ids + second.output_ids, 5)
    assert core.counters["prefix_hits"] == 1
    response = first.output_ids + second.output_ids + third.output_ids
    want = _reference_logprobs(model_dir, prompt, response, 0.8)
    got = torch.tensor(first.logprobs + second.logprobs + third.logprobs)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_batch_invariant_requests_do_not_depend_on_what_else_runs(model_dir):
    """batch_invariant (rollout.deterministic): a seeded request's tokens and log-probs are bit for
    bit the same alone, beside others arriving at other times, and resubmitted after a cut (its
    continuation prefills anew either way), and still transformers' log-probs; the batched engine
    gives the same tokens but only close log-probs."""
    from bapo_megatron.engines.embedded.core import EngineCore
    from bapo_megatron.engines.embedded.request_queue import EngineRequest

    def request(i, n=9):
        prompt = [(7 * i + j) % 90 + 1 for j in range(3 + 5 * i)]
        sampling = SamplingParams(max_new_tokens=n, temperature=0.9, ignore_eos=True, sampling_seed=1000 + i)
        return EngineRequest(f"r{i}", prompt, sampling)

    def run(core, arrivals):
        """arrivals: {engine step: [requests added then]}; every request to its end."""
        done, steps = [], 0
        while core.busy or steps <= max(arrivals):
            for r in arrivals.get(steps, []):
                core.add(r)
                done.append(r)
            core.step()
            steps += 1
        return {r.rid: (r.output_ids, r.logprobs) for r in done}

    alone = {}
    for i in range(5):
        alone.update(run(EngineCore(model_dir, batch_invariant=True), {0: [request(i)]}))
    mixed = run(
        EngineCore(model_dir, batch_invariant=True, max_batch=3),
        {0: [request(3), request(0)], 2: [request(4), request(1)], 5: [request(2)]},
    )
    assert mixed == alone
    core = EngineCore(model_dir, batch_invariant=True)
    first = run(core, {0: [request(2, n=4)]})["r2"]
    rest = EngineRequest(
        "r2#2",
        request(2).input_ids + first[0],
        SamplingParams(max_new_tokens=5, temperature=0.9, ignore_eos=True, sampling_seed=1002),
    )
    second = run(core, {0: [rest], 1: [request(0)]})["r2#2"]
    assert core.counters["prefix_hits"] == 0 and not core.prefixes
    again = EngineRequest("r2#3", request(2).input_ids + first[0], rest.sampling)
    assert run(EngineCore(model_dir, batch_invariant=True), {0: [again]})["r2#3"] == second
    for rid, (tokens, logprobs) in alone.items():
        i = int(rid[1:])
        want = _reference_logprobs(model_dir, request(i).input_ids, tokens, 0.9)
        torch.testing.assert_close(torch.tensor(logprobs), want, rtol=0, atol=1e-5)
    batched = run(
        EngineCore(model_dir, max_batch=3), {0: [request(3), request(0)], 2: [request(4), request(1)], 5: [request(2)]}
    )
    for rid, (tokens, logprobs) in batched.items():
        assert tokens == alone[rid][0]
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(alone[rid][1]), rtol=0, atol=1e-5)


def test_prefix_store_holds_no_more_positions_than_the_slots(model_dir):
    from bapo_megatron.engines.embedded.core import EngineCore
    from bapo_megatron.engines.embedded.request_queue import EngineRequest

    core = EngineCore(model_dir, max_batch=1)
    for i in range(4):  # each leaves 39 cached positions; one slot's store room of 64 bounds the store
        core.add(EngineRequest(f"r{i}", [i + 1] * 30, SamplingParams(max_new_tokens=10, ignore_eos=True)))
        while core.busy:
            core.step()
    assert core.kv.capacity == 40 and core.kv.store_room == 64  # the cache: what its requests reach
    assert [key[:30] for key in core.prefixes] == [(4,) * 30]  # only the newest fits


def test_prefill_of_mixed_lengths_runs_in_length_sorted_forwards_and_stays_exact(model_dir, monkeypatch):
    """Requests of very different lengths arriving together are prefilled in several forwards
    (unmasked, right-padded, logits at each row's last token only); every token's log-prob is
    still transformers' own, through the decode steps that follow in the shared slots."""
    from bapo_megatron.engines.embedded import decode
    from bapo_megatron.engines.embedded.core import EngineCore
    from bapo_megatron.engines.embedded.request_queue import EngineRequest

    monkeypatch.setattr(decode, "PREFILL_OVERHEAD_POSITIONS", 16)
    core = EngineCore(model_dir, max_batch=8)
    forwards = []
    forward = core.model.forward
    core.model.forward = lambda *a, **k: forwards.append(tuple(k["input_ids"].shape)) or forward(*a, **k)
    prompts = [[(13 * i + j) % 97 + 1 for j in range(n)] for i, n in enumerate([3, 120, 5, 64, 118, 2, 61])]
    requests = [
        EngineRequest(f"r{i}", p, SamplingParams(max_new_tokens=9, temperature=0.9, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    for request in requests:
        core.add(request)
    core.step()
    assert forwards == [(2, 120), (2, 64), (3, 5)], forwards  # 120+118 | 64+61 | 5+3+2, longest first
    while core.busy:
        core.step()
    # each request's first token comes from its prefill, the other eight from decode steps
    assert core.counters == {
        "prefill_forwards": 3,
        "prefill_requests": 7,
        "prefill_positions": 2 * 120 + 2 * 64 + 3 * 5,
        "decode_steps": 8,
        "decode_tokens": 7 * 8,
        "prefix_hits": 0,
    }
    for request in requests:
        want = _reference_logprobs(model_dir, request.input_ids, request.output_ids, 0.9)
        torch.testing.assert_close(torch.tensor(request.logprobs), want, rtol=0, atol=1e-5)


def test_server_logs_its_throughput(model_dir, capsys):
    from aiohttp.test_utils import TestClient, TestServer

    from bapo_megatron.engines.embedded.core import EngineCore
    from bapo_megatron.engines.embedded.server import EmbeddedServer

    server = EmbeddedServer(EngineCore(model_dir), log_interval_s=1e-6)

    async def run():
        async with TestClient(TestServer(server.app())) as client:
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
            resp = await client.post("/generate", json=body)
            return await resp.json()

    assert len(asyncio.run(run())["output_ids"]) == 5
    # the server has stopped: its last line (printed at shutdown) covers every step that ran
    assert server.core.counters["decode_steps"] == 4 and server.core.counters["prefill_forwards"] == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[engine]")]
    assert lines and "prefill 1 requests in 1 forwards (3 positions)" in lines[0]
    assert sum(int(line.split("decode ")[1].split(" steps")[0]) for line in lines) == 4


# -- Qwen3 and Qwen3-MoE --------------------------------------------------------------------
MOE_CASE = ("qwen3_moe", 2, False)
"""tiny_spec("qwen3_moe"): 4 experts, top-2, layer 0 dense and layers 1-3 sparse."""


@pytest.fixture(scope="module")
def moe_dir(hf_model):
    return hf_model("qwen3-moe", MOE_CASE)


def _moe_reference(model_dir, sequence, prompt_len, temperature):
    """transformers' one forward of the whole sequence: the log-probs of the tokens after the prompt,
    and the routes of every position but the last as SGLang returns them (int32 [positions, layers,
    top_k], dense layers DENSE_LAYER_EXPERT), from its own router logits (no hook of ours)."""
    import transformers

    from bapo_megatron.common.protocol import DENSE_LAYER_EXPERT
    from bapo_megatron.models.spec import ModelSpec

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([sequence]), output_router_logits=True)
    logits = out.logits[0, prompt_len - 1 : -1]
    logprobs = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(sequence[prompt_len:])[:, None])[:, 0]
    moe = ModelSpec.from_hf_dir(model_dir).moe
    picked = torch.stack([torch.topk(layer, moe.top_k, -1).indices for layer in out.router_logits], 1)
    routes = torch.full((len(sequence), model.config.num_hidden_layers, moe.top_k), DENSE_LAYER_EXPERT)
    routes[:, list(moe.sparse_layers)] = picked.to(routes.dtype)
    return logprobs, routes[:-1].to(torch.int32)


def test_moe_engine_returns_transformers_logprobs_and_routes_across_a_resumed_partial_rollout(moe_dir, model_dir):
    """A Qwen3-MoE model over HTTP: log-probs and routes (SGLang's return_routed_experts) equal
    transformers' forward of the whole sequence, for a request beside another in the batch and for
    its partial-rollout continuation, which takes its prefix from the store (no prefill) and asks
    from routed_experts_start_len = prompt + partial - 1: every position's route comes exactly
    once. Routes from a dense model, or from past the prompt, are refused (400)."""
    from aiohttp.test_utils import TestClient, TestServer

    from bapo_megatron.common import protocol
    from bapo_megatron.engines.embedded.core import EngineCore
    from bapo_megatron.engines.embedded.server import EmbeddedServer

    core = EngineCore(moe_dir, max_batch=4)
    prompt, other = [4, 8, 15, 16, 23], [7, 7, 3, 9]

    def sampling(n):
        return SamplingParams(max_new_tokens=n, temperature=0.8, ignore_eos=True)

    async def generate(client, ids, n, rid, start):
        resp = await client.post("/generate", json=protocol.generate_request(ids, sampling(n), rid, start))
        return resp.status, await resp.json()

    async def run():
        async with (
            TestClient(TestServer(EmbeddedServer(core).app())) as client,
            TestClient(TestServer(EmbeddedServer(EngineCore(model_dir)).app())) as dense,
        ):
            first, beside = await asyncio.gather(
                generate(client, prompt, 7, "a", 0), generate(client, other, 5, "b", 2)
            )
            sequence = prompt + first[1]["output_ids"]
            second = await generate(client, sequence, 6, "a#2", len(sequence) - 1)
            refused = [
                await generate(client, prompt, 2, "late", len(prompt) + 1),
                await generate(dense, prompt, 2, "dense", 0),
            ]
            return first, beside, second, refused

    first, beside, second, refused = asyncio.run(run())
    assert core.counters["prefix_hits"] == 1
    routes = {}
    for name, (status, body) in {"first": first, "beside": beside, "second": second}.items():
        assert status == 200 and body["meta_info"]["finish_reason"]["type"] == "length"
        routes[name] = protocol.routed_experts(body["meta_info"], num_layers=4, top_k=2)
    response = first[1]["output_ids"] + second[1]["output_ids"]
    logprobs = [lp for _, body in (first, second) for lp, _, _ in body["meta_info"]["output_token_logprobs"]]
    want_logprobs, want_routes = _moe_reference(moe_dir, prompt + response, len(prompt), 0.8)
    torch.testing.assert_close(torch.tensor(logprobs), want_logprobs, rtol=0, atol=1e-5)
    assert routes["first"].shape == (len(prompt) + 7 - 1, 4, 2) and routes["second"].shape == (6, 4, 2)
    assert torch.equal(torch.cat([routes["first"], routes["second"]]), want_routes)  # each position once
    assert (want_routes[:, 0] == protocol.DENSE_LAYER_EXPERT).all() and want_routes[:, 1:].max() >= 2
    beside_ids = other + beside[1]["output_ids"]
    assert torch.equal(routes["beside"], _moe_reference(moe_dir, beside_ids, len(other), 0.8)[1][2:])
    (late_status, late), (dense_status, dense) = refused
    assert late_status == 400 and "routed_experts_start_len=6: must be an integer in [0, 5]" in late["message"]
    assert dense_status == 400 and "the served model is dense" in dense["message"]


def test_moe_routes_survive_a_retract_and_batch_invariant_resumption(moe_dir):
    """Routes are per position however the positions ran: batched with others in a queue of two
    slots, retracted mid-generation (everything prefilled again), aborted (what it ran), or
    batch-invariant (alone, and its continuation prefilled anew): always those of transformers'
    whole forward."""
    from bapo_megatron.common.protocol import compact_routes
    from bapo_megatron.engines.embedded.core import EngineCore
    from bapo_megatron.engines.embedded.request_queue import EngineRequest

    def request(i, n):
        prompt = [(5 * i + j) % 90 + 1 for j in range(2 + 3 * i)]
        return EngineRequest(f"r{i}", prompt, SamplingParams(max_new_tokens=n, temperature=0.9, ignore_eos=True))

    def check(r):
        want = compact_routes(
            _moe_reference(moe_dir, r.input_ids + r.output_ids, len(r.input_ids), 0.9)[1], (1, 2, 3), 4
        )
        assert torch.equal(torch.cat(r.routes), want), r.rid

    core = EngineCore(moe_dir, max_batch=2)
    requests = [request(i, n) for i, n in enumerate([9, 4, 7])]
    for r in requests:
        core.add(r)
    for step in range(40):
        if step == 3:
            assert core.running
            core.drop_caches()
        core.step()
    assert not core.busy
    aborted = request(5, 50)
    core.add(aborted)
    for _ in range(3):
        core.step()
    core.abort(aborted.rid)  # cut short: the routes of what it ran
    assert aborted.finish["type"] == "abort" and 0 < len(aborted.output_ids) < 50
    for r in [*requests, aborted]:
        check(r)
    alone = EngineCore(moe_dir, batch_invariant=True)
    cut = request(4, 3)
    alone.add(cut)
    while alone.busy:
        alone.step()
    rest = EngineRequest("r4#2", cut.input_ids + cut.output_ids, cut.sampling)
    alone.add(rest)
    while alone.busy:
        alone.step()
    check(cut)
    check(rest)


def test_moe_weights_load_one_tensor_per_expert_into_the_fused_parameters(moe_dir, tmp_path):
    """Per-expert HF names (checkpoints', SGLang's, our export's) go into transformers' fused
    gate_up_proj / down_proj, each checked against its slot; after a release and resume every
    tensor must come back before generation; the served model is then transformers' own with the
    new weights: log-probs and routes."""
    from safetensors.torch import load_file, save_file

    from bapo_megatron.common.protocol import compact_routes
    from bapo_megatron.engines.embedded.core import EngineCore
    from bapo_megatron.engines.embedded.request_queue import EngineRequest

    new_dir = tmp_path / "new"
    shutil.copytree(moe_dir, new_dir)
    tensors = {}
    for file in new_dir.glob("*.safetensors"):
        changed = {
            k: v * (1.5 if ".experts." in k else -1.0 if k.endswith("mlp.gate.weight") else 1.0)
            for k, v in load_file(str(file)).items()
        }
        save_file(changed, str(file), metadata={"format": "pt"})
        tensors.update(changed)
    experts = sorted(k for k in tensors if ".experts." in k)
    assert len(experts) == 3 * 4 * 3 and "model.layers.1.mlp.experts.3.up_proj.weight" in experts
    core = EngineCore(moe_dir, max_batch=2)
    f32 = torch.float32
    for name, shape, message in [
        ("model.layers.1.mlp.experts.4.up_proj.weight", [32, 64], "no such parameter"),
        ("model.layers.0.mlp.experts.0.gate_proj.weight", [32, 64], "no such parameter"),
        ("model.layers.2.mlp.experts.1.gate_proj.weight", [33, 64], r"shape \(33, 64\), the model's is \(32, 64\)"),
        ("model.layers.2.mlp.experts.1.down_proj.weight", [32, 64], r"shape \(32, 64\), the model's is \(64, 32\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            core.check_weights([(name, f32, shape)])
    core.release_memory(["weights"])
    core.resume_memory(["weights"])
    assert f"{len(tensors)} weight tensors were released" in core.can_generate()
    last = "model.layers.3.mlp.experts.3.up_proj.weight"
    core.load_weights([(k, v) for k, v in tensors.items() if k != last])
    assert "1 weight tensors were released" in core.can_generate()
    core.load_weights([(last, tensors[last])])
    assert core.can_generate() is None
    r = EngineRequest("new", [3, 1, 4, 1, 5], SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True))
    core.add(r)
    while core.busy:
        core.step()
    want_logprobs, want_routes = _moe_reference(new_dir, r.input_ids + r.output_ids, len(r.input_ids), 1.0)
    torch.testing.assert_close(torch.tensor(r.logprobs), want_logprobs, rtol=0, atol=1e-5)
    assert torch.equal(torch.cat(r.routes), compact_routes(want_routes, (1, 2, 3), 4))
    old_routes = _moe_reference(moe_dir, r.input_ids + r.output_ids, len(r.input_ids), 1.0)[1]
    assert not torch.equal(old_routes, want_routes)  # the update moved the routes: the check has teeth

    async def back_from_disk():  # the old weights again, from the checkpoint's per-expert files
        from aiohttp.test_utils import TestClient, TestServer

        from bapo_megatron.common import protocol
        from bapo_megatron.engines.embedded.server import EmbeddedServer

        async with TestClient(TestServer(EmbeddedServer(core).app())) as client:
            resp = await client.post("/update_weights_from_disk", json=protocol.update_disk_request(str(moe_dir), "2"))
            assert resp.status == 200 and (await resp.json())["success"]
            body = protocol.generate_request(r.input_ids + r.output_ids, SamplingParams(max_new_tokens=1), "old", 0)
            resp = await client.post("/generate", json=body)
            return protocol.routed_experts((await resp.json())["meta_info"], 4, 2)

    served = asyncio.run(back_from_disk())  # one token sampled: routes of every input position
    assert len(served) == len(r.input_ids + r.output_ids) and torch.equal(served[:-1], old_routes)


def test_moe_engine_in_bfloat16_differs_from_float32_measurably_but_boundedly(moe_dir):
    """rollout.engines.dtype=bfloat16: the model runs in bfloat16 (weights sent in float32 are cast
    as they load) and its log-probs differ from a float32 forward as a GPU engine's do."""
    from bapo_megatron.engines.embedded.core import EngineCore
    from bapo_megatron.engines.embedded.request_queue import EngineRequest

    core = EngineCore(moe_dir, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in core.model.parameters())
    norm = torch.full((64,), 1.0 + 2**-10)  # not a bfloat16 number: cast on load
    core.load_weights([("model.norm.weight", norm)])
    assert core.model.model.norm.weight.dtype == torch.bfloat16 and (core.model.model.norm.weight == 1).all()
    requests = [
        EngineRequest(
            f"r{i}", [9 + i, 2, 7, 30 + i], SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True)
        )
        for i in range(2)
    ]
    for r in requests:
        core.add(r)
    while core.busy:
        core.step()
    gaps = torch.cat(
        [
            torch.tensor(r.logprobs) - _moe_reference(moe_dir, r.input_ids + r.output_ids, len(r.input_ids), 1.0)[0]
            for r in requests
        ]
    ).abs()
    assert 1e-3 < float(gaps.max()) < 0.25, gaps


def test_qwen3_dense_serves_transformers_logprobs_and_loads_its_weights(hf_model):
    """Qwen3 (q/k norms, head_dim of its own): its checkpoint's tensors load by name, it has no
    routers, and its log-probs are transformers'."""
    from safetensors.torch import load_file

    from bapo_megatron.engines.embedded.core import EngineCore
    from bapo_megatron.engines.embedded.request_queue import EngineRequest

    qwen3 = hf_model("qwen3", ("qwen3", 2, False))
    core = EngineCore(qwen3)
    tensors = [pair for file in sorted(qwen3.glob("*.safetensors")) for pair in load_file(str(file)).items()]
    assert any(name.endswith("self_attn.q_norm.weight") for name, _ in tensors)
    assert core.load_weights(tensors) == len(tensors) and core.route_recorder is None
    r = EngineRequest("q", [5, 6, 7], SamplingParams(max_new_tokens=10, temperature=0.7, ignore_eos=True))
    core.add(r)
    while core.busy:
        core.step()
    want = _reference_logprobs(qwen3, r.input_ids, r.output_ids, 0.7)
    torch.testing.assert_close(torch.tensor(r.logprobs), want, rtol=0, atol=1e-5)


def test_launched_engine_serves_a_moe_model_in_the_configured_dtype(moe_dir, tmp_path):
    """rollout.engines.dtype reaches the engine process (auto: float32) and a Qwen3-MoE directory
    passes its start-up checks; bfloat16 log-probs are not float32's."""
    import aiohttp

    from bapo_megatron.common import protocol
    from bapo_megatron.config import load_config
    from bapo_megatron.engines.launcher import embedded_servers

    def servers(*overrides):
        return embedded_servers(load_config(None, list(overrides)).rollout, moe_dir, tmp_path, 0, None)

    def dtype(proc):
        return proc.command[proc.command.index("--dtype") + 1]

    assert dtype(servers()[0]) == "float32"
    (proc,) = servers("rollout.engines.dtype=bfloat16")
    assert dtype(proc) == "bfloat16"
    proc.start().wait_ready(120)
    prompt = [3, 14, 15, 92]

    async def run():
        body = protocol.generate_request(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True), "bf16", 0)
        async with aiohttp.ClientSession() as session, session.post(f"{proc.url}/generate", json=body) as resp:
            return await resp.json()

    try:
        result = asyncio.run(run())
    finally:
        proc.stop()
    output = result["output_ids"]
    routes = protocol.routed_experts(result["meta_info"], 4, 2)
    assert routes.shape == (len(prompt) + len(output) - 1, 4, 2)
    got = torch.tensor([lp for lp, _, _ in result["meta_info"]["output_token_logprobs"]])
    want = _moe_reference(moe_dir, prompt + output, len(prompt), 1.0)[0]
    assert float((got - want).abs().max()) > 1e-3

"""The embedded engine under bad input, with good requests in flight.

Each malformed request gets a 400 (a body over the limit: 413) naming what is wrong, with no
traceback in it; the requests already running finish with their full length; a client that
disconnects stops its request and the cache's memory comes back; an empty admin key is an
error at start-up. (Before: a NaN temperature or a top_k of 2.5 failed the shared engine step
and aborted every request in flight with a 500 and a traceback.)
"""

import asyncio
import json
import math

import pytest
import torch

from bapo_megatron.common.protocol import SamplingParams
from bapo_megatron.engines.embedded import cli as embedded
from bapo_megatron.engines.embedded.core import EngineCore
from bapo_megatron.engines.embedded.server import EmbeddedServer
from tests.helpers import make_hf_model

pytestmark = pytest.mark.e2e
GOOD_TOKENS = 40


@pytest.fixture(scope="module")
def model_dir(hf_model):
    return hf_model("qwen2-gqa2")


def _generate(ids, **sampling) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, **sampling}}


def _bad_requests(context: int) -> list[tuple[str, str, str | dict, int, str]]:
    """(name, path, body (dict: JSON; str: raw), status, a phrase the answer must hold)."""
    return [
        ("nan temperature", "/generate", _generate([1, 2], temperature=math.nan), 400, "temperature"),
        ("fractional top_k", "/generate", _generate([1, 2], top_k=2.5), 400, "top_k=2.5"),
        ("huge max_new_tokens", "/generate", _generate([1, 2], max_new_tokens=10**9), 400, "context length"),
        ("nan max_new_tokens", "/generate", _generate([1, 2], max_new_tokens=math.nan), 400, "max_new_tokens"),
        ("prompt past context", "/generate", _generate([1] * (context + 1)), 400, f"{context + 1} prompt tokens"),
        ("text seed", "/generate", _generate([1, 2], sampling_seed="x"), 400, "sampling_seed"),
        ("token outside vocab", "/generate", _generate([1, 10**6]), 400, "input_ids"),
        ("bool token", "/generate", _generate([1, True]), 400, "input_ids"),
        ("list body", "/generate", "[1, 2, 3]", 400, "JSON object"),
        ("deeply nested", "/generate", "[" * 20_000 + "]" * 20_000, 400, ""),
        ("garbage", "/generate", "{not json", 400, ""),
        ("list to abort", "/abort_request", "[1]", 400, "JSON object"),
        ("number to pause", "/pause_generation", "7", 400, "JSON object"),
        ("list to release", "/release_memory_occupation", '["weights"]', 400, "JSON object"),
        ("string version", "/update_weight_version", '"3"', 400, "JSON object"),
        ("bad tensor payload", "/update_weights_from_tensor", {"serialized_named_tensors": 5}, 400, ""),
        ("min_p", "/generate", _generate([1, 2], min_p=0.1), 400, "unsupported field(s) ['min_p']"),
        ("zero top_p", "/generate", _generate([1, 2], top_p=0), 400, "top_p=0"),
        ("zero top_k", "/generate", _generate([1, 2], top_k=0), 400, "top_k=0"),
        ("negative tiny temperature", "/generate", _generate([1, 2], temperature=-1e-300), 400, "temperature"),
        ("temperature past float", "/generate", _generate([1, 2], temperature=10**400), 400, "temperature"),
        ("top_p past float", "/generate", _generate([1, 2], top_p=10**400), 400, "top_p"),
        ("oversized body", "/generate", json.dumps(_generate([1] * 200_000)), 413, ""),
    ]


def test_bad_requests_get_400s_and_running_ones_finish(model_dir):
    from aiohttp.test_utils import TestClient, TestServer

    core = EngineCore(model_dir)
    good = _generate([5, 6, 7], max_new_tokens=GOOD_TOKENS, ignore_eos=True)

    async def run():
        async with TestClient(TestServer(EmbeddedServer(core).app())) as client:
            running = [asyncio.create_task(client.post("/generate", json={**good, "rid": f"good{i}"})) for i in (0, 1)]
            while len(core.running) < 2:  # both are decoding before the bad ones arrive
                await asyncio.sleep(0.01)
            answers = []
            for name, path, body, status, phrase in _bad_requests(core.context_length):
                raw = body if isinstance(body, str) else json.dumps(body)
                resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
                answers.append((name, status, phrase, resp.status, await resp.text()))
            greedy = await client.post("/generate", json=_generate([1, 2], temperature=1e-41, ignore_eos=True))
            finished = [await (await task).json() for task in running]
            return answers, await greedy.json(), finished

    answers, greedy, finished = asyncio.run(run())
    for name, status, phrase, got, text in answers:
        assert got == status, (name, got, text)
        assert phrase in text and "Traceback" not in text, (name, text)
    tokens = greedy["meta_info"]["output_token_logprobs"]
    assert len(tokens) == 8 and all(math.isfinite(lp) for lp, _, _ in tokens)  # below 1e-6: greedy, as SGLang
    for answer in finished:
        assert answer["meta_info"]["finish_reason"]["type"] == "length"
        assert len(answer["output_ids"]) == GOOD_TOKENS


EXTREMES = {  # sampling values at the ends of their ranges, each with an answer (SGLang's semantics)
    "greedy": {"temperature": 0},
    "top_p 1e-300": {"top_p": 1e-300},
    "top_p 5e-324": {"top_p": 5e-324},
    "top_p 5e-324, seeded": {"top_p": 5e-324, "sampling_seed": 3},
    "top_k 1": {"top_k": 1},
    "temperature 1e-300": {"temperature": 1e-300},
    "top_k past the vocabulary": {"top_k": 10**30},
    "temperature 1e300": {"temperature": 1e300},
    "temperature 10^300, an integer": {"temperature": 10**300},
    "temperature 1e300, top_p 1e-300": {"temperature": 1e300, "top_p": 1e-300},
    "max_new_tokens 0": {"max_new_tokens": 0},
}


def test_extreme_sampling_values_get_sglangs_answers_and_fail_nothing_else(model_dir):
    """top_p keeps the smallest set of tokens whose probability reaches it, never fewer than the most
    likely one, so a top_p of 1e-300 or 5e-324 (0 once scaled in float32) samples greedily (before:
    its request aborted, "invalid multinomial distribution"); so do top_k 1 and a temperature below
    1e-6. A temperature of 1e300, or the JSON integer 10^300 (before: it failed the step that every
    request in flight shared), samples from the uniform distribution; max_new_tokens 0 answers no
    tokens; a top_k past the vocabulary is no top_k. The request running beside them finishes."""
    from aiohttp.test_utils import TestClient, TestServer

    core = EngineCore(model_dir)
    vocab = core.model.config.vocab_size
    good = _generate([5, 6, 7], max_new_tokens=GOOD_TOKENS, ignore_eos=True)

    async def run():
        async with TestClient(TestServer(EmbeddedServer(core).app())) as client:
            running = asyncio.create_task(client.post("/generate", json=good))
            while not core.running:
                await asyncio.sleep(0.01)
            posts = [
                client.post("/generate", json=_generate([3, 4, 5], ignore_eos=True, **s)) for s in EXTREMES.values()
            ]
            answers = {
                name: await resp.json() for name, resp in zip(EXTREMES, await asyncio.gather(*posts), strict=True)
            }
            return answers, await (await running).json()

    answers, finished = asyncio.run(asyncio.wait_for(run(), 300))
    reasons = {name: a["meta_info"]["finish_reason"] for name, a in answers.items()}
    assert all(r["type"] == "length" for r in reasons.values()), reasons
    greedy = answers["greedy"]
    assert len(greedy["output_ids"]) == 8
    for name in ("top_p 1e-300", "top_p 5e-324", "top_p 5e-324, seeded", "top_k 1", "temperature 1e-300"):
        assert answers[name]["output_ids"] == greedy["output_ids"], name
        got = [lp for lp, _, _ in answers[name]["meta_info"]["output_token_logprobs"]]
        want = [lp for lp, _, _ in greedy["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=1e-4), name  # log_softmax(logits / 1): T = 1 for greedy too
    for name in ("temperature 1e300", "temperature 10^300, an integer", "temperature 1e300, top_p 1e-300"):
        logprobs = [lp for lp, _, _ in answers[name]["meta_info"]["output_token_logprobs"]]
        assert logprobs == pytest.approx([-math.log(vocab)] * 8, abs=1e-5), name
    assert len(answers["top_k past the vocabulary"]["output_ids"]) == 8
    assert answers["max_new_tokens 0"]["output_ids"] == [] and reasons["max_new_tokens 0"]["length"] == 0
    assert finished["meta_info"]["finish_reason"]["type"] == "length"
    assert len(finished["output_ids"]) == GOOD_TOKENS


def test_a_step_that_fails_mid_prefill_aborts_its_requests_instead_of_losing_them(model_dir, monkeypatch):
    """A prefill forward that raises (a bug) fails the step: the requests it had taken off the queue
    are aborted with a 500 like the others. (Before: they were in neither queue, and their clients
    waited forever.)"""
    from aiohttp.test_utils import TestClient, TestServer

    core = EngineCore(model_dir)

    def broken(batch):
        raise RuntimeError("simulated prefill failure")

    monkeypatch.setattr(core.loop, "_prefill_chunk", broken)

    async def run():
        async with TestClient(TestServer(EmbeddedServer(core).app())) as client:
            resp = await asyncio.wait_for(client.post("/generate", json=_generate([1, 2, 3])), 60)
            return await resp.json()

    reason = asyncio.run(run())["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 500
    assert not core.busy


class _Rebuilt:
    """A payload's tensor as the sender's pickler writes it: ipc.rebuild_shared and its arguments."""

    def __init__(self, path: str, dtype: str, shape: list[int]) -> None:
        self.args = (path, dtype, shape)

    def __reduce__(self):
        from bapo_megatron.common import ipc

        return ipc.rebuild_shared, self.args


def test_weight_payloads_the_model_cannot_take_get_400s_and_change_nothing(model_dir):
    """In a weight-update session, a payload whose names, dtypes or shapes cannot be the served
    model's is refused with a 400 naming what is wrong, and the weights stay as they were. (Before:
    a payload of a few bytes that declared a terabyte of them was allocated first: 500 MemoryError;
    so was the JSON number 10^12 sent as the payload, taken for a length by bytes().)"""
    import base64
    import pickle

    from aiohttp.test_utils import TestClient, TestServer

    from bapo_megatron.common import ipc, protocol

    core = EngineCore(model_dir)
    before = {k: v.clone() for k, v in core.model.state_dict().items()}
    numel = core.model.model.norm.weight.numel()

    def raw(data: bytes) -> list[str]:
        return [base64.b64encode(data).decode()]

    terabyte = b"\x80\x04\x8e" + (10**12).to_bytes(8, "little") + bytes(8)  # BINBYTES8 of 10^12 bytes
    empty_rows = pickle.dumps([("model.norm.weight", _Rebuilt("", "float32", [10**12, 0]))], protocol=4)
    negative = pickle.dumps([("model.norm.weight", _Rebuilt("", "float32", [-1, 0]))], protocol=4)
    huge_meta = ipc.flattened_bucket([("model.norm.weight", torch.ones(numel))])
    huge_meta["metadata"][0].shape = torch.Size([10**12])

    async def run():
        async with TestClient(TestServer(EmbeddedServer(core).app())) as client:
            await client.post("/begin_weight_update", json={})
            with (
                ipc.serialized([("model.layers.99.mlp.up_proj.weight", torch.ones(numel))]) as unknown,
                ipc.serialized([("model.norm.weight", torch.ones(numel, dtype=torch.int32))]) as integer,
                ipc.serialized(ipc.flattened_bucket([("model.norm.weight", torch.ones(2 * numel))])) as bigger,
                ipc.serialized(huge_meta) as huge,
            ):
                cases = [
                    ("declares a terabyte", raw(terabyte), None, "bytes8"),
                    ("a number, not a payload", [10**12], None, "serialized_named_tensors[0] does not decode"),
                    ("10^12 empty rows", raw(empty_rows), None, f"shape (1000000000000, 0), the model's is ({numel},)"),
                    ("a negative dimension", raw(negative), None, "[-1, 0]"),
                    ("unknown name", unknown, None, "model.layers.99.mlp.up_proj.weight: the model has no such"),
                    ("integer dtype", integer, None, "weights must be floating point"),
                    (
                        "a bigger model's",
                        bigger,
                        protocol.FLATTENED,
                        f"shape ({2 * numel},), the model's is ({numel},)",
                    ),
                    ("10^12 in metadata", huge, protocol.FLATTENED, "shape (1000000000000,)"),
                ]
                answers = []
                for name, payload, load_format, phrase in cases:
                    body = {"serialized_named_tensors": payload, "load_format": load_format}
                    resp = await client.post("/update_weights_from_tensor", json=body)
                    answers.append((name, phrase, resp.status, await resp.text()))
            await client.post("/end_weight_update", json={})
            return answers

    for name, phrase, status, text in asyncio.run(run()):
        assert status == 400 and phrase in text and "Traceback" not in text, (name, status, text)
    for key, value in core.model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_a_distributed_update_the_model_cannot_take_is_refused_before_the_broadcast(model_dir, tmp_path):
    """update_weights_from_distributed announces names, dtypes and shapes before the sender
    broadcasts: ones the served model cannot take are refused (400) before anything is allocated
    or the broadcast joined (before: a shape of [10^12] answered 500, out of memory), and the
    refusing engine leaves the group, so that its sender's broadcast ends at once (its bytes must
    not wait in the group for the next update to receive) and the sender fails, then builds a new
    group that updates the engine."""
    import time

    from bapo_megatron.engines.client import EngineClient, EngineError
    from bapo_megatron.engines.launcher import embedded_server, free_port
    from bapo_megatron.engines.loop import EngineLoop
    from bapo_megatron.weights.sync import DistributedWeightSender, WeightsRefused

    engine = embedded_server(model_dir, tmp_path / "engine.log").start().wait_ready(120)
    loop = EngineLoop()
    timeout_s = 120.0
    try:
        with loop.context(EngineClient(engine.url)) as client:
            sender = DistributedWeightSender(
                [client], [1], "127.0.0.1", free_port(), backend="gloo", timeout_s=timeout_s
            )
            loop.run(sender.connect())
            loop.run(client.begin_weight_update())
            with pytest.raises(EngineError, match=r"HTTP 400: .*model.norm.weight: shape \(1000000000000,\)"):
                loop.run(client.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[10**12]], "x"))
            with pytest.raises(EngineError, match="no weight-update group"):  # it left the group
                loop.run(client.destroy_weights_update_group())
            loop.run(client.end_weight_update())
            loop.run(sender.close())  # our end too (its engine has left)
            bad = [
                [("model.layers.99.mlp.up_proj.weight", torch.ones(64))],
                [("model.norm.weight", torch.ones(65))],
                [("model.norm.weight", torch.ones(64, dtype=torch.int32))],
                [("model.norm.weight", torch.ones(64)), ("model.norm.weight", torch.ones(64))],  # a name twice
            ]
            for bucket in bad:
                loop.run(sender.connect())
                start = time.monotonic()
                with pytest.raises(WeightsRefused, match="HTTP 400"):  # the engine's reason, not gloo's
                    sender.send([bucket], "bad", loop)
                assert time.monotonic() - start < timeout_s / 2, bucket  # not the group's timeout
            loop.run(sender.connect())
            sender.send([[("model.norm.weight", torch.full((64,), 0.5))]], "good", loop)
            info = loop.run(client.request("/model_info", method="GET"))
            result = loop.run(client.generate([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True), "after"))
            loop.run(sender.close())
    finally:
        loop.close()
        engine.stop()
    assert info["weight_version"] == "good" and len(result.output_ids) == 4


def test_a_client_that_disconnects_stops_its_request_and_the_memory_returns(model_dir):
    from aiohttp.test_utils import TestClient, TestServer

    core = EngineCore(model_dir)

    async def run():
        async with TestClient(TestServer(EmbeddedServer(core).app())) as client:
            long = _generate([1, 2, 3], max_new_tokens=4000, ignore_eos=True)
            request = asyncio.create_task(client.post("/generate", json=long))
            while not core.running:
                await asyncio.sleep(0.01)
            assert core.kv.capacity > 0
            request.cancel()  # the client goes away mid-generation
            for _ in range(3000):  # a state to reach, not a time to wait: up to 30 s on a busy machine
                if not core.busy and core.kv.capacity == 0:
                    return True
                await asyncio.sleep(0.01)
            return False

    assert asyncio.run(run()), "the request kept generating, or the cache kept its memory"


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [("--max-batch", "0", "outside [1, 65536]"), ("--port", "70000", "outside [0, 65535]"), ("--port", "x", "'x'")],
)
def test_bad_options_are_refused_at_start(model_dir, capsys, flag, value, message):
    args = ["--model", str(model_dir), "--port", "1", flag, value]
    with pytest.raises(SystemExit) as exit_:
        embedded.main(args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err.splitlines()[-1]


def test_integer_weights_are_refused_at_start(model_dir, tmp_path, capsys):
    make_hf_model(tmp_path, "qwen2-gqa2")
    import safetensors.torch

    shard = sorted((tmp_path / "qwen2-gqa2").glob("*.safetensors"))[0]
    tensors = safetensors.torch.load_file(shard)
    safetensors.torch.save_file({k: v.to(torch.int32) for k, v in tensors.items()}, shard)
    assert embedded.main(["--model", str(tmp_path / "qwen2-gqa2"), "--port", "1"]) == 2
    assert "is stored as I32; weights must be floating point" in capsys.readouterr().err
    core = EngineCore(model_dir)  # and sent as an update
    with pytest.raises(ValueError, match="model.norm.weight: dtype torch.int32; weights must be floating point"):
        core.load_weights([("model.norm.weight", torch.ones(core.model.model.norm.weight.shape, dtype=torch.int32))])


def test_a_client_that_sends_its_request_slowly_is_cut_off(model_dir):
    """A body that does not arrive within the request timeout: 408, and the connection is freed."""
    from aiohttp.test_utils import TestServer

    server = EmbeddedServer(EngineCore(model_dir), request_timeout_s=0.5)

    async def run():
        async with TestServer(server.app()) as test_server:
            reader, writer = await asyncio.open_connection(test_server.host, test_server.port)
            writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), timeout=30)  # the server answers and closes
            writer.close()
            return answer.decode(errors="replace")

    answer = asyncio.run(run())
    assert answer.startswith("HTTP/1.1 408") and "took over 0.5 s" in answer, answer


@pytest.mark.parametrize("where", ["file", "env"])
def test_an_empty_admin_key_is_an_error_at_start(where, model_dir, tmp_path, monkeypatch, capsys):
    args = ["--model", str(model_dir), "--port", "1", "--host", "0.0.0.0"]
    if where == "file":
        (tmp_path / "key").write_text("  \n")
        args += ["--admin-api-key-file", str(tmp_path / "key")]
    else:
        monkeypatch.setenv("BAPO_ADMIN_API_KEY", "")
    assert embedded.main(args) == 2
    assert "is empty" in capsys.readouterr().err


def test_a_request_whose_sampling_fails_fails_alone(model_dir, monkeypatch):
    from bapo_megatron.common.protocol import SamplingParams
    from bapo_megatron.engines.embedded import sampling
    from bapo_megatron.engines.embedded.request_queue import EngineRequest

    core = EngineCore(model_dir)
    real = sampling.sample

    def flaky(logits, s, generator):
        if s.top_k == 7:
            raise RuntimeError("simulated sampling failure\nsecond line")
        return real(logits, s, generator)

    monkeypatch.setattr(sampling, "sample", flaky)
    good = EngineRequest("good", [1, 2, 3], SamplingParams(max_new_tokens=6, top_k=5, ignore_eos=True))
    bad = EngineRequest("bad", [4, 5], SamplingParams(max_new_tokens=6, top_k=7, ignore_eos=True))
    core.add(good)
    core.add(bad)
    while core.busy:
        core.step()
    assert bad.finish == {
        "type": "abort",
        "message": "request failed: RuntimeError: simulated sampling failure",
        "status_code": 500,
        "err_type": "RuntimeError",
    }
    assert good.finish["type"] == "length" and len(good.output_ids) == 6


def _probe_bodies() -> list[str]:
    """Malformed bodies of every kind a careless or hostile client sends."""
    values = ["5", '"x"', "null", "true", "-1", "1e400", "[]", '["a"]', "{}", '{"a": 1}', "[[1]]", '"../../etc/passwd"']
    fields = [
        "names",
        "dtypes",
        "shapes",
        "group_name",
        "weight_version",
        "load_format",
        "model_path",
        "tags",
        "mode",
        "rid",
        "abort_all",
        "new_version",
        "master_address",
        "master_port",
        "rank_offset",
        "world_size",
        "backend",
        "serialized_named_tensors",
        "flush_cache",
        "input_ids",
        "sampling_params",
    ]
    bodies = ["", "{", "[", "nul", '{"a": }', "[" * 5000 + "]" * 5000, "[1, 2]", "3", '"s"']
    bodies += [f'{{"{field}": {value}}}' for field in fields for value in values]
    bodies += [
        '{"names": ["w"], "dtypes": ["float32"], "shapes": [[-1]]}',
        '{"names": ["w"], "dtypes": ["float99"], "shapes": [[2]]}',
        '{"names": ["w", "v"], "dtypes": ["float32"], "shapes": [[2]]}',
        '{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "stop_token_ids": [1.5]}}',
        '{"input_ids": [1, 2], "sampling_params": []}',
        '{"input_ids": [], "sampling_params": {}}',
    ]
    # tensor payloads that decode to no tensors, or do not decode: the client's error, 400
    import base64
    import pickle

    from bapo_megatron.common import ipc

    payloads = [
        base64.b64encode(b"\x80\x05").decode(),  # a pickle cut short
        base64.b64encode(pickle.dumps([("model.norm.weight", 1)])).decode(),  # a number, not a tensor
        base64.b64encode(pickle.dumps([(1, 2)])).decode(),
    ]
    with ipc.serialized([("model.norm.weight", torch.ones(32))]) as gone:
        payloads += gone  # a handle to shared memory that is freed by now
    bodies += [json.dumps({"serialized_named_tensors": [p]}) for p in payloads]
    return bodies


def test_no_malformed_body_gets_a_500_and_the_server_keeps_serving(model_dir):
    """A bounded probe: every control and generation endpoint, each malformed body once."""
    from aiohttp.test_utils import TestClient, TestServer

    core = EngineCore(model_dir)
    server = EmbeddedServer(core)
    post_paths = [r.resource.canonical for r in server.app().router.routes() if r.method == "POST"]

    async def run():
        async with TestClient(TestServer(server.app())) as client:
            statuses = {}
            await client.post("/begin_weight_update", json={})  # the update endpoints past their session check
            for path in post_paths:
                for body in _probe_bodies():
                    resp = await client.post(path, data=body, headers={"Content-Type": "application/json"})
                    text = await resp.text()
                    statuses[(path, body[:60])] = (resp.status, text)
            # the probe may have paused the engine and released its memory (its weights' values are lost
            # then, as under SGLang's memory saver): resume, reload, continue, and it serves again
            await client.post("/resume_memory_occupation", json={})
            reload = await client.post("/update_weights_from_disk", json={"model_path": str(model_dir)})
            assert reload.status == 200, await reload.text()
            await client.post("/end_weight_update", json={})
            await client.post("/continue_generation", json={})
            ok = await client.post("/generate", json=_generate([1, 2, 3], max_new_tokens=4))
            return statuses, ok.status

    statuses, after = asyncio.run(run())
    server_errors = {k: v for k, v in statuses.items() if v[0] >= 500}
    assert not server_errors, list(server_errors.items())[:5]
    assert all("Traceback" not in text for _, text in statuses.values())
    assert len(statuses) > 1000 and after == 200

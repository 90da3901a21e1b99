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
    [("--max-batch", "0", "outside [1, 65536]"), ("--port", "70000", "outside [1, 65535]"), ("--port", "x", "'x'")],
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
    from bapo_megatron.engines.embedded import core as engine_core
    from bapo_megatron.engines.embedded.core import Request

    core = EngineCore(model_dir)
    real = engine_core.sample

    def flaky(logits, s, generator):
        if s.top_k == 7:
            raise RuntimeError("simulated sampling failure\nsecond line")
        return real(logits, s, generator)

    monkeypatch.setattr(engine_core, "sample", flaky)
    good = Request("good", [1, 2, 3], SamplingParams(max_new_tokens=6, top_k=5, ignore_eos=True))
    bad = Request("bad", [4, 5], SamplingParams(max_new_tokens=6, top_k=7, ignore_eos=True))
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

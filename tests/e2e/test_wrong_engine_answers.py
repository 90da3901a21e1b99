"""`bapo-train` online with an engine whose answers are wrong: the run stops with one `error:` line
naming the engine and what is wrong, exit 1, no traceback.

The engine is an embedded one behind a proxy that turns the first token of every /generate answer
into 999 (the model has 250 tokens). Before: the token was trained on through a padding row of the
embedding and the run ended with exit 0. Now each wrong answer retires the engine (it is given
the weights again and serves again, as after a restart) and its requests go elsewhere; the third
stops the run (tests/unit/test_engine_answers.py has every kind of wrong answer).
"""

import asyncio
import json
import threading

import pytest

from bapo_megatron.engines.launcher import embedded_server, free_port
from tests.online import MODEL, args, start, write_task

pytestmark = pytest.mark.e2e
WRONG_TOKEN = 999


class SpoilingProxy:
    """Forwards every request to the engine at `target`; /generate answers (each row of a batched one)
    come back with their first output token (and its log-prob's) replaced by WRONG_TOKEN. Runs on a
    thread of its own."""

    def __init__(self, target: str) -> None:
        self.target, self.port = target, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.runner = None

    async def _forward(self, request):
        import aiohttp
        from aiohttp import web

        headers = {k: v for k, v in request.headers.items() if k in ("Authorization", "Content-Type")}
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session,
            session.request(
                request.method, self.target + request.path_qs, data=await request.read(), headers=headers
            ) as resp,
        ):
            data = await resp.read()
            if request.path == "/generate" and resp.status == 200:
                answer = json.loads(data)
                for one in answer if isinstance(answer, list) else [answer]:  # SGLang's batch form: a row each
                    if one["output_ids"]:
                        one["output_ids"][0] = WRONG_TOKEN
                        one["meta_info"]["output_token_logprobs"][0][1] = WRONG_TOKEN
                data = json.dumps(answer).encode()
            return web.Response(body=data, status=resp.status, content_type=resp.content_type)

    async def _start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    def __enter__(self) -> "SpoilingProxy":
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_an_engine_answering_tokens_outside_the_vocabulary_stops_the_run_with_one_line(tmp_path, hf_model):
    task = write_task(tmp_path / "task", 8, hf_model(*MODEL))
    engine = embedded_server(task / "m", tmp_path / "engine.log").start().wait_ready(120)
    try:
        with SpoilingProxy(engine.url) as proxy:
            proc = start(args(task, tmp_path / "run", 2, f"rollout.engines.urls=[{proxy.url}]"))
            out, _ = proc.communicate(timeout=600)
    finally:
        engine.stop()
    last = out.strip().splitlines()[-1]
    assert proc.returncode == 1, out[-4000:]
    assert last.startswith(f"error: {proxy.url}/generate response for "), out[-4000:]
    assert f"token id {WRONG_TOKEN} outside the model's vocabulary [0, 250)" in last, last
    assert "the engines answered wrongly 3 times in this run" in last, last
    assert "Traceback" not in out and "internal" not in out, out[-4000:]
    assert f"retiring {proxy.url} (1 of 3 wrong answers stop the run)" in out, out[-4000:]
    assert not (tmp_path / "run" / "ckpt").exists() or not any((tmp_path / "run" / "ckpt").glob("step_*"))

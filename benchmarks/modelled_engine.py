"""A scripted engine with a GPU's decode cost, speaking SGLang's /generate protocol (a benchmark aid).

A CPU engine's decode step costs more the more sequences it holds; a GPU's costs about the same
from one sequence up to a capacity (decode is bound by reading the weights), and partial
rollout pays exactly there: it keeps more sequences in flight for the same cost per iteration.
This engine makes no model: each iteration sleeps what the cost model says and gives every
running request one token. A sample's length is scripted from its id (the part of the request
id before '#'), long-tailed like the CPU benchmark's: log-normal with median MEDIAN, a share
reaching max_new_tokens. The cost model's parameters (H100_7B) and its simplifications are
printed with every table that uses it.

It serves what the training loop asks of an engine, so that the real `bapo-train` can run
against it (benchmarks/bench_loop.py): weight updates over the same transport (it joins the
trainer's weight-update group and receives every broadcast, then discards the bytes), the
weight-update session, the weight version (per token, as spans), and SGLang's pauses: abort
(running requests return what they have), retract (they wait and prefill again on continue)
and in_place (they wait); requests that arrive while paused wait.
"""

from __future__ import annotations

import asyncio
import math
import random
import socket
import threading
import zlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CostModel:
    iteration_s: float
    """One decode iteration, any batch width up to `capacity`."""
    capacity: int
    """Sequences per iteration before it turns compute-bound; past it the iteration grows in proportion."""
    prefill_s_per_token: float
    """Prefill of newly admitted tokens (a resumed sample's prefix is prefilled again: no prefix cache)."""
    source: str

    def iteration(self, running: int, admitted_tokens: int) -> float:
        return self.iteration_s * max(1.0, running / self.capacity) + admitted_tokens * self.prefill_s_per_token


H100_7B = CostModel(
    iteration_s=0.010,
    capacity=256,
    prefill_s_per_token=50e-6,
    source=(
        "a 7-8B bf16 model on one H100: 10 ms per decode iteration (16 GB of weights read at 3.35 TB/s is "
        "4.8 ms, plus KV reads and kernel overheads; published SGLang/vLLM inter-token latencies of 8B models "
        "on one H100 are 7-12 ms), flat up to 256 sequences (H100's bf16 ridge point, 989 TFLOPS / 3.35 TB/s "
        "~ 295 FLOP/byte), growing in proportion past it; prefill 50 us/token (~20k tokens/s)"
    ),
)


@dataclass
class _Request:
    rid: str
    sample: str
    target: int  # tokens this sample's response has when it stops by itself
    done_before: int  # response tokens it had when this request began
    max_new: int
    output: list[int] = field(default_factory=list)
    spans: list[list] = field(default_factory=list)  # [version, start, end] over output tokens
    future: asyncio.Future | None = None
    admitted: bool = False


class ModelledEngine:
    """Serves /generate, /abort_request, /health, /update_weights_from_disk, /update_weight_version on
    loopback from a thread of its own; sleeps are `time_scale` x the modelled time (the benchmark
    divides its seconds by it)."""

    def __init__(
        self,
        cost: CostModel,
        prompt_len: int,
        median: float = 150.0,
        share_long: float = 0.15,
        cap: int = 512,
        stop_id: int = 0,
        time_scale: float = 1.0,
        seed: int = 0,
    ) -> None:
        self.cost, self.prompt_len, self.stop_id, self.time_scale, self.seed = (
            cost,
            prompt_len,
            stop_id,
            time_scale,
            seed,
        )
        self.median = median
        # P(length > cap) = share_long under a log-normal of this median
        z = _normal_quantile(1.0 - share_long)
        self.sigma = math.log(cap / median) / z
        self.version = "0"
        self.paused: str | None = None
        self.groups: dict[str, object] = {}
        self.running: dict[str, _Request] = {}
        self._wake: asyncio.Event | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.url = ""

    def target(self, sample: str) -> int:
        rng = random.Random(zlib.crc32(f"{self.seed}/{sample}".encode()))
        return max(1, round(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))))

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> ModelledEngine:
        from aiohttp import web

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/health", self._ok)
        app.router.add_get("/model_info", self._model_info)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_post("/pause_generation", self._pause)
        app.router.add_post("/continue_generation", self._continue)
        app.router.add_post("/begin_weight_update", self._done)
        app.router.add_post("/end_weight_update", self._done)
        app.router.add_post("/init_weights_update_group", self._join)
        app.router.add_post("/destroy_weights_update_group", self._leave)
        app.router.add_post("/update_weights_from_distributed", self._receive)
        app.router.add_post("/update_weights_from_disk", self._set_version)
        app.router.add_post("/update_weight_version", self._set_version)
        self._runner = web.AppRunner(app, access_log=None)
        self._thread.start()

        async def up() -> None:
            self._wake = asyncio.Event()
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", port).start()
            self._scheduler = asyncio.create_task(self._schedule())

        asyncio.run_coroutine_threadsafe(up(), self._loop).result(30)
        self.url = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        async def down() -> None:
            self._scheduler.cancel()
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(down(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    # -- the model of decoding -----------------------------------------------------------------
    async def _schedule(self) -> None:
        while True:
            if not self.running or self.paused:
                self._wake.clear()
                await self._wake.wait()
                continue
            admitted = [r for r in self.running.values() if not r.admitted]
            for r in admitted:
                r.admitted = True
            new_tokens = sum(self.prompt_len + r.done_before + len(r.output) for r in admitted)
            await asyncio.sleep(self.time_scale * self.cost.iteration(len(self.running), new_tokens))
            if self.paused:  # paused during the iteration: its tokens are not made
                continue
            for r in list(self.running.values()):
                total = r.done_before + len(r.output) + 1
                self._emit(r, self.stop_id if total >= r.target else 10 + total % 200)
                if total >= r.target:
                    self._finish(r, {"type": "stop", "matched": self.stop_id})
                elif len(r.output) >= r.max_new:
                    self._finish(r, {"type": "length", "length": r.max_new})

    def _emit(self, r: _Request, token: int) -> None:
        from bapo_megatron.common.protocol import extend_spans

        r.output.append(token)
        extend_spans(r.spans, self.version, len(r.output))

    def _finish(self, r: _Request, reason: dict) -> None:
        from bapo_megatron.common import protocol

        self.running.pop(r.rid, None)
        body = protocol.generate_response(
            r.rid,
            r.output,
            [-1.0] * len(r.output),
            reason,
            self.prompt_len + r.done_before,
            self.version,
            [tuple(span) for span in r.spans],
        )
        if not r.future.done():
            r.future.set_result(body)

    # -- HTTP ----------------------------------------------------------------------------------
    async def _ok(self, request):
        from aiohttp import web

        return web.Response(status=200)

    async def _generate(self, request):
        """One request, or SGLang's batch form (input_ids a list of lists: common/generate_batch.py),
        answered with a list in the rows' order."""
        from aiohttp import web

        from bapo_megatron.common import generate_batch

        body = await request.json()
        if not generate_batch.is_batch(body):
            return web.json_response(await self._row(body))
        rows = generate_batch.split_batch(body)
        return web.json_response(list(await asyncio.gather(*(self._row(row) for row in rows))))

    async def _row(self, body: dict) -> dict:
        rid = str(body["rid"])
        sample = rid.split("#", 1)[0]
        r = _Request(
            rid=rid,
            sample=sample,
            target=self.target(sample),
            done_before=len(body["input_ids"]) - self.prompt_len,
            max_new=int(body["sampling_params"]["max_new_tokens"]),
            future=asyncio.get_running_loop().create_future(),
        )
        self.running[rid] = r
        self._wake.set()
        return await r.future

    async def _abort(self, request):
        from aiohttp import web

        body = await request.json()
        targets = list(self.running.values()) if body.get("abort_all") else [self.running.get(body.get("rid"))]
        for r in targets:
            if r is not None:
                self._finish(r, {"type": "abort", "message": "aborted"})
        return web.json_response({})

    async def _set_version(self, request):
        body = await request.json()
        version = body.get("weight_version", body.get("new_version"))
        if version is not None:
            self.version = str(version)
        return await self._done(request)

    async def _done(self, request):
        from aiohttp import web

        return web.json_response({"success": True, "message": ""})

    async def _model_info(self, request):
        from aiohttp import web

        return web.json_response({"model_path": "", "weight_version": self.version, "is_generation": True})

    async def _pause(self, request):
        from aiohttp import web

        mode = (await request.json()).get("mode", "abort")
        self.paused = mode
        for r in list(self.running.values()):
            if mode == "abort":
                self._finish(r, {"type": "abort", "message": "paused"})
            elif mode == "retract":
                r.admitted = False  # its KV cache is dropped: prefilled again, output included, on continue
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request):
        from aiohttp import web

        self.paused = None
        self._wake.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _join(self, request):
        """The trainer's weight-update group, joined as the embedded engine joins it (gloo)."""
        from bapo_megatron.common.weight_group import join_requested

        name, group = await asyncio.to_thread(join_requested, await request.json(), "weight_update_group")
        self.groups[name] = group
        return await self._done(request)

    async def _leave(self, request):
        from bapo_megatron.common.weight_group import leave_group

        name = (await request.json()).get("group_name", "weight_update_group")
        await asyncio.to_thread(leave_group, self.groups.pop(name, None))
        return await self._done(request)

    async def _receive(self, request):
        """One bucket's broadcasts received (as the embedded engine does) and discarded."""
        import torch
        import torch.distributed as dist

        from bapo_megatron.common import protocol

        body = await request.json()
        group = self.groups[body.get("group_name", "weight_update_group")]
        dtypes = [protocol.torch_dtype(d) for d in body["dtypes"]]
        if body.get("load_format") == protocol.FLATTENED:
            layout = protocol.flattened_layout(dtypes, body["shapes"])
            tensors = [torch.empty(layout[-1][1] if layout else 0, dtype=torch.uint8)]
        else:
            tensors = [torch.empty(shape, dtype=d) for shape, d in zip(body["shapes"], dtypes, strict=True)]

        def receive() -> None:
            for tensor in tensors:
                dist.broadcast(tensor, src=0, group=group)

        await asyncio.to_thread(receive)
        if body.get("weight_version") is not None:
            self.version = str(body["weight_version"])
        return await self._done(request)


def _normal_quantile(p: float) -> float:
    """The standard normal's p-quantile (bisection on erf: no scipy here)."""
    lo, hi = -10.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2

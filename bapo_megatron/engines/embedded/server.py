"""The embedded engine: SGLang's HTTP subset, served on CPU for the demo, tests and CI.

    python -m bapo_megatron.engines.embedded --model HF_DIR --port 30000 [--host 127.0.0.1]

Same payloads as SGLang 0.5.23 (common/protocol.py): /generate with logprobs (one request or a
batch of them, generate_endpoint.py), /abort_request, /pause_generation (abort | retract |
in_place), /continue_generation,
/health, /health_generate, /ready, /model_info, /begin_weight_update, /end_weight_update,
/init_weights_update_group, /destroy_weights_update_group, /update_weights_from_distributed
(gloo; the trainer is rank 0), /update_weights_from_tensor (shared-memory handles from a
process on the same host, common/ipc.py), /update_weights_from_disk (safetensors only),
/update_weight_version, /load_lora_adapter, /load_lora_adapter_from_tensors and
/unload_lora_adapter (PEFT adapters; a /generate request names one as lora_path,
lora_endpoints.py), /release_memory_occupation and /resume_memory_occupation (the KV
cache and the weights' memory freed while a colocated trainer runs; released weights lose
their values, as under SGLang's memory saver, and generation is refused until they are
loaded again). A mixture-of-experts model (Qwen3-MoE) returns its routed experts when a
/generate request sets return_routed_experts (SGLang's --enable-return-routed-experts is
always on here; a dense model answers such a request 400).

Security as SGLang's: it listens on loopback unless --host names an interface, and then
refuses to start without an admin key. With an admin key (BAPO_ADMIN_API_KEY, or
--admin-api-key-file), the control endpoints answer 401 unless the request carries
`Authorization: Bearer KEY`; with an API key (BAPO_API_KEY), so do the others (health aside).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import sys
import time
import traceback

from bapo_megatron.common import protocol
from bapo_megatron.engines.embedded.core import EngineCore
from bapo_megatron.engines.embedded.generate_endpoint import GenerateEndpoint
from bapo_megatron.engines.embedded.http import guarded, json_object, request_timeout_key
from bapo_megatron.engines.embedded.lora_endpoints import AdapterNames, LoRAEndpoints
from bapo_megatron.engines.embedded.weight_updates import WeightUpdateEndpoints

OPEN_PATHS = ("/health", "/ready", "/metrics")
METRIC_PREFIX = "bapo_engine_"
"""/metrics names: bapo_engine_busy_seconds_total (time in model steps), the core's counters, the queue."""
CONTROL_BODY_LIMIT = 64 << 20  # weight updates carry names and handles, never the tensors themselves
IDLE_SHRINK_S = 5.0
"""An engine idle this long gives its slotted cache's memory back (it grows back on demand). Not at
once: a sync loop's engine idles through every train step, and freeing and faulting its cache back
in each step cost the demo's rollout 20 ms of its 60 ms of generation (32 MiB, 256 slots)."""


def authorized(path: str, header: str | None, api_key: str | None, admin_key: str | None) -> bool:
    """SGLang's rule: control endpoints need the admin key when one is set (else the API key when
    that is set); other endpoints need the API key when set; health and readiness are open."""
    if path.startswith(OPEN_PATHS):
        return True

    def bearer(expected: str) -> bool:
        parts = (header or "").split(" ", 1)
        return len(parts) == 2 and parts[0].lower() == "bearer" and secrets.compare_digest(parts[1], expected)

    if path in protocol.ADMIN_ENDPOINTS:
        key = admin_key or api_key
        return key is None or bearer(key)
    return api_key is None or bearer(api_key)


class EmbeddedServer(GenerateEndpoint, WeightUpdateEndpoints, LoRAEndpoints):
    """The HTTP front of an EngineCore. Everything that computes with the model's tensors (steps,
    weight loads) runs on one dedicated thread, `engine_thread`, one call at a time: torch's
    OpenMP pool is per OS thread, and a second thread computing (even now and then) leaves two
    pools fighting for the cores, which doubled the time of a decode step on two cores."""

    def __init__(
        self,
        core: EngineCore,
        api_key: str | None = None,
        admin_key: str | None = None,
        engine_thread: concurrent.futures.ThreadPoolExecutor | None = None,
        log_interval_s: float = 30.0,
        request_timeout_s: float = 60.0,
    ) -> None:
        self.core = core
        self.log_interval_s = log_interval_s  # a throughput line on stderr per so many seconds of steps (0: none)
        self.request_timeout_s = request_timeout_s  # to send a request's headers and body
        self._busy_s = 0.0  # seconds spent in steps
        self._logged = (0.0, dict(core.counters))  # busy seconds and counters at the last line
        self.engine_thread = engine_thread or concurrent.futures.ThreadPoolExecutor(1, "engine")
        self.api_key, self.admin_key = api_key, admin_key
        self.paused: str | None = None  # the pause mode while paused
        self.session_open = False
        self.groups: dict[str, object] = {}
        self.loras = AdapterNames()  # the LoRA adapters requests can name
        self._lora_lock = asyncio.Lock()  # loads and unloads one at a time, as SGLang's lora_update_lock
        self._wake = asyncio.Event()
        self._model_lock = asyncio.Lock()
        self._loop_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()

    # -- app ------------------------------------------------------------------------------
    def app(self):
        from aiohttp import web

        @web.middleware
        async def auth(request, handler):
            if not authorized(request.path, request.headers.get("Authorization"), self.api_key, self.admin_key):
                return web.json_response({"error": "unauthorized"}, status=401)
            return await handler(request)

        app = web.Application(middlewares=[auth], client_max_size=CONTROL_BODY_LIMIT)
        app[request_timeout_key()] = self.request_timeout_s
        get = {
            "/health": self.health,
            "/health_generate": self.health,
            "/ready": self.health,
            "/model_info": self.model_info,
            "/get_model_info": self.model_info,
            "/metrics": self.metrics,
        }
        post = {
            "/generate": self.generate,
            "/abort_request": self.abort,
            "/pause_generation": self.pause,
            "/continue_generation": self.resume,
            "/begin_weight_update": self.begin_update,
            "/end_weight_update": self.end_update,
            "/init_weights_update_group": self.init_group,
            "/destroy_weights_update_group": self.destroy_group,
            "/update_weights_from_distributed": self.update_from_distributed,
            "/update_weights_from_tensor": self.update_from_tensor,
            "/update_weights_from_disk": self.update_from_disk,
            "/update_weight_version": self.set_version,
            "/load_lora_adapter": self.load_lora_adapter,
            "/load_lora_adapter_from_tensors": self.load_lora_adapter_from_tensors,
            "/unload_lora_adapter": self.unload_lora_adapter,
            "/release_memory_occupation": self.release_memory,
            "/resume_memory_occupation": self.resume_memory,
        }
        for path, handler in get.items():
            app.router.add_get(path, handler)
        for path, handler in post.items():
            app.router.add_post(path, guarded(handler))
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app) -> None:
        self._loop_task = asyncio.create_task(self._run())

    async def _stop(self, app) -> None:
        if self._loop_task:
            self._loop_task.cancel()
        if self.log_interval_s and self.core.counters != self._logged[1]:
            self._log_throughput()  # what ran since the last line, so that the lines add up to everything

    async def _run(self) -> None:
        while True:
            if self.paused or not self.core.busy or self.core.can_generate():
                self._wake.clear()
                if not self.core.busy and not await self._woken_within(IDLE_SHRINK_S):
                    await self._on_engine(self.core.shrink)
                await self._wake.wait()
                continue
            async with self._model_lock:
                start = time.monotonic()
                try:
                    await self._on_engine(self.core.step)
                except Exception as err:  # a bug must not leave every client waiting forever
                    traceback.print_exc()  # the server's log has the traceback; responses never do
                    self.core.abort(None, f"engine step failed: {type(err).__name__}", 500, "InternalError")
                self._busy_s += time.monotonic() - start
            if self.log_interval_s and self._busy_s - self._logged[0] >= self.log_interval_s:
                self._log_throughput()

    def _log_throughput(self) -> None:
        """One line of what the engine did since the last (rates per second of steps, idle time not
        counted), as SGLang's periodic decode-batch log."""
        now, counters = self._busy_s, dict(self.core.counters)
        (then, before), self._logged = self._logged, (now, counters)
        delta = {k: v - before[k] for k, v in counters.items()}
        seconds, steps = max(now - then, 1e-9), max(delta["decode_steps"], 1)
        waiting = len(self.core.waiting) + len(self.core.incoming)
        print(
            f"[engine] {seconds:.1f} s of steps: decode {delta['decode_steps']} steps, "
            f"{delta['decode_tokens'] / steps:.1f} running/step, {delta['decode_tokens'] / seconds:.0f} tok/s; "
            f"prefill {delta['prefill_requests']} requests in {delta['prefill_forwards']} forwards "
            f"({delta['prefill_positions']} positions); now {len(self.core.running)} running, {waiting} waiting; "
            f"weight version {self.core.version}",
            file=sys.stderr,
            flush=True,
        )

    async def _on_engine(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.engine_thread, fn, *args)

    def _poke(self) -> None:
        self._wake.set()

    async def _woken_within(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
            return True
        except TimeoutError:
            return False

    # -- control ------------------------------------------------------------------------
    async def abort(self, request):
        from aiohttp import web

        body = await json_object(request)
        async with self._model_lock:  # not in the middle of a step
            self.core.abort(None if body.get("abort_all") else body.get("rid"))
        return web.Response(status=200)

    async def pause(self, request):
        from aiohttp import web

        mode = (await json_object(request)).get("mode", "abort")
        if mode not in protocol.PAUSE_MODES:
            raise ValueError(f"mode must be one of {protocol.PAUSE_MODES}, got {mode!r}")
        self.paused = mode
        async with self._model_lock:
            if mode == "abort":
                self.core.abort(None)
            elif mode == "retract":
                self.core.drop_caches()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request):
        from aiohttp import web

        self.paused = None
        self._poke()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def release_memory(self, request):
        from aiohttp import web

        tags = await self._memory_tags(request)
        async with self._model_lock:  # not in the middle of a step
            await self._on_engine(self.core.release_memory, tags, self.paused is not None)
        return web.json_response(None)  # SGLang answers null

    async def resume_memory(self, request):
        from aiohttp import web

        tags = await self._memory_tags(request)
        async with self._model_lock:
            await self._on_engine(self.core.resume_memory, tags)
        self._poke()
        return web.json_response(None)

    @staticmethod
    async def _memory_tags(request) -> list[str]:
        body = await json_object(request) if request.can_read_body else {}
        tags = (body or {}).get("tags")
        return list(protocol.MEMORY_TAGS) if not tags else protocol.memory_tags(tags)  # none or empty: all

    async def health(self, request):
        from aiohttp import web

        return web.Response(status=200)

    async def metrics(self, request):
        """Prometheus text: seconds spent computing, the core's running totals, the queue."""
        from aiohttp import web

        values = {
            "busy_seconds_total": self._busy_s,
            **{f"{name}_total": value for name, value in self.core.counters.items()},
            "running_requests": len(self.core.running),
            "waiting_requests": len(self.core.waiting) + len(self.core.incoming),
        }
        lines = [f"{METRIC_PREFIX}{name} {float(value)!r}" for name, value in values.items()]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def model_info(self, request):
        from aiohttp import web

        return web.json_response(
            {"model_path": self.core.model_dir, "weight_version": self.core.version, "is_generation": True}
        )

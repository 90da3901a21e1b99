"""The embedded engine: SGLang's HTTP subset, served on CPU for the demo, tests and CI.

    python -m bapo_megatron.engines.embedded --model HF_DIR --port 30000 [--host 127.0.0.1]

Same payloads as SGLang 0.5.23 (common/protocol.py): /generate with logprobs,
/abort_request, /pause_generation (abort | retract | in_place), /continue_generation,
/health, /health_generate, /ready, /model_info, /begin_weight_update, /end_weight_update,
/init_weights_update_group, /destroy_weights_update_group, /update_weights_from_distributed
(gloo; the trainer is rank 0), /update_weights_from_tensor (shared-memory handles from a
process on the same host, common/ipc.py), /update_weights_from_disk (safetensors only),
/update_weight_version, /release_memory_occupation and /resume_memory_occupation (the KV
cache and the weights' memory freed while a colocated trainer runs; released weights lose
their values, as under SGLang's memory saver, and generation is refused until they are
loaded again).

Security as SGLang's: it listens on loopback unless --host names an interface, and then
refuses to start without an admin key. With an admin key (BAPO_ADMIN_API_KEY, or
--admin-api-key-file), the control endpoints answer 401 unless the request carries
`Authorization: Bearer KEY`; with an API key (BAPO_API_KEY), so do the others (health aside).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import math
import os
import secrets
import signal
import sys
import time
import traceback
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from bapo_megatron.common import protocol
from bapo_megatron.common.weight_group import join_requested, leave_group
from bapo_megatron.engines.embedded.core import EngineCore, Request, one_line
from bapo_megatron.engines.launcher import is_loopback

OPEN_PATHS = ("/health", "/ready", "/metrics")
METRIC_PREFIX = "bapo_engine_"
"""/metrics names: bapo_engine_busy_seconds_total (time in model steps), the core's counters, the queue."""
CONTROL_BODY_LIMIT = 64 << 20  # weight updates carry names and handles, never the tensors themselves


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


class EmbeddedServer:
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
        app[_request_timeout_key()] = self.request_timeout_s
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
            "/release_memory_occupation": self.release_memory,
            "/resume_memory_occupation": self.resume_memory,
        }
        for path, handler in get.items():
            app.router.add_get(path, handler)
        for path, handler in post.items():
            app.router.add_post(path, _guarded(handler))
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
                if not self.core.busy:  # idle: give back the cache's memory (it grows back on demand)
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

    # -- generation -----------------------------------------------------------------------
    async def generate(self, request):
        from aiohttp import web

        context = self.core.context_length
        body = await _json_object(request, GENERATE_BODY_BASE + GENERATE_BYTES_PER_TOKEN * context)
        if "input_ids" not in body or body.get("text") is not None:
            raise ValueError("the embedded engine takes input_ids (token ids), not text")
        if body.get("stream"):
            raise ValueError("stream=true is not supported by the embedded engine")
        ids = body["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("input_ids must be one list of token ids (batches: one request each)")
        sampling = protocol.SamplingParams.from_json(body.get("sampling_params") or {})
        if len(ids) + sampling.max_new_tokens > context:
            raise ValueError(
                f"{len(ids)} prompt tokens + max_new_tokens {sampling.max_new_tokens} = "
                f"{len(ids) + sampling.max_new_tokens} exceed the model's context length {context}"
            )
        rid = body.get("rid") or uuid.uuid4().hex
        if not isinstance(rid, str):
            raise ValueError(f"rid={rid!r}: must be a string")
        refused = self.core.can_generate()
        if refused:
            raise ValueError(f"cannot generate: {refused}")
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def finished(r: Request) -> None:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(r))

        self.core.add(Request(rid, ids, sampling, on_finish=finished))  # joins at the next step
        self._poke()
        try:
            r = await done
        except asyncio.CancelledError:  # the client went away: stop generating for it
            task = loop.create_task(self._abort_quietly(rid, "client disconnected"))
            self._background.add(task)  # held until done (the loop keeps only weak references)
            task.add_done_callback(self._background.discard)
            raise
        return web.json_response(
            protocol.generate_response(
                r.rid,
                r.output_ids,
                r.logprobs,
                r.finish,
                len(r.input_ids),
                self.core.version,
                [tuple(s) for s in r.spans],
            )
        )

    async def _abort_quietly(self, rid: str, message: str) -> None:
        async with self._model_lock:  # not in the middle of a step
            self.core.abort(rid, message)

    async def abort(self, request):
        from aiohttp import web

        body = await _json_object(request)
        async with self._model_lock:  # not in the middle of a step
            self.core.abort(None if body.get("abort_all") else body.get("rid"))
        return web.Response(status=200)

    async def pause(self, request):
        from aiohttp import web

        mode = (await _json_object(request)).get("mode", "abort")
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
        body = await _json_object(request) if request.can_read_body else {}
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

    # -- weights --------------------------------------------------------------------------
    async def begin_update(self, request):
        self.session_open = True
        return _ok("weight-update session open")

    async def end_update(self, request):
        self.session_open = False
        return _ok("weight-update session closed")

    def _need_session(self) -> None:
        if not self.session_open:
            raise ValueError("no weight-update session: call /begin_weight_update first (SGLang >= 0.5.21)")

    async def init_group(self, request):
        body = await _json_object(request)
        name = body.get("group_name", protocol.DEFAULT_GROUP)
        if name in self.groups:
            raise ValueError(f"already in weight-update group {name!r}: /destroy_weights_update_group first")
        name, self.groups[name] = await asyncio.to_thread(join_requested, body, protocol.DEFAULT_GROUP)
        return _ok(f"joined {name}")

    async def destroy_group(self, request):
        name = (await _json_object(request)).get("group_name", protocol.DEFAULT_GROUP)
        if name not in self.groups:
            raise ValueError(f"no weight-update group {name!r} to destroy")  # SGLang answers 400 too
        await asyncio.to_thread(leave_group, self.groups.pop(name))
        return _ok(f"left {name}")

    async def update_from_distributed(self, request):
        body = await _json_object(request)
        self._need_session()
        name = body.get("group_name", protocol.DEFAULT_GROUP)
        if name not in self.groups:
            raise ValueError(f"no weight-update group {name!r}: call /init_weights_update_group first")
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError("names, dtypes and shapes differ in length")
        group = self.groups[name]
        torch_dtypes = [protocol.torch_dtype(d) for d in dtypes]
        flattened = body.get("load_format") == protocol.FLATTENED
        if body.get("load_format") not in (None, protocol.FLATTENED):
            raise ValueError(f"load_format {body['load_format']!r}: expected none or {protocol.FLATTENED!r}")
        layout = protocol.flattened_layout(torch_dtypes, shapes) if flattened else None

        def receive() -> list[tuple[str, torch.Tensor]]:
            if flattened:
                flat = torch.empty(layout[-1][1] if layout else 0, dtype=torch.uint8)
                dist.broadcast(flat, src=0, group=group)
                return [
                    (n, flat[a:b].view(d).reshape(s))
                    for n, d, s, (a, b) in zip(names, torch_dtypes, shapes, layout, strict=True)
                ]
            out = []
            for n, d, s in zip(names, torch_dtypes, shapes, strict=True):
                tensor = torch.empty(s, dtype=d)
                dist.broadcast(tensor, src=0, group=group)
                out.append((n, tensor))
            return out

        async with self._model_lock:
            tensors = await asyncio.to_thread(receive)  # every broadcast is joined before anything is checked
            await self._on_engine(self.core.load_weights, tensors)
            refused = self._after_update(body)
        return _ok(f"updated {len(tensors)} tensors", refused)

    async def update_from_tensor(self, request):
        import pickle

        from bapo_megatron.common import ipc

        body = await _json_object(request)
        self._need_session()
        payloads = body["serialized_named_tensors"]
        if not isinstance(payloads, list) or len(payloads) != 1:
            raise ValueError(
                f"serialized_named_tensors: the embedded engine is one rank and takes one payload, "
                f"got {len(payloads) if isinstance(payloads, list) else type(payloads).__name__}"
            )
        load_format = body.get("load_format")
        if load_format not in (None, protocol.FLATTENED):
            raise ValueError(f"load_format {load_format!r}: expected none or {protocol.FLATTENED!r}")
        try:  # whatever the bytes are, a payload that does not decode is the client's error (400)
            payload = ipc.loads(payloads[0])  # restricted: tensor rebuilds and plain data only
            if load_format == protocol.FLATTENED:
                if not isinstance(payload, dict) or set(payload) != {"flattened_tensor", "metadata"}:
                    raise ValueError("a flattened_bucket payload is a dict of flattened_tensor and metadata")
                tensors = ipc.unflatten(payload)
            else:
                tensors = payload
        except (pickle.UnpicklingError, EOFError, OSError, RuntimeError, *BAD_REQUEST) as err:
            raise ValueError(f"serialized_named_tensors[0] does not decode: {type(err).__name__}: {err}") from None
        if not isinstance(tensors, list) or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
            for p in tensors
        ):
            raise ValueError("the payload must be a list of (name, tensor) pairs")
        async with self._model_lock:
            count = await self._on_engine(self.core.load_weights, tensors)
            refused = self._after_update(body)
        del payload, tensors  # the shared memory is released once the last view of it goes
        return _ok(f"updated {count} tensors", refused)

    async def update_from_disk(self, request):
        from bapo_megatron.common.hf_io import HFCheckpoint

        body = await _json_object(request)
        checkpoint = await asyncio.to_thread(HFCheckpoint, body["model_path"])  # validated; safetensors only
        async with self._model_lock:
            count = await self._on_engine(self.core.load_weights, ((k, checkpoint[k]) for k in list(checkpoint.files)))
            refused = self._after_update(body)
        return _ok(f"loaded {count} tensors from {body['model_path']}", refused)

    def _after_update(self, body: dict) -> str | None:
        """The new version, aborts and cache flush an update asks for; the failure to report, if any:
        as SGLang, a flush is refused while requests keep their cache (an in-place pause), and the
        update call fails though the weights were loaded."""
        if body.get("weight_version") is not None:
            self.core.version = str(body["weight_version"])
        if body.get("abort_all_requests"):
            self.core.abort(None)
        self._poke()
        if body.get("flush_cache", True):
            if self.paused == "in_place" and self.core.running:
                return (
                    "Weights were updated, but the cache was not flushed because requests are still running or "
                    "queued. Retract or finish them, then call /flush_cache."
                )
            self.core.flush()  # cached keys/values were computed with the old weights
        return None

    async def set_version(self, request):
        body = await _json_object(request)
        async with self._model_lock:
            self.core.version = str(body["new_version"])
            if body.get("abort_all_requests", True):
                self.core.abort(None)
        return _ok(f"weight version {self.core.version}")


def _ok(message: str, refused: str | None = None):
    """SGLang's answer to a control call: success and a message; a refusal is success false, HTTP 200."""
    from aiohttp import web

    return web.json_response({"success": refused is None, "message": refused or message})


BAD_REQUEST = (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError, RecursionError)
"""What a malformed body raises (missing fields, wrong types, deeply nested JSON): 400, as SGLang's."""


@functools.cache
def _request_timeout_key():
    """The app's key for the seconds a client has to send a request body (headers: aiohttp's keep-alive timer)."""
    from aiohttp import web

    return web.AppKey("request_timeout_s", float)


GENERATE_BODY_BASE, GENERATE_BYTES_PER_TOKEN = 64 << 10, 24
"""/generate's body limit: room for a context of token ids (a JSON id and its comma take at most
~12 bytes) and sampling parameters; anything larger is refused before it is parsed (413)."""


def _guarded(handler):
    """Bad requests answer 400 with the reason, as SGLang's do; anything else 500 with one line
    (the traceback goes to the server's log, never into a response)."""
    from aiohttp import web

    async def wrapped(request):
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except BAD_REQUEST as err:
            return web.json_response({"success": False, "message": f"{type(err).__name__}: {err}"}, status=400)
        except Exception as err:
            traceback.print_exc()
            message = f"internal error: {one_line(err)}"
            return web.json_response({"success": False, "message": message}, status=500)

    return wrapped


async def _json_object(request, limit: int | None = None) -> dict:
    """The request's JSON body, which must be an object (a list, a number or garbage: 400). With
    `limit`: a body over that many bytes is refused (413), a declared length before anything is
    read; otherwise the app's client_max_size bounds it."""
    import json

    from aiohttp import web

    if limit is not None and request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    try:
        async with asyncio.timeout(request.app[_request_timeout_key()]):  # a slow client holds a connection
            raw = await request.read()
    except TimeoutError:
        seconds = request.app[_request_timeout_key()]
        raise web.HTTPRequestTimeout(text=f"the request body took over {seconds:g} s") from None
    if limit is not None and len(raw) > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(raw))
    body = json.loads(raw)
    if not isinstance(body, dict):
        raise ValueError(f"the request body must be a JSON object, not {type(body).__name__}")
    return body


def _key(env: str, file: str | None) -> str | None:
    """A key from its file, else from $env; None when neither is given. A key file or variable
    that is given but empty or blank is an error: taken as no key, it would turn auth off."""
    if file:
        key, source = Path(file).read_text().strip(), f"key file {file}"
    elif env in os.environ:
        key, source = os.environ[env].strip(), f"${env}"
    else:
        return None
    if not key:
        raise ValueError(f"{source} is empty: set a key, or leave it out to run without one on loopback")
    return key


def _model_dir_problem(model: Path) -> str | None:
    """What keeps `model` from being served (checked before the model is built), or None."""
    if not model.is_dir():
        return "no such directory"
    if not (model / "config.json").is_file():
        return "no config.json (a Hugging Face model directory is needed)"
    if not any(model.glob("*.safetensors")):
        return "no *.safetensors weights (only safetensors are read, never pickles)"
    from bapo_megatron.common.hf_io import HFCheckpoint

    try:
        HFCheckpoint(model)  # every tensor config.json implies, with its shape, in floating point
    except (ValueError, KeyError, OSError) as err:
        return str(err)
    return None


def _in_range(low: int, high: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside [{low}, {high}]")
        return value

    return parse


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{value} must be a finite number >= 0")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bapo_megatron.engines.embedded",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="HF model directory (safetensors)")
    parser.add_argument("--port", type=_in_range(1, 65535), required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch", type=_in_range(1, 1 << 16), default=64, help="requests decoded together")
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="every request alone in its forwards: its output never depends on what else runs (deterministic runs)",
    )
    parser.add_argument(
        "--log-interval",
        type=_non_negative,
        default=30.0,
        help="seconds between throughput lines on stderr while busy (0: none)",
    )
    parser.add_argument(
        "--request-timeout",
        type=_non_negative,
        default=60.0,
        help="seconds a client has to send a request's headers and body (slow clients hold a connection each)",
    )
    parser.add_argument("--admin-api-key-file", help="file holding the admin key (else $BAPO_ADMIN_API_KEY)")
    parser.add_argument("--api-key-file", help="file holding the API key (else $BAPO_API_KEY)")
    args = parser.parse_args(argv)
    try:
        admin_key = _key("BAPO_ADMIN_API_KEY", args.admin_api_key_file)
        api_key = _key("BAPO_API_KEY", args.api_key_file)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not is_loopback(args.host) and admin_key is None:
        print(
            f"error: --host {args.host} is not loopback: set an admin key (BAPO_ADMIN_API_KEY or "
            "--admin-api-key-file) so that weight updates and pauses are protected",
            file=sys.stderr,
        )
        return 2
    problem = _model_dir_problem(Path(args.model))
    if problem:
        print(f"error: --model {args.model}: {problem}", file=sys.stderr)
        return 2
    from aiohttp import web

    # Slurm's warning signal (SIGUSR1) is for the driver, which saves and then stops its engines
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    engine_thread = concurrent.futures.ThreadPoolExecutor(1, "engine")  # the model is built where it will run
    core = engine_thread.submit(EngineCore, args.model, args.seed, args.max_batch, args.batch_invariant).result()
    server = EmbeddedServer(core, api_key, admin_key, engine_thread, args.log_interval, args.request_timeout)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request;
    # keepalive_timeout also closes a connection that has not sent its request's headers by then
    web.run_app(
        server.app(),
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
        handler_cancellation=True,
        keepalive_timeout=args.request_timeout,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

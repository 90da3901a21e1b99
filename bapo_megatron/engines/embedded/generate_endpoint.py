"""The embedded server's /generate, as SGLang 0.5.23's: one request (input_ids a list of token ids) or a
batch of them (input_ids a list of lists, common/generate_batch.py), answered with one body or a list.

Every row of a batch is checked as a single request is (token ids, sampling parameters, the context
length, rid, routes asked for, the adapter it names) before any row is queued: a bad row refuses the
whole batch (400) and nothing runs. The rows then run as requests of their own, each abortable by its
rid, and the answer comes once every row has finished, as SGLang's non-streaming batch answers. A
client that goes away aborts the rows still running.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from bapo_megatron.common import generate_batch, protocol
from bapo_megatron.engines.embedded.http import json_object
from bapo_megatron.engines.embedded.request_queue import EngineRequest

GENERATE_BODY_BASE, GENERATE_BYTES_PER_TOKEN = 64 << 10, 24
"""/generate's body limit: room for a context of token ids (a JSON id and its comma take at most
~12 bytes) and sampling parameters, per request (a batch: per request the engine runs at once); anything
larger is refused before it is parsed (413)."""


@dataclass
class Row:
    """One request of a /generate body, checked."""

    rid: str
    ids: list[int]
    sampling: protocol.SamplingParams
    routes_from: int | None
    lora_path: object


class GenerateEndpoint:
    """/generate for EmbeddedServer (its core, LoRA names, wake-up and background tasks)."""

    async def generate(self, request):
        from aiohttp import web

        one = GENERATE_BODY_BASE + GENERATE_BYTES_PER_TOKEN * self.core.context_length
        body = await json_object(request, one * self.core.loop.max_batch)  # a batch: room for what runs at once
        batch = generate_batch.is_batch(body)
        if not batch and (request.content_length or 0) > one:
            raise web.HTTPRequestEntityTooLarge(max_size=one, actual_size=request.content_length)
        rows = [self._checked_row(row) for row in (generate_batch.split_batch(body) if batch else [body])]
        refused = self.core.can_generate()
        if refused:
            raise ValueError(f"cannot generate: {refused}")
        finished = await self._run_rows(rows)
        answers = [self._answer(row, r) for row, r in zip(rows, finished, strict=True)]
        return web.json_response(answers if batch else answers[0])

    def _checked_row(self, body: dict) -> Row:
        """One request's fields, checked as SGLang checks them; ValueError naming the first wrong one."""
        context = self.core.context_length
        if "input_ids" not in body or body.get("text") is not None:
            raise ValueError("the embedded engine takes input_ids (token ids), not text")
        if body.get("stream"):
            raise ValueError("stream=true is not supported by the embedded engine")
        ids = body["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("input_ids must be a list of token ids, or a list of such lists (a batch)")
        sampling = protocol.SamplingParams.from_json(body.get("sampling_params") or {})
        if len(ids) + sampling.max_new_tokens > context:
            raise ValueError(
                f"{len(ids)} prompt tokens + max_new_tokens {sampling.max_new_tokens} = "
                f"{len(ids) + sampling.max_new_tokens} exceed the model's context length {context}"
            )
        rid = body.get("rid") or uuid.uuid4().hex
        if not isinstance(rid, str):
            raise ValueError(f"rid={rid!r}: must be a string")
        return Row(rid, ids, sampling, self._routes_from(body, len(ids)), body.get("lora_path"))

    def _routes_from(self, body: dict, prompt_tokens: int) -> int | None:
        """The first position whose routes the request asks for (None: no routes), checked as
        SGLang checks routed_experts_start_len: in [0, prompt tokens]."""
        wanted = body.get("return_routed_experts", False)
        if not isinstance(wanted, bool):
            raise ValueError(f"return_routed_experts={wanted!r}: must be true or false")
        if not wanted:
            return None
        if self.core.route_recorder is None:
            raise ValueError("return_routed_experts: the served model is dense, it routes to no experts")
        start = body.get("routed_experts_start_len", 0)
        if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= prompt_tokens:
            raise ValueError(
                f"routed_experts_start_len={start!r}: must be an integer in [0, {prompt_tokens}] (the input's length)"
            )
        return start

    async def _run_rows(self, rows: list[Row]) -> list[EngineRequest]:
        """Queue the rows (each adapter they name in use until the row finishes) and wait for all of them."""
        loop = asyncio.get_running_loop()
        lora_ids = []
        try:
            for row in rows:  # every name checked before anything is queued
                lora_ids.append(self.loras.acquire(row.lora_path))
        except BaseException:
            for lora_id in lora_ids:
                self.loras.release(lora_id)
            raise
        done = [loop.create_future() for _ in rows]

        def finisher(future: asyncio.Future):
            def settle(r: EngineRequest) -> None:  # on the loop: the adapter names live there
                self.loras.release(r.lora_id)
                if not future.done():
                    future.set_result(r)

            return lambda r: loop.call_soon_threadsafe(settle, r)  # called on the engine's thread

        for i, (row, lora_id) in enumerate(zip(rows, lora_ids, strict=True)):
            try:
                request = EngineRequest(row.rid, row.ids, row.sampling, on_finish=finisher(done[i]), lora_id=lora_id)
                self.core.add(request)  # joins at a step
            except BaseException:
                for lora_id in lora_ids[i:]:
                    self.loras.release(lora_id)
                self._abort_in_background([r.rid for r in rows[:i]], "the rest of its batch was refused")
                raise
        self._poke()
        try:
            return list(await asyncio.gather(*done))
        except asyncio.CancelledError:  # the client went away: stop generating for it
            running = [row.rid for row, f in zip(rows, done, strict=True) if f.cancelled() or not f.done()]
            self._abort_in_background(running)  # (gather cancelled the futures of the rows still running)
            raise

    def _abort_in_background(self, rids: list[str], message: str = "client disconnected") -> None:
        if not rids:
            return
        task = asyncio.get_running_loop().create_task(self._abort_quietly(rids, message))
        self._background.add(task)  # held until done (the loop keeps only weak references)
        task.add_done_callback(self._background.discard)

    async def _abort_quietly(self, rids: list[str], message: str) -> None:
        async with self._model_lock:  # not in the middle of a step
            for rid in rids:
                self.core.abort(rid, message)

    def _answer(self, row: Row, r: EngineRequest) -> dict:
        routes = None if row.routes_from is None else self.core.route_recorder.response(r.routes, row.routes_from)
        spans = [tuple(s) for s in r.spans]
        return protocol.generate_response(
            r.rid, r.output_ids, r.logprobs, r.finish, len(r.input_ids), self.core.version, spans, routes
        )

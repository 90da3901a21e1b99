"""Async HTTP client for one SGLang server (or the embedded engine): generation, control, weights.

Every call names the server and endpoint in its errors. Timeouts, refused connections and
5xx answers are retried with exponential backoff up to `retries` times, then raised as
EngineUnavailable (the caller drops the server and resubmits its requests elsewhere); 4xx
answers are raised at once as EngineError with the server's message. A /generate retry
first aborts its request ids on the server, so a request is never generating twice. Requests
that are waited for together (a group's samples) may go out in one /generate call (`together`).

A /generate answer is checked in full on arrival, against the protocol and against the model the
engine serves (`ServedModel`: token ids in its vocabulary, log-probs finite and <= 0, one per
token, no more tokens than asked, routed experts of its shape for every position run). The routes
stay on the answer decoded, as a sample keeps them (`Completion.routes`): nothing after the client
decodes or checks them again. An answer that fails is raised as BadAnswer, an EngineUnavailable:
nothing of it is kept, the engine is retired and the request goes elsewhere (engines/pool.py
counts these and stops a run that meets too many).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from bapo_megatron.common import generate_batch, protocol
from bapo_megatron.common.protocol import Completion, MalformedResponse, SamplingParams
from bapo_megatron.common.routes import RouteShape
from bapo_megatron.models.spec import ModelSpec

CHECKSUM_MISMATCH = "weight checksum mismatch"
"""How an engine's refusal of an update whose tensors differ from their expected_checksums begins."""


def tensor_checksum(tensor) -> str:
    """A tensor's checksum as SGLang's expected_checksums has it (tp_worker's LoRA check): the sha256
    of its bytes in its own dtype, so that trainer and engine agree bit for bit."""
    import hashlib

    import torch

    data = tensor.detach().cpu().contiguous().flatten().view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).hexdigest()


def checksum_mismatch(expected: dict[str, str], tensors) -> str | None:
    """The first tensor of `tensors` ((name, tensor) pairs) whose checksum is not `expected`'s, as the
    line an engine refuses the update with; None when every expected one arrived intact."""
    received = dict(tensors)
    for name, want in expected.items():
        if name not in received:
            return f"{CHECKSUM_MISMATCH}: tensor {name} was expected but not received"
        got = tensor_checksum(received[name])
        if got != want:
            return f"{CHECKSUM_MISMATCH}: tensor {name} arrived with sha256 {got[:16]}, sent {want[:16]}"
    return None


class EngineError(RuntimeError):
    """The engine refused a request (4xx) or answered it with a failure."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.url, self.status = url, status


class EngineUnavailable(ConnectionError):
    """The engine did not answer (refused, timed out, or 5xx) after the retries."""


class BadAnswer(EngineUnavailable):
    """The engine answered /generate with what the protocol or its model rules out; the message names
    the engine (its URL), the request and what is wrong. Unavailable for this request, as after a 5xx."""


@dataclass(frozen=True)
class ServedModel:
    """What the model an engine serves can answer: token ids below vocab_size (ModelSpec's: the rows of
    the embedding past it are padding, never a token) and, when a run records them, routes of this shape."""

    vocab_size: int
    routes: RouteShape | None = None

    @classmethod
    def of(cls, spec: ModelSpec, routes: RouteShape | None) -> ServedModel:
        return cls(spec.vocab_size, routes)

    def problem(self, answer: Completion) -> str | None:
        """What makes `answer`'s tokens no tokens of this model (None: nothing)."""
        problem = protocol.token_problem(answer.output_ids, self.vocab_size)
        return f"output_ids: {problem}" if problem else None

    def checked_routes(self, answer: Completion, input_ids: list[int], routes_from: int | None) -> bytes | None:
        """The routes of `answer` (to a request of input_ids, with routes from position routes_from
        on) as a sample keeps them, checked: one per position run, each a router's choices of this
        model; MalformedResponse when they are not. None: none asked for, or none recorded."""
        if self.routes is None or routes_from is None:
            return None
        if not answer.output_ids and answer.finish == "abort" and not answer.routed_experts:
            return b""  # aborted while queued: no position ran (SGLang sends no routes, the embedded engine none)
        ran = len(input_ids) + len(answer.output_ids) - 1 - routes_from  # the last token is never fed in
        return self.routes.from_engine(answer.routed_experts, ran, "meta_info")


@dataclass(eq=False)
class _Pending:
    """One /generate request of ours until its answer is checked."""

    body: dict
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    routes_from: int | None
    answer: asyncio.Future | None = None  # (together with others) its answer, once their call comes back
    sent: bool = False


class EngineClient:
    def __init__(
        self,
        base_url: str,
        admin_key: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        served: ServedModel | None = None,
    ) -> None:
        """served: the model the engine serves, which /generate answers are checked against (None:
        against the protocol only, for a client of control calls or of an engine of any model)."""
        self.base_url = base_url.rstrip("/")
        self.admin_key, self.api_key = admin_key, api_key
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.served = served
        self._session = None
        self._closed = False
        self._forming: dict[Hashable, list[_Pending]] = {}  # requests to go out together at the loop's next turn
        self._background: set[asyncio.Task] = set()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the session; a request still running after this fails as EngineUnavailable
        instead of opening a session that nothing would close."""
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self):
        import aiohttp

        if self._closed:
            raise EngineUnavailable(f"{self.base_url}: the client is closed")
        if self._session is None:
            # aiohttp's default of 100 connections sent a 256-sample step in waves that prefilled and decoded apart
            connector, timeout = aiohttp.TCPConnector(limit=512), aiohttp.ClientTimeout(total=self.timeout_s)
            self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        return self._session

    def _headers(self, path: str) -> dict[str, str]:
        key = (self.admin_key or self.api_key) if path in protocol.ADMIN_ENDPOINTS else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def request(
        self, path: str, body: dict | None = None, method: str = "POST", retry: bool = True, raw: bool = False
    ) -> Any:
        """One call; JSON (or None for an empty body) back, or the text when raw. Retries as the module says."""
        import aiohttp

        url = self.base_url + path
        attempts = 1 + (self.retries if retry else 0)
        last: Exception | None = None
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with self._http().request(method, url, json=body, headers=self._headers(path)) as resp:
                    text = await resp.text()
                    if resp.status >= 500:
                        last = EngineError(url, resp.status, text[:500])
                        continue
                    if resp.status >= 400:
                        raise EngineError(url, resp.status, text[:500])
                    if raw:
                        return text
                    if not text:
                        return None
                    try:
                        return await resp.json(content_type=None)
                    except ValueError:
                        raise protocol.MalformedResponse(f"{url}: not JSON: {text[:200]!r}") from None
            except (TimeoutError, aiohttp.ClientConnectionError) as err:
                last = err
        raise EngineUnavailable(f"{url}: no answer after {attempts} attempt(s): {last}")

    # -- generation -----------------------------------------------------------------------
    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        rid: str,
        routes_from: int | None = None,
        lora_path: str | None = None,
        together: Hashable | None = None,
    ) -> Completion:
        """One /generate request; routes_from: also the routed experts of positions from there on;
        lora_path: the name of a LoRA adapter loaded before, to generate under (None: the base model).
        together: requests given the same key in one turn of the event loop go out in one /generate
        call (SGLang's batch form, common/generate_batch.py), each answered once all of them have
        finished: for requests that are waited for together anyway (a group's samples). Each stays
        abortable by its rid. None: a call of its own. BadAnswer when the answer fails the checks
        (the module says which); an answer to a batch that is no list of one per request fails them all."""
        body = protocol.generate_request(input_ids, sampling, rid, routed_experts_start_len=routes_from)
        if lora_path is not None:
            body["lora_path"] = lora_path  # SGLang's field name, though it holds the adapter's name
        pending = _Pending(body, rid, input_ids, sampling.max_new_tokens, routes_from)
        if together is None:
            return self._checked_answer((await self._post_generate([pending]))[0], pending)
        return await self._join(pending, (together, routes_from))  # routes are asked for once a batch

    async def _post_generate(self, requests: list[_Pending]) -> list[Any]:
        """One /generate call for `requests` (the batch form for more than one): each one's answer body.
        A retry first aborts them on the server, so that none is ever generating twice."""
        body = requests[0].body if len(requests) == 1 else generate_batch.batch_request([r.body for r in requests])
        for attempt in range(self.retries + 1):
            try:
                result = await self.request("/generate", body, retry=False)
                break
            except MalformedResponse as err:  # not JSON
                raise BadAnswer(str(err)) from None
            except EngineUnavailable:
                if attempt == self.retries:
                    raise
                await asyncio.sleep(self.backoff_s * 2**attempt)
                for r in requests:
                    with contextlib.suppress(EngineUnavailable, EngineError):
                        await self.abort(r.rid)
        if len(requests) == 1:
            return [result]
        try:
            return generate_batch.batch_answers(result, [r.rid for r in requests], self.base_url)
        except MalformedResponse as err:
            raise BadAnswer(str(err)) from None

    async def _join(self, pending: _Pending, key: Hashable) -> Completion:
        """`pending` joins the call that requests of `key` form in this turn of the loop (the first
        schedules it); its answer, when that call comes back."""
        loop = asyncio.get_running_loop()
        forming = self._forming.get(key)
        if forming is None:
            forming = self._forming[key] = []
            loop.call_soon(self._send_formed, key)
        forming.append(pending)
        pending.answer = loop.create_future()
        try:
            return await pending.answer
        except asyncio.CancelledError:  # its caller gave up: it no longer generates, its batch goes on
            if pending in self._forming.get(key, ()):
                self._forming[key].remove(pending)
            elif pending.sent:
                self._in_background(self._abort_quietly(pending.rid))
            raise

    def _send_formed(self, key: Hashable) -> None:
        requests = [r for r in self._forming.pop(key, []) if not r.answer.done()]
        if requests:
            self._in_background(self._answer_together(requests))

    async def _answer_together(self, requests: list[_Pending]) -> None:
        for r in requests:
            r.sent = True
        try:
            results = await self._post_generate(requests)
        except asyncio.CancelledError:
            for r in requests:
                r.answer.cancel()
            raise
        except Exception as err:  # the call failed: so did every request in it
            for r in requests:
                if not r.answer.done():
                    r.answer.set_exception(err)
            return
        for r, result in zip(requests, results, strict=True):
            if r.answer.done():
                continue
            try:
                r.answer.set_result(self._checked_answer(result, r, batched=True))
            except BadAnswer as err:
                r.answer.set_exception(err)

    def _in_background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)  # held until done (the loop keeps only weak references)
        task.add_done_callback(self._background.discard)

    async def _abort_quietly(self, rid: str) -> None:
        with contextlib.suppress(EngineUnavailable, EngineError):
            await self.abort(rid)

    def _checked_answer(self, result: Any, pending: _Pending, batched: bool = False) -> Completion:
        rid = pending.rid
        try:
            answer = protocol.parse_generate_response(result, rid, source=self.base_url)
        except MalformedResponse as err:
            raise BadAnswer(str(err)) from None
        problem = None
        if batched and answer.rid != rid:  # a batch's answers come in the order of its requests
            problem = f"the answer in its place is for {answer.rid!r}"
        elif len(answer.output_ids) > pending.max_new_tokens:
            problem = f"{len(answer.output_ids)} output tokens for max_new_tokens {pending.max_new_tokens}"
        elif self.served is not None:
            problem = self.served.problem(answer)
            if problem is None:
                try:
                    answer.routes = self.served.checked_routes(answer, pending.input_ids, pending.routes_from)
                except MalformedResponse as err:
                    problem = str(err)
        if problem:
            raise BadAnswer(f"{self.base_url}/generate response for {rid}: {problem}")
        return answer

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request (its /generate call returns the partial output), or every request."""
        await self.request("/abort_request", {"rid": rid} if rid else {"abort_all": True}, retry=False)

    async def pause(self, mode: str = "abort") -> None:
        await self.request("/pause_generation", protocol.pause_request(mode))

    async def resume(self) -> None:
        await self.request("/continue_generation", protocol.continue_request())

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free the engine's memory for `tags` (weights, kv_cache, cuda_graph; None: all), e.g. while a
        colocated trainer runs. The engine must be idle or paused. Released weights lose their
        values: resume them and load weights before generating again."""
        await self.request("/release_memory_occupation", protocol.memory_request(tags))

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take back the memory of released `tags` (None: all)."""
        await self.request("/resume_memory_occupation", protocol.memory_request(tags))

    async def health(self) -> bool:
        try:
            await self.request("/health", method="GET", retry=False)
            return True
        except (EngineUnavailable, EngineError):
            return False

    async def metrics(self) -> dict[str, float]:
        """The engine's /metrics (Prometheus text) as {name: value}; labelled series keep their labels
        in the name. Empty when the engine exports none (SGLang without --enable-metrics answers 404)."""
        try:
            text = await self.request("/metrics", method="GET", retry=False, raw=True)
        except EngineError:
            return {}
        values = {}
        for line in str(text or "").splitlines():
            name, _, value = line.rpartition(" ")
            if name and not line.startswith("#"):
                try:
                    values[name] = float(value)
                except ValueError:
                    continue
        return values

    async def model_info(self) -> dict:
        return await self.request("/model_info", method="GET")

    # -- weights --------------------------------------------------------------------------
    async def _checked(self, path: str, body: dict) -> str:
        result = await self.request(path, body, retry=False)
        if isinstance(result, dict) and result.get("success") is False:
            raise EngineError(self.base_url + path, 200, str(result.get("message")))
        return str((result or {}).get("message", ""))

    async def begin_weight_update(self) -> None:
        await self._checked("/begin_weight_update", {})

    async def end_weight_update(self) -> None:
        await self._checked("/end_weight_update", {})

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = protocol.DEFAULT_GROUP,
        backend: str = "nccl",
    ) -> None:
        await self._checked(
            "/init_weights_update_group",
            protocol.init_group_request(master_address, master_port, rank_offset, world_size, group_name, backend),
        )

    async def destroy_weights_update_group(self, group_name: str = protocol.DEFAULT_GROUP) -> None:
        """Leave the weight-update group `group_name` (before a new one of that name is built)."""
        await self._checked("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: str,
        group_name: str = protocol.DEFAULT_GROUP,
        flattened: bool = False,
        flush_cache: bool = True,
        expected_checksums: dict[str, str] | None = None,
    ) -> None:
        """Announce one bucket; the caller broadcasts it (one flattened uint8 tensor, or each tensor
        in this order) while this call waits. flush_cache: drop the engine's prefix cache after
        loading (once per sync: with its last bucket). expected_checksums: {name: tensor_checksum}
        the engine checks what it received against (embedded engines only: SGLang takes none here)."""
        body = protocol.update_distributed_request(
            names, dtypes, shapes, version, group_name, flush_cache, flattened=flattened
        )
        await self._checked("/update_weights_from_distributed", _with_checksums(body, expected_checksums))

    async def update_weights_from_tensor(
        self,
        serialized: list[str],
        version: str,
        flattened: bool = True,
        flush_cache: bool = True,
        expected_checksums: dict[str, str] | None = None,
    ) -> None:
        """Colocated: tensor handles (common/ipc.py), one payload per engine TP rank."""
        body = protocol.update_tensor_request(serialized, version, flattened, flush_cache)
        await self._checked("/update_weights_from_tensor", _with_checksums(body, expected_checksums))

    async def update_weights_from_disk(self, model_path: str, version: str) -> None:
        await self._checked("/update_weights_from_disk", protocol.update_disk_request(model_path, version))

    async def update_weight_version(self, version: str, abort_all_requests: bool = False) -> None:
        await self._checked(
            "/update_weight_version", {"new_version": version, "abort_all_requests": abort_all_requests}
        )

    # -- LoRA adapters (SGLang's; the base weights stay as they are) -----------------------
    async def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        config_dict: dict,
        serialized_named_tensors: list,
        load_format: str | None = None,
        expected_checksums: dict[str, str] | None = None,
    ) -> None:
        """Load a PEFT adapter as `lora_name`: config_dict is its adapter_config.json, the payloads its
        tensors by PEFT's names (common/ipc.py, one per engine TP rank, as update_weights_from_tensor's;
        load_format None or "flattened_bucket"), checked against expected_checksums {name:
        tensor_checksum} before loading. Not retried (a load is not idempotent); EngineError when
        refused: a name loaded already, a field or tensor that does not fit, a checksum mismatch."""
        body = {
            "lora_name": lora_name,
            "config_dict": config_dict,
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": load_format,
        }
        await self._lora_update("/load_lora_adapter_from_tensors", _with_checksums(body, expected_checksums))

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Load the PEFT adapter directory `lora_path` (on the engine's host) as `lora_name`."""
        await self._lora_update("/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path})

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Unload adapter `lora_name`: requests naming it are refused at once; the call returns once the
        requests still running under it have finished and it is freed (SGLang's order)."""
        await self._lora_update("/unload_lora_adapter", {"lora_name": lora_name})

    async def _lora_update(self, path: str, body: dict) -> None:
        result = await self.request(path, body, retry=False)
        if not isinstance(result, dict) or result.get("success") is not True:
            message = result.get("error_message") if isinstance(result, dict) else result
            raise EngineError(self.base_url + path, 200, f"{message!s:.500}")


def _with_checksums(body: dict, expected: dict[str, str] | None) -> dict:
    """An update request with SGLang's expected_checksums field, when there are checksums to check."""
    return body if expected is None else {**body, "expected_checksums": expected}

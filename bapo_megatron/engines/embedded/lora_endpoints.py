"""The embedded server's LoRA endpoints, as SGLang 0.5.23's: /load_lora_adapter (a PEFT directory on this
host), /load_lora_adapter_from_tensors (one payload as /update_weights_from_tensor's, its
expected_checksums checked before anything is loaded), /unload_lora_adapter, and the names a
/generate request gives as lora_path.

SGLang's rules, kept here: a name already loaded is refused; loads and unloads run one at a time; an
unload first takes the name away (a request naming it is refused from then on), then waits until no
request in flight uses the adapter, then frees it and answers; a request names an adapter loaded
before (no implicit load). Every answer is SGLang's LoRAUpdateOutput: success, error_message and the
loaded adapters by name (a refusal: HTTP 400).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import os
from pathlib import Path

import torch

from bapo_megatron.engines.client import CHECKSUM_MISMATCH
from bapo_megatron.engines.embedded.http import BAD_REQUEST, json_object
from bapo_megatron.engines.embedded.lora import TENSOR_SOURCE, Adapter
from bapo_megatron.engines.embedded.weight_updates import decode_payload, verify_checksums
from bapo_megatron.models.lora import PEFT_CONFIG, PEFT_WEIGHTS

"""What a PEFT adapter directory holds (the pickled adapter_model.bin is never read: it could run code)."""
CONFIG_LIMIT = 1 << 20  # an adapter_config.json is a few kB


class AdapterNames:
    """The adapter names requests can use (SGLang's LoRARegistry): name -> resident adapter, the
    requests in flight under each adapter, and the names whose unload waits for them. Event-loop only."""

    def __init__(self) -> None:
        self.by_name: dict[str, Adapter] = {}
        self.unloading: dict[str, Adapter] = {}
        self._users: collections.Counter[str] = collections.Counter()
        self._idle: dict[str, asyncio.Event] = {}

    def loaded(self) -> dict[str, str]:
        """SGLang's loaded_adapters: name -> the path it was loaded from (TENSOR_SOURCE: tensors)."""
        return {name: adapter.source for name, adapter in self.by_name.items()}

    def acquire(self, name: object) -> str | None:
        """The id of the adapter a request names (lora_path; None: the base), counted as in use until
        `release`; ValueError naming an adapter that is not loaded."""
        if name is None:
            return None
        if not isinstance(name, str):
            raise ValueError(f"lora_path={name!r:.100}: must be the name of a loaded adapter (one request, one name)")
        adapter = self.by_name.get(name)
        if adapter is None:
            raise ValueError(f"lora_path={name!r}: no adapter of that name is loaded (loaded: {sorted(self.by_name)})")
        self._users[adapter.id] += 1
        return adapter.id

    def release(self, adapter_id: str | None) -> None:
        """A request under `adapter_id` finished."""
        if adapter_id is None:
            return
        self._users[adapter_id] -= 1
        if not self._users[adapter_id]:
            del self._users[adapter_id]
            if adapter_id in self._idle:
                self._idle.pop(adapter_id).set()

    async def unregister(self, name: str) -> Adapter:
        """Take `name` away from requests and wait until none in flight uses its adapter; ValueError for
        a name not loaded. A name whose earlier unload was cut short (its caller went away) waits again."""
        adapter = self.unloading.get(name)
        if adapter is None:
            if name not in self.by_name:
                raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {sorted(self.by_name)})")
            adapter = self.unloading[name] = self.by_name.pop(name)
        if self._users[adapter.id]:
            await self._idle.setdefault(adapter.id, asyncio.Event()).wait()
        return adapter


def answer(names: AdapterNames, error: str | None = None):
    """SGLang's LoRAUpdateOutput as its server answers it (its BaseReq fields too); 400 when refused."""
    from aiohttp import web

    body = {
        "rid": None,
        "http_worker_ipc": None,
        "success": error is None,
        "error_message": error,
        "loaded_adapters": names.loaded(),
    }
    return web.json_response(body, status=200 if error is None else 400)


def _lora_call(handler):
    """A LoRA endpoint under the one-at-a-time lock, its refusals answered as SGLang's (400)."""

    @functools.wraps(handler)
    async def wrapped(self, request):
        body = await json_object(request)
        async with self._lora_lock:
            try:
                name = body["lora_name"]
                if not isinstance(name, str) or not name:
                    raise ValueError(f"lora_name={name!r:.100}: must be a non-empty string")
                await handler(self, name, body)
            except BAD_REQUEST as err:
                return answer(self.loras, f"{type(err).__name__}: {err}")
        return answer(self.loras)

    return wrapped


class LoRAEndpoints:
    """Mixed into EmbeddedServer (server.py), whose core, engine thread, `loras` and `_lora_lock` they use."""

    @_lora_call
    async def load_lora_adapter_from_tensors(self, name: str, body: dict) -> None:
        self._may_load(name)
        for field in ("lora_id", "added_tokens_config"):
            if body.get(field):  # SGLang's tokenizer manager makes lora_id; added tokens are not served
                raise ValueError(f"{field}={body[field]!r:.100}: not served by the embedded engine")
        if "config_dict" not in body:
            raise ValueError("config_dict: missing (the adapter's PEFT adapter_config.json)")

        def load() -> Adapter:
            tensors = decode_payload(body)
            _verify(body.get("expected_checksums"), tensors)
            return self.core.load_adapter(name, body["config_dict"], tensors, TENSOR_SOURCE)

        self.loras.by_name[name] = await self._on_engine(load)

    @_lora_call
    async def load_lora_adapter(self, name: str, body: dict) -> None:
        self._may_load(name)
        path = body["lora_path"]
        if not isinstance(path, str):
            raise ValueError(f"lora_path={path!r:.100}: must be a PEFT adapter directory on the engine's host")

        def load() -> Adapter:
            config, tensors = read_peft_dir(path)
            return self.core.load_adapter(name, config, tensors, path)

        self.loras.by_name[name] = await self._on_engine(load)

    @_lora_call
    async def unload_lora_adapter(self, name: str, body: dict) -> None:
        adapter = await self.loras.unregister(name)
        await self._on_engine(self.core.unload_adapter, adapter.id)
        del self.loras.unloading[name]

    def _may_load(self, name: str) -> None:
        """SGLang's refusals of a name: loaded already, or its unload not finished."""
        if name in self.loras.unloading:
            raise ValueError(
                f"LoRA adapter '{name}' has an incomplete unload. Retry the unload before loading it again."
            )
        if name in self.loras.by_name:
            raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")


def _verify(expected: object, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """The tensors as received against expected_checksums, as SGLang's tp_worker checks an adapter:
    every expected one intact (weight_updates.verify_checksums) and none besides; ValueError naming
    the first that is not."""
    verify_checksums(expected, tensors)
    extra = [name for name, _ in tensors if expected is not None and name not in expected]
    if extra:
        raise ValueError(f"{CHECKSUM_MISMATCH}: tensor {extra[0]} was received but not expected ({len(extra)} such)")


def read_peft_dir(path: str) -> tuple[object, list[tuple[str, torch.Tensor]]]:
    """A PEFT adapter directory's config (JSON) and tensors (safetensors), reading nothing else: each
    file a regular file in the directory itself, not a link; ValueError naming what is not so."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"lora_path {path}: not a directory on the engine's host (hub ids are not fetched)")
    files = {}
    for name in (PEFT_CONFIG, PEFT_WEIGHTS):
        file = root / name
        if file.is_symlink() or not file.is_file():
            raise ValueError(f"lora_path {path}: {name} is missing or not a regular file (links are not followed)")
        files[name] = file
    fd = os.open(files[PEFT_CONFIG], os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        raw = f.read(CONFIG_LIMIT + 1)
    if len(raw) > CONFIG_LIMIT:
        raise ValueError(f"lora_path {path}: {PEFT_CONFIG} is over {CONFIG_LIMIT} bytes")
    try:
        config = json.loads(raw)
        tensors = load_file(str(files[PEFT_WEIGHTS]))
    except (ValueError, OSError, SafetensorError) as err:
        raise ValueError(f"lora_path {path}: does not read as a PEFT adapter: {type(err).__name__}: {err}") from None
    return config, sorted(tensors.items())

"""The embedded server's weight-update endpoints: sessions, groups, and updates over a group, by
handle or from disk, with SGLang's version, abort and cache-flush rules."""

from __future__ import annotations

import asyncio
from collections import Counter

import torch
import torch.distributed as dist

from bapo_megatron.common import protocol
from bapo_megatron.common.weight_group import join_requested, leave_group
from bapo_megatron.engines.client import checksum_mismatch
from bapo_megatron.engines.embedded.http import BAD_REQUEST, json_object, ok


class WeightUpdateEndpoints:
    """Mixed into EmbeddedServer (server.py), whose core, model lock, session and groups they use."""

    async def begin_update(self, request):
        self.session_open = True
        return ok("weight-update session open")

    async def end_update(self, request):
        self.session_open = False
        return ok("weight-update session closed")

    def _need_session(self) -> None:
        if not self.session_open:
            raise ValueError("no weight-update session: call /begin_weight_update first (SGLang >= 0.5.21)")

    async def init_group(self, request):
        body = await json_object(request)
        name = body.get("group_name", protocol.DEFAULT_GROUP)
        if name in self.groups:
            raise ValueError(f"already in weight-update group {name!r}: /destroy_weights_update_group first")
        name, self.groups[name] = await asyncio.to_thread(join_requested, body, protocol.DEFAULT_GROUP)
        return ok(f"joined {name}")

    async def destroy_group(self, request):
        name = (await json_object(request)).get("group_name", protocol.DEFAULT_GROUP)
        if name not in self.groups:
            raise ValueError(f"no weight-update group {name!r} to destroy")  # SGLang answers 400 too
        await asyncio.to_thread(leave_group, self.groups.pop(name))
        return ok(f"left {name}")

    async def update_from_distributed(self, request):
        """The sender announces a bucket here, then broadcasts it. What the model cannot take is refused
        before anything is allocated or received, and the refusing engine leaves the group: the
        sender's broadcast then fails at once (it would otherwise wait for a receiver that never
        comes, or leave its bytes for the next update to receive) and the sender builds a new group."""
        body = await json_object(request)
        name = body.get("group_name", protocol.DEFAULT_GROUP)
        if not isinstance(name, str):
            raise ValueError(f"group_name={name!r}: must be a string")
        try:
            self._need_session()
            if name not in self.groups:
                raise ValueError(f"no weight-update group {name!r}: call /init_weights_update_group first")
            names, dtypes, shapes, layout = self._announced(body)
        except BAD_REQUEST as err:
            if name in self.groups:
                await asyncio.to_thread(leave_group, self.groups.pop(name))
                raise ValueError(f"{err} (refused before the broadcast: left group {name!r})") from None
            raise
        group = self.groups[name]

        def receive() -> list[tuple[str, torch.Tensor]]:
            if layout is not None:
                flat = torch.empty(layout[-1][1] if layout else 0, dtype=torch.uint8)
                dist.broadcast(flat, src=0, group=group)
                return [
                    (n, flat[a:b].view(d).reshape(s))
                    for n, d, s, (a, b) in zip(names, dtypes, shapes, layout, strict=True)
                ]
            out = []
            for n, d, s in zip(names, dtypes, shapes, strict=True):
                tensor = torch.empty(s, dtype=d)
                dist.broadcast(tensor, src=0, group=group)
                out.append((n, tensor))
            return out

        async with self._model_lock:
            tensors = await asyncio.to_thread(receive)  # every broadcast is joined before anything is loaded
            verify_checksums(body.get("expected_checksums"), tensors)
            await self._on_engine(self.core.load_weights, tensors)
            refused = self._after_update(body)
        return ok(f"updated {len(tensors)} tensors", refused)

    def _announced(self, body: dict) -> tuple[list[str], list[torch.dtype], list[list[int]], list | None]:
        """An announced bucket's names, dtypes and shapes, each one the model's, and its flattened
        layout (None: one broadcast per tensor); ValueError naming the first that is not."""
        names, dtypes, shapes = lists = body["names"], body["dtypes"], body["shapes"]
        if not all(isinstance(x, list) for x in lists) or len({len(x) for x in lists}) != 1:
            raise ValueError("names, dtypes and shapes must be lists of one length")
        if not all(isinstance(n, str) for n in names):
            raise ValueError("names must be strings")
        if len(set(names)) != len(names):  # each repeat would be allocated before the broadcast
            twice = sorted(n for n, k in Counter(names).items() if k > 1)
            raise ValueError(f"names must be distinct: {', '.join(twice)[:200]} announced more than once")
        if not all(isinstance(s, list) and all(type(d) is int and d >= 0 for d in s) for s in shapes):
            raise ValueError(f"shapes must be lists of sizes >= 0, got {shapes!r:.200}")
        if body.get("load_format") not in (None, protocol.FLATTENED):
            raise ValueError(f"load_format {body['load_format']!r}: expected none or {protocol.FLATTENED!r}")
        torch_dtypes = [protocol.torch_dtype(d) for d in dtypes]
        self.core.check_weights(zip(names, torch_dtypes, shapes, strict=True))
        flattened = body.get("load_format") == protocol.FLATTENED
        layout = protocol.flattened_layout(torch_dtypes, shapes) if flattened else None
        return names, torch_dtypes, shapes, layout

    async def update_from_tensor(self, request):
        body = await json_object(request)
        self._need_session()
        tensors = decode_payload(body)
        verify_checksums(body.get("expected_checksums"), tensors)
        async with self._model_lock:
            count = await self._on_engine(self.core.load_weights, tensors)
            refused = self._after_update(body)
        del tensors  # the shared memory is released once the last view of it goes
        return ok(f"updated {count} tensors", refused)

    async def update_from_disk(self, request):
        from bapo_megatron.common.hf_io import HFCheckpoint

        body = await json_object(request)
        checkpoint = await asyncio.to_thread(HFCheckpoint, body["model_path"])  # validated; safetensors only
        async with self._model_lock:
            count = await self._on_engine(self.core.load_weights, ((k, checkpoint[k]) for k in list(checkpoint.files)))
            refused = self._after_update(body)
        return ok(f"loaded {count} tensors from {body['model_path']}", refused)

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
        body = await json_object(request)
        async with self._model_lock:
            self.core.version = str(body["new_version"])
            if body.get("abort_all_requests", True):
                self.core.abort(None)
        return ok(f"weight version {self.core.version}")


def verify_checksums(expected: object, tensors: list) -> None:
    """Tensors as received against a request's expected_checksums (rollout.sync.verify; None: not
    asked), before any is loaded: ValueError (400) naming the first that differs, so the model keeps
    its weights."""
    if expected is None:
        return
    if not isinstance(expected, dict) or not all(isinstance(v, str) for v in expected.values()):
        raise ValueError("expected_checksums must map tensor names to sha256 hex strings")
    mismatch = checksum_mismatch(expected, tensors)
    if mismatch is not None:
        raise ValueError(mismatch)


def decode_payload(body: dict) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a tensor request's one payload (serialized_named_tensors, in its
    load_format: none or flattened_bucket), as update_weights_from_tensor and
    load_lora_adapter_from_tensors send them; ValueError (400) for a payload that does not decode."""
    import pickle

    from bapo_megatron.common import ipc

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
    return tensors

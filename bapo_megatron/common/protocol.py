"""The HTTP subset of SGLang 0.5.23 that the trainer speaks, as plain payloads and parsers.

One definition, used by the client (requests it sends, responses it parses) and by the
embedded engine (requests it accepts, responses it produces). Field names are SGLang's
(sglang/srt/managers/io_struct.py, entrypoints/http_server.py); tests/unit/test_conformance.py
reads them from the released wheel and fails when ours drift.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# Control endpoints: once a server has an admin key, only a request carrying it may call these
# (SGLang marks them ADMIN_OPTIONAL). /generate and health/info endpoints are not among them.
ADMIN_ENDPOINTS = frozenset(
    {
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        "/begin_weight_update",
        "/end_weight_update",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/update_weights_from_distributed",
        "/update_weights_from_tensor",
        "/update_weights_from_disk",
        "/update_weight_version",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/flush_cache",
        "/load_lora_adapter",
        "/load_lora_adapter_from_tensors",
        "/unload_lora_adapter",
    }
)
FINISH_TYPES = ("stop", "length", "abort")
PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # what /release_memory_occupation can free
DEFAULT_GROUP = "weight_update_group"


SAMPLING_EPS = 1e-6
"""Temperatures below this sample greedily (SGLang's _SAMPLING_EPS): dividing logits by them overflows."""


LOGPROB_SLACK = 1e-5
"""How far above 0 a sampled token's log-prob may lie. SGLang's is log_softmax of float32 logits, which
torch keeps <= 0 exactly; another kernel's rounding (a probability of 1 plus a few ulps) gives about 1e-7.
That is let through, as it came; anything larger is no log-probability."""


class MalformedResponse(ValueError):
    """An engine answered with a body that does not have the fields and types the protocol promises,
    or with values no model produces (a token id that is no id, a log-prob above 0)."""


def token_problem(ids: Sequence[object], vocab_size: int | None = None) -> str | None:
    """What makes `ids` no token ids of a model of `vocab_size` tokens (None: of any model), as text
    naming the first bad one; None when they all are. Rows of the embedding past vocab_size are
    padding: an id there is no token, and would train those rows silently."""
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            return f"token id {t!r} is not an integer >= 0 (at index {i})"
        if vocab_size is not None and t >= vocab_size:
            return f"token id {t!r} outside the model's vocabulary [0, {vocab_size}) (at index {i})"
    return None


def logprob_problem(values: Sequence[object]) -> str | None:
    """What makes `values` no log-probabilities of sampled tokens (each finite, <= LOGPROB_SLACK), as
    text naming the first bad one; None when they all are."""
    for i, x in enumerate(values):
        if not _finite(x) or x > LOGPROB_SLACK:
            return f"log-prob {x!r} is not a finite number <= 0 (at index {i})"
    return None


def _finite(x: object) -> bool:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # a JSON integer past float's range
        return False


@dataclass(frozen=True)
class SamplingParams:
    """SGLang sampling_params. max_new_tokens is always sent (SGLang's default is 128)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling_seed: int | None = None

    def __post_init__(self) -> None:
        """Every field checked for type and range (SGLang's SamplingParams.verify rules), each
        error naming the field and the value: a bad request is answered 400 at the boundary
        instead of failing an engine step that other requests share."""

        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"sampling_params.{name}={getattr(self, name)!r}: {rule}")

        def integer(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def number(value: object) -> bool:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return False
            try:
                return math.isfinite(value)
            except OverflowError:  # a JSON integer past float's range (10^400)
                return False

        if not integer(self.max_new_tokens) or self.max_new_tokens < 0:
            raise bad("max_new_tokens", "must be an integer >= 0")
        if not number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0 (below 1e-6: greedy)")
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be a number in (0, 1]")
        if not integer(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise bad("top_k", "must be -1 (off) or an integer >= 1")
        if not all(integer(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of token ids")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be true or false")
        if self.sampling_seed is not None and (not integer(self.sampling_seed) or not 0 <= self.sampling_seed < 2**63):
            raise bad("sampling_seed", "must be an integer in [0, 2^63)")
        # as floats: a JSON integer (10^300) in a tensor of temperatures overflowed int64 in the batched step
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.ignore_eos:
            out["ignore_eos"] = True
        if self.sampling_seed is not None:
            out["sampling_seed"] = self.sampling_seed
        return out

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> SamplingParams:
        known = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "sampling_seed"}
        unknown = sorted(set(body) - known)
        if unknown:
            raise ValueError(f"sampling_params: unsupported field(s) {unknown}")
        args = dict(body)
        args.setdefault("max_new_tokens", 128)
        if "stop_token_ids" in args:
            stop = args["stop_token_ids"] or ()
            if not isinstance(stop, (list, tuple)):
                raise ValueError(f"sampling_params.stop_token_ids={stop!r}: must be a list of token ids")
            args["stop_token_ids"] = tuple(stop)
        return cls(**args)


def generate_request(
    input_ids: list[int], sampling: SamplingParams, rid: str, routed_experts_start_len: int | None = None
) -> dict[str, Any]:
    """POST /generate body: token ids in, per-token logprobs of the output back. With
    routed_experts_start_len (in [0, len(input_ids)]): also the experts a mixture-of-experts model
    routed positions [routed_experts_start_len, prompt + output - 1) to (`routed_experts`)."""
    body = {
        "input_ids": list(input_ids),
        "sampling_params": sampling.to_json(),
        "return_logprob": True,
        "logprob_start_len": -1,
        "rid": rid,
        "stream": False,
    }
    if routed_experts_start_len is not None:
        body["return_routed_experts"] = True
        body["routed_experts_start_len"] = routed_experts_start_len
    return body


@dataclass
class Completion:
    """One parsed /generate response."""

    rid: str
    output_ids: list[int]
    logprobs: list[float]
    finish: str  # stop | length | abort
    weight_version: str | None = None
    # [(version, start, end)] over output tokens, when the engine reports versions per span
    version_spans: list[tuple[str, int, int]] = field(default_factory=list)
    prompt_tokens: int = 0
    error: str | None = None
    """An abort the engine reports as a failure (finish_reason with a status_code of 500 or more, as
    SGLang and the embedded engine report an internal error): its message. None: no failure."""
    routed_experts: str | None = None
    """meta_info's routed experts as the engine sent them (base64; decode with `routed_experts`),
    when the request asked for them."""
    routes: bytes | None = None
    """The same routes once the client checked them against the served model (engines/client.py):
    the MoE layers' rows of every position run, in the compact bytes a sample keeps
    (common/routes.py: RouteShape.to_bytes). None: not asked for, or not checked."""

    def token_versions(self) -> list[str | None]:
        """The weight version each output token was sampled under."""
        if not self.version_spans:
            return [self.weight_version] * len(self.output_ids)
        out: list[str | None] = [None] * len(self.output_ids)
        for version, start, end in self.version_spans:
            out[start:end] = [version] * (min(end, len(out)) - start)
        return out


def extend_spans(spans: list[list], version: str, tokens: int) -> None:
    """An engine's record of which weight version sampled which output tokens ([version, start, end]),
    after its `tokens`-th token was sampled under `version`: the last span grows, or one begins."""
    if spans and spans[-1][0] == version and spans[-1][2] == tokens - 1:
        spans[-1][2] = tokens
    else:
        spans.append([version, tokens - 1, tokens])


def _need(container: dict, key: str, kinds, where: str):
    if not isinstance(container, dict) or key not in container:
        raise MalformedResponse(f"{where}: no '{key}'")
    value = container[key]
    if not isinstance(value, kinds):
        raise MalformedResponse(f"{where}.{key}: expected {kinds}, got {type(value).__name__}")
    return value


def parse_generate_response(body: Any, rid: str, source: str = "") -> Completion:
    """A /generate response (non-streaming, one request) as a Completion; MalformedResponse, its message
    beginning with `source` (the engine's URL), if it is not one: a field missing or of another type,
    output ids that are no token ids, log-probs that are none (non-finite, above 0), one per token."""
    where = f"{source}/generate response for {rid}"
    if isinstance(body, list) and len(body) == 1:
        body = body[0]
    output_ids = _need(body, "output_ids", list, where)
    problem = token_problem(output_ids)
    if problem:
        raise MalformedResponse(f"{where}: output_ids: {problem}")
    meta = _need(body, "meta_info", dict, where)
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind not in FINISH_TYPES:
        raise MalformedResponse(f"{where}.meta_info.finish_reason: expected a type in {FINISH_TYPES}, got {finish!r}")
    triples = _need(meta, "output_token_logprobs", list, where + ".meta_info")
    if len(triples) != len(output_ids):
        raise MalformedResponse(f"{where}: {len(output_ids)} output ids but {len(triples)} output_token_logprobs")
    logprobs = []
    for i, (triple, token) in enumerate(zip(triples, output_ids, strict=True)):
        if not isinstance(triple, list | tuple) or len(triple) < 2 or triple[1] != token:
            raise MalformedResponse(f"{where}: output_token_logprobs[{i}] = {triple!r} does not match token {token}")
        if not isinstance(triple[0], int | float):
            raise MalformedResponse(f"{where}: output_token_logprobs[{i}] has no logprob ({triple[0]!r})")
        logprobs.append(triple[0])
    problem = logprob_problem(logprobs)
    if problem:
        raise MalformedResponse(f"{where}: output_token_logprobs: {problem}")
    spans = []
    for span in meta.get("weight_versions") or []:
        try:
            spans.append((str(span["version"]), int(span["start"]), int(span["end"])))
        except (KeyError, TypeError, ValueError):
            raise MalformedResponse(f"{where}.meta_info.weight_versions: bad span {span!r}") from None
    version = meta.get("weight_version")
    prompt_tokens = meta.get("prompt_tokens", 0)
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int):
        raise MalformedResponse(f"{where}.meta_info.prompt_tokens: expected an integer, got {prompt_tokens!r}")
    status = finish.get("status_code")
    error = None
    if kind == "abort" and isinstance(status, int) and status >= 500:
        error = f"{finish.get('err_type') or 'error'} (HTTP {status}): {finish.get('message', '')}"
    return Completion(
        rid=str(meta.get("id", rid)),
        output_ids=list(output_ids),
        logprobs=[float(x) for x in logprobs],
        finish=kind,
        weight_version=None if version is None else str(version),
        version_spans=spans,
        prompt_tokens=prompt_tokens,
        error=error,
        routed_experts=meta.get("routed_experts"),
    )


def generate_response(
    rid: str,
    output_ids: list[int],
    logprobs: list[float],
    finish: dict[str, Any],
    prompt_tokens: int,
    weight_version: str,
    spans: list[tuple[str, int, int]],
    routed_experts: str | None = None,
) -> dict[str, Any]:
    """The body the embedded engine answers /generate with (SGLang's shape, text left empty);
    routed_experts: `encode_routed_experts`'s text, when the request asked for routes."""
    meta = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": prompt_tokens,
        "weight_version": weight_version,
        "num_retractions": 0,
        "completion_tokens": len(output_ids),
        "cached_tokens": 0,
        "reasoning_tokens": 0,
        "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(logprobs, output_ids, strict=True)],
        "weight_versions": [{"version": v, "start": s, "end": e} for v, s, e in spans],
    }
    if routed_experts is not None:
        meta["routed_experts"] = routed_experts
    return {"text": "", "output_ids": list(output_ids), "meta_info": meta}


# Routed experts (SGLang's return_routed_experts): meta_info["routed_experts"] is base64 of a
# little-endian int32 array [positions, num_hidden_layers, top_k], positions
# [routed_experts_start_len, prompt + output - 1): every position the model ran (the last output
# token is sampled, never run). A dense layer's rows hold DENSE_LAYER_EXPERT: SGLang's capture
# buffers start zeroed and only the routers of MoE layers write them, so they are no route.
DENSE_LAYER_EXPERT = 0


def encode_routed_experts(routes: torch.Tensor) -> str:
    """[positions, num_hidden_layers, top_k] expert ids as meta_info["routed_experts"]."""
    return base64.b64encode(routes.to(torch.int32).numpy().astype("<i4").tobytes()).decode("ascii")


def routed_experts(meta_info: dict[str, Any] | str | None, num_layers: int, top_k: int) -> torch.Tensor:
    """meta_info["routed_experts"] (or that text itself: Completion.routed_experts) as int32
    [positions, num_layers, top_k]; MalformedResponse when it is missing or its size is no whole
    number of positions."""
    text = meta_info.get("routed_experts") if isinstance(meta_info, dict) else meta_info
    if not isinstance(text, str):
        raise MalformedResponse("meta_info.routed_experts: missing (did the request set return_routed_experts?)")
    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error as err:
        raise MalformedResponse(f"meta_info.routed_experts: not base64 ({err})") from None
    row = 4 * num_layers * top_k
    if len(raw) % row:
        raise MalformedResponse(
            f"meta_info.routed_experts: {len(raw)} bytes are no whole number of positions of "
            f"{num_layers} layers x top-{top_k} int32 ({row} bytes each)"
        )
    ids = np.frombuffer(raw, dtype="<i4").astype(np.int32)
    return torch.from_numpy(ids).view(-1, num_layers, top_k)


def route_dtype(num_experts: int) -> torch.dtype:
    """The compact routes' dtype: uint8 while expert ids fit (0..255), else int16."""
    return torch.uint8 if num_experts <= 256 else torch.int16


def compact_routes(routes: torch.Tensor, sparse_layers: Sequence[int], num_experts: int) -> torch.Tensor:
    """Routes to keep: [positions, len(sparse_layers), top_k] in route_dtype(num_experts), the MoE
    layers' rows only (a dense layer's carry nothing); ValueError when an id is no expert (it would
    wrap around in the dtype). common/routes.py checks the rest of what a router's choices are."""
    kept = routes[:, list(sparse_layers)]
    if kept.numel() and not (int(kept.min()) >= 0 and int(kept.max()) < num_experts):
        raise ValueError(f"routes hold expert ids in [{int(kept.min())}, {int(kept.max())}], not [0, {num_experts})")
    return kept.to(route_dtype(num_experts))


def expand_routes(compact: torch.Tensor, num_layers: int, sparse_layers: Sequence[int]) -> torch.Tensor:
    """compact_routes' inverse: int32 [positions, num_layers, top_k], dense layers DENSE_LAYER_EXPERT."""
    full = torch.full((compact.shape[0], num_layers, compact.shape[2]), DENSE_LAYER_EXPERT, dtype=torch.int32)
    full[:, list(sparse_layers)] = compact.to(torch.int32)
    return full


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16": the form update_weights_from_distributed takes (getattr(torch, name))."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def init_group_request(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP,
    backend: str = "nccl",
) -> dict[str, Any]:
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group_name,
        "backend": backend,
    }


FLATTENED = "flattened_bucket"


def update_distributed_request(
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    version: str,
    group_name: str = DEFAULT_GROUP,
    flush_cache: bool = True,
    flattened: bool = False,
) -> dict[str, Any]:
    """flattened: the tensors travel as one uint8 broadcast, their bytes concatenated in order
    (SGLang's load_format "flattened_bucket"); else one broadcast per tensor."""
    body = {
        "names": names,
        "dtypes": dtypes,
        "shapes": shapes,
        "group_name": group_name,
        "flush_cache": flush_cache,
        "weight_version": version,
    }
    if flattened:
        body["load_format"] = FLATTENED
    return body


def flattened_layout(dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[tuple[int, int]]:
    """(start, end) byte offsets of each tensor in a flattened bucket; each start must be aligned
    to its dtype, as SGLang's receiver requires."""
    out, offset = [], 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        size = dtype.itemsize
        if offset % size:
            raise ValueError(f"flattened bucket: a {dtype} tensor would start at unaligned byte {offset}")
        nbytes = size * math.prod(shape)
        out.append((offset, offset + nbytes))
        offset += nbytes
    return out


def update_tensor_request(
    serialized: list[str], version: str, flattened: bool = True, flush_cache: bool = True
) -> dict[str, Any]:
    """POST /update_weights_from_tensor body: one base64 payload per engine TP rank (common/ipc.py)."""
    body = {"serialized_named_tensors": list(serialized), "flush_cache": flush_cache, "weight_version": version}
    if flattened:
        body["load_format"] = FLATTENED
    return body


def pause_request(mode: str) -> dict[str, Any]:
    """POST /pause_generation: abort (requests end, returning what they have), retract (they wait,
    their KV cache dropped and recomputed on continue) or in_place (they wait with their cache)."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
    return {"mode": mode}


def continue_request() -> dict[str, Any]:
    """POST /continue_generation (SGLang's default empties torch's allocator cache first)."""
    return {}


def memory_tags(tags: Sequence[str]) -> list[str]:
    """`tags` as a list, checked to be a non-empty subset of MEMORY_TAGS."""
    if not tags or not set(tags) <= set(MEMORY_TAGS):
        raise ValueError(f"memory tags must be a non-empty subset of {MEMORY_TAGS}, got {list(tags)}")
    return list(tags)


def memory_request(tags: Sequence[str] | None = None) -> dict[str, Any]:
    """/release_memory_occupation and /resume_memory_occupation: `tags` among MEMORY_TAGS (None: all)."""
    return {} if tags is None else {"tags": memory_tags(tags)}


def update_disk_request(model_path: str, version: str, flush_cache: bool = True) -> dict[str, Any]:
    return {"model_path": model_path, "weight_version": version, "flush_cache": flush_cache}

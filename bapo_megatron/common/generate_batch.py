"""SGLang's batch form of /generate: several requests in one body, answered with a list in the same order.

    body = batch_request([generate_request(...) | {"lora_path": name}, ...])   # the client
    rows = split_batch(body)                          # the embedded engine: one single-form body a row
    answers = batch_answers(result, rids, source)     # the client: one answer body a row, in order

What SGLang 0.5.23 (managers/io_struct.py, GenerateReqInput.normalize_batch_and_arguments) takes:
input_ids a list of lists; sampling_params, rid, lora_path, return_logprob and logprob_start_len one
per row or once for all (a rid given once is spread as rid_0, rid_1, ...); every other field once for
the whole batch (return_routed_experts and routed_experts_start_len among them). Each row is then a
request of its own: aborted by its rid, answered with its own meta_info (versions, routes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from bapo_megatron.common.protocol import MalformedResponse

PER_ROW = ("input_ids", "sampling_params", "rid", "lora_path", "return_logprob", "logprob_start_len")
"""The fields a batch may give one per row (a list) as SGLang does; the rest are the batch's."""


def batch_request(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One /generate body for `rows` (single-form bodies: protocol.generate_request's, with a lora_path
    or not), which must agree on every field SGLang takes once for a batch: ValueError naming it
    otherwise. lora_path goes one per row when any row names an adapter (None: the base model)."""
    if not rows:
        raise ValueError("a /generate batch of no requests")
    shared = {k: v for k, v in rows[0].items() if k not in PER_ROW}
    for row in rows[1:]:
        theirs = {k: v for k, v in row.items() if k not in PER_ROW}
        if theirs != shared:
            differ = sorted(k for k in shared.keys() | theirs.keys() if shared.get(k) != theirs.get(k))
            raise ValueError(f"/generate batch: rows differ in {differ}, which SGLang takes once for a batch")
    body = {**shared, **{k: [row.get(k) for row in rows] for k in PER_ROW}}
    if all(path is None for path in body["lora_path"]):
        del body["lora_path"]
    for k in PER_ROW:  # one value for all: as SGLang spreads it (and smaller)
        if k not in ("input_ids", "rid", "lora_path") and k in body and _all_equal(body[k]):
            body[k] = body[k][0]
    return body


def _all_equal(values: list) -> bool:
    return all(v == values[0] for v in values[1:])


def is_batch(body: dict[str, Any]) -> bool:
    """Whether a /generate body is the batch form (input_ids a list of lists), as SGLang decides it."""
    ids = body.get("input_ids")
    return isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)


def split_batch(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A batch body as the single-form bodies of its rows, spread as SGLang spreads it; ValueError naming
    the field for a per-row list of another length, and for a rid repeated within the batch."""
    n = len(body["input_ids"])
    spread = {k: _per_row(k, body.get(k), n) for k in PER_ROW if k != "input_ids"}
    rid = body.get("rid")
    if isinstance(rid, str):
        spread["rid"] = [f"{rid}_{i}" for i in range(n)]
    elif rid is not None and not isinstance(rid, list):
        raise ValueError(f"rid={rid!r:.100}: must be a string or a list of strings (one a row)")
    repeated = sorted(r for r, count in Counter(x for x in spread["rid"] if x is not None).items() if count > 1)
    if repeated:
        raise ValueError(f"rid: {repeated[:5]} repeated within one /generate batch")
    rows = []
    for i, ids in enumerate(body["input_ids"]):
        row = {k: v for k, v in body.items() if k not in PER_ROW}
        row["input_ids"] = ids
        row.update({k: values[i] for k, values in spread.items() if values[i] is not None})
        rows.append(row)
    return rows


def _per_row(name: str, value: Any, n: int) -> list:
    """A field's value for each of n rows: a list must hold one a row; anything else holds for all."""
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name}: {len(value)} values for a batch of {n} requests (one a row, or one for all)")
        return list(value)
    return [value] * n


def batch_answers(result: Any, rids: Sequence[str], source: str = "") -> list[Any]:
    """The answer body of each row of a batch request (rids in order); MalformedResponse, beginning with
    `source` (the engine's URL), unless the answer is a list of one per row."""
    if not isinstance(result, list) or len(result) != len(rids):
        got = f"a list of {len(result)}" if isinstance(result, list) else type(result).__name__
        raise MalformedResponse(f"{source}/generate response to a batch of {len(rids)}: {got}, not one answer a row")
    return list(result)

"""Rule-based rewards, computed beside generation; a verifier that throws scores 0 and is counted.

A reward function takes (response text, response token ids, the prompt's data record) and
returns a float. "math" checks the response's final (boxed) answer against meta["answer"]
with math-verify; "exact" ("exact_text") compares the text, "exact_ids" the tokens. Any other
name is a user function: "pkg.module:fn" (imported) or "path/to/file.py:fn" (loaded from the
file), resolved once per process (`load_reward`).
Scoring runs in worker processes (reward_workers.py), each call bounded in time and memory;
math-verify also bounds its own stages with SIGALRM, which works only in a main thread, as each
worker's call is.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

RewardFn = Callable[[str, list[int], dict[str, Any]], float]


def last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} in text (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def math_reward(text: str, ids: list[int], meta: dict[str, Any]) -> float:
    """1.0 when the response's final answer equals meta["answer"] mathematically (math-verify)."""
    from math_verify import parse, verify

    answer = str(meta["answer"])
    gold = parse(answer if "\\boxed" in answer or "$" in answer else f"${answer}$")
    boxed = last_boxed(text)
    predicted = parse(f"$\\boxed{{{boxed}}}$" if boxed is not None else text)
    return float(bool(gold) and bool(predicted) and verify(gold, predicted))


def exact_text(text: str, ids: list[int], meta: dict[str, Any]) -> float:
    return float(text.strip() == str(meta["answer"]).strip())


def exact_ids(text: str, ids: list[int], meta: dict[str, Any]) -> float:
    """1.0 when the response's tokens (stop token removed) equal meta["answer_ids"]."""
    stop = set(meta.get("stop_ids", ()))
    trimmed = ids[:-1] if ids and ids[-1] in stop else ids
    return float(list(trimmed) == list(meta["answer_ids"]))


REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "exact": exact_text,
    "exact_text": exact_text,
    "exact_ids": exact_ids,
}


@functools.cache
def load_reward(name: str) -> RewardFn:
    """The reward function `name` stands for: a built-in, "pkg.module:fn" or "file.py:fn".
    ValueError naming what is wrong (unknown name, a module or file that does not import, no
    such function, not callable)."""
    if name in REWARDS:
        return REWARDS[name]
    where, sep, attr = name.rpartition(":")
    if not sep or not where or not attr.isidentifier():
        raise ValueError(f"unknown reward {name!r}: use one of {sorted(REWARDS)}, 'pkg.module:fn' or 'file.py:fn'")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise ValueError(f"reward {name!r}: no such file {where}")
            spec = importlib.util.spec_from_file_location(f"bapo_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ValueError:
        raise
    except Exception as err:  # the user's file: any error on import is theirs to see, in one line
        raise ValueError(f"reward {name!r} does not import: {type(err).__name__}: {err}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {name!r}: {where} has no function {attr!r}")
    return fn


def score(
    name: str, text: str, ids: list[int], meta: dict[str, Any], bounds: tuple[float, float] = (-1e6, 1e6)
) -> tuple[float, str | None]:
    """(reward, None), or (0.0, why) when the verifier throws (sys.exit included), or returns a
    non-number, NaN, an infinity or a value outside `bounds` (data.reward_range)."""
    try:
        value = float(load_reward(name)(text, ids, meta))
    except (Exception, SystemExit) as err:  # a verifier's failure is the sample's, never the run's
        return 0.0, f"{type(err).__name__}: {err}"
    if not math.isfinite(value) or not bounds[0] <= value <= bounds[1]:
        return 0.0, f"the verifier returned {value!r}, outside data.reward_range {list(bounds)}"
    return value, None

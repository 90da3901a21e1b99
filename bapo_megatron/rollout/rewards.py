"""Rule-based rewards, computed beside generation; a verifier that throws scores 0 and is counted.

A reward function takes (response text, response token ids, the prompt's metadata) and
returns a float. "math" checks the response's final (boxed) answer against meta["answer"]
with math-verify; "exact_text" and "exact_ids" are the synthetic checkers the demo tasks use.
math-verify bounds its own run time with SIGALRM, which works only in a main thread, so
scoring runs in worker processes (RewardWorkers), where each call is a main thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
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


REWARDS: dict[str, RewardFn] = {"math": math_reward, "exact_text": exact_text, "exact_ids": exact_ids}


def score(name: str, text: str, ids: list[int], meta: dict[str, Any]) -> tuple[float, str | None]:
    """(reward, None), or (0.0, the error) when the verifier throws or returns a non-number."""
    try:
        value = float(REWARDS[name](text, ids, meta))
    except Exception as err:  # a verifier's failure is the sample's, never the run's
        return 0.0, f"{type(err).__name__}: {err}"
    if value != value:  # NaN
        return 0.0, "the verifier returned NaN"
    return value, None


class RewardWorkers:
    """Scores samples concurrently with generation, in worker processes (or inline, for tests)."""

    def __init__(self, name: str, workers: int = 1, inline: bool = False) -> None:
        if name not in REWARDS:
            raise ValueError(f"unknown reward {name!r}; known: {sorted(REWARDS)}")
        self.name = name
        self.failures = 0
        self._pool = None if inline else concurrent.futures.ProcessPoolExecutor(max_workers=workers)

    async def __call__(self, text: str, ids: list[int], meta: dict[str, Any]) -> float:
        if self._pool is None:
            value, error = score(self.name, text, ids, meta)
        else:
            value, error = await asyncio.get_running_loop().run_in_executor(
                self._pool, score, self.name, text, ids, meta
            )
        if error is not None:
            self.failures += 1
        return value

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

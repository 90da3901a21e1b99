"""Rule-based rewards, computed beside generation; a verifier that throws scores 0 and is counted.

A reward function takes (response text, response token ids, the prompt's data record) and
returns a float. "math" checks the response's final (boxed) answer against meta["answer"]
with math-verify; "dapo" is DAPO's convention (the last "Answer:" line of the response's last
300 characters, normalised as Minerva's answers are, +1 when it equals the normalised reference,
else -1); "gsm8k" is GSM8K's "#### answer" convention as verl scores it (1 for the right number
after the last "####", else 0; "gsm8k_flexible": the last number anywhere); "exact"
("exact_text") compares the text, "exact_ids" the tokens. Any other name is a
user function: "pkg.module:fn" (imported) or "path/to/file.py:fn" (loaded from the file),
resolved once per process (`load_reward`) and called the way its parameters say
(`called_as_declared`): fn(text, ids, record), or, with verl's parameter names (data_source,
solution_str, ground_truth, extra_info), as verl calls its compute_score (VerlReward); one whose
parameters take neither call is refused there, before the first step.

A run's reward may be composite (`reward_spec`): routed by a record field (reward.by and
reward.table, verl's data_source), and/or shaped by DAPO's overlong penalty (reward.overlong_buffer):
its spec is a JSON text that travels to the workers as a name does.
Scoring runs in worker processes (workers.py), each call bounded in time and memory;
math-verify also bounds its own stages with SIGALRM, which works only in a main thread, as each
worker's call is.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import json
import math
import re
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


# DAPO's answer normalisation (Minerva's, from Lewkowycz et al. 2022): what is replaced, then the
# units and TeX decorations that are dropped, before the regular-expression rewrites.
_DAPO_REPLACE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                 (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))  # fmt: skip
_DAPO_UNITS = (
    "square ways integers dollars mph inches hours km units \\ldots sue points feet minutes digits cents "
    "degrees cm gm pounds meters meals edges students childrentickets multiples"
)
_DAPO_DROP = [*_DAPO_UNITS.split(), "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
              "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"',
              "\\dots"]  # fmt: skip
_DAPO_REWRITE = [
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),  # the first $...$ span alone
    *((re.compile(rf"(\\{cmd}\{{)(.*?)(\}})"), "\\2") for cmd in ("text", "textbf", "overline")),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),  # \fracab -> \frac{a}{b}
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),  # \sqrta -> \sqrt{a}
]
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def dapo_normalise(answer: str) -> str:
    """A final answer as DAPO compares it: the part after the last "=", units and TeX decoration
    dropped, shorthand fractions and roots braced, "$" removed, thousands separators dropped."""
    answer = answer.split("=")[-1]
    for before, after in _DAPO_REPLACE:
        answer = answer.replace(before, after)
    for dropped in _DAPO_DROP:
        answer = answer.replace(dropped, "")
    for pattern, replacement in _DAPO_REWRITE:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def dapo_math(text: str, ids: list[int], meta: dict[str, Any]) -> float:
    """+1 when the last "Answer: ..." line of the response's last 300 characters equals
    meta["answer"] after dapo_normalise, else -1 (no such line: -1)."""
    found = _DAPO_ANSWER.findall(text[-300:])
    predicted = dapo_normalise(found[-1]) if found else None
    return 1.0 if predicted is not None and predicted == dapo_normalise(str(meta["answer"])) else -1.0


_GSM8K_CLIP = 300  # verl reads only the response's last 300 characters, as DAPO does
_GSM8K_MARKED = re.compile(r"#### (-?[0-9.,]+)")
_GSM8K_NUMBER = re.compile(r"-?[0-9.,]+")


def gsm8k_answer(text: str, flexible: bool = False) -> str | None:
    """The final answer of a response's last 300 characters as verl's gsm8k reads it: strict, the
    number after the last "#### " with its commas dropped; flexible, the last run of digits, dots
    and commas that is not "." as it is (when every run is ".", the first one, as verl's loop leaves
    it). None when there is none."""
    text = text[-_GSM8K_CLIP:]
    if not flexible:
        marked = _GSM8K_MARKED.findall(text)
        return marked[-1].replace(",", "") if marked else None
    numbers = _GSM8K_NUMBER.findall(text)
    usable = [n for n in numbers if n != "."]
    return usable[-1] if usable else (numbers[0] if numbers else None)


def gsm8k_score(text: str, truth: str, flexible: bool = False, format_score: float = 0.0, score: float = 1.0) -> float:
    """verl's gsm8k rule: `score` when the answer (gsm8k_answer) equals the ground truth as text,
    `format_score` when there is an answer that does not, 0 when there is none."""
    answer = gsm8k_answer(text, flexible)
    if answer is None:
        return 0.0
    return score if answer == truth else format_score


def gsm8k(text: str, ids: list[int], meta: dict[str, Any]) -> float:
    """1.0 when the number after the response's last "#### " equals meta["answer"] (verl's
    ground_truth, a bare number: "72"), else 0.0: verl's default for data_source openai/gsm8k."""
    return gsm8k_score(text, str(meta["answer"]))


def gsm8k_flexible(text: str, ids: list[int], meta: dict[str, Any]) -> float:
    """1.0 when the response's last number equals meta["answer"], else 0.0 (verl's method="flexible")."""
    return gsm8k_score(text, str(meta["answer"]), flexible=True)


REWARDS: dict[str, RewardFn] = {
    "dapo": dapo_math,
    "gsm8k": gsm8k,
    "gsm8k_flexible": gsm8k_flexible,
    "math": math_reward,
    "exact": exact_text,
    "exact_text": exact_text,
    "exact_ids": exact_ids,
}


def reward_spec(
    reward: str,
    by: str | None = None,
    table: dict[str, str] | None = None,
    overlong_buffer: int | None = None,
    overlong_factor: float = 1.0,
    max_new_tokens: int | None = None,
) -> str:
    """The name a run's reward goes by: `reward` itself, or a composite's JSON spec when it is
    routed by record field `by` (value -> reward name in `table`) or shaped by DAPO's overlong
    penalty (responses longer than max_new_tokens - overlong_buffer lose up to overlong_factor)."""
    if by is None and overlong_buffer is None:
        return reward
    spec: dict[str, Any] = {"reward": reward}
    if by is not None:
        spec |= {"by": by, "table": dict(table or {})}
    if overlong_buffer is not None:
        spec |= {"overlong": [overlong_buffer, overlong_factor, max_new_tokens]}
    return json.dumps(spec, sort_keys=True)


class Composite:
    """A routed and/or overlong-shaped reward (see reward_spec)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.by = spec.get("by")
        self.table = {value: load_reward(name) for value, name in spec.get("table", {}).items()}
        self.base = None if self.by else load_reward(spec["reward"])
        self.overlong = spec.get("overlong")

    def route(self, meta: dict[str, Any]) -> RewardFn:
        from bapo_megatron.common.fields import get_field

        value = get_field(meta, self.by)
        if str(value) not in self.table:
            raise ValueError(f"{self.by}={value!r} has no reward in reward.table ({', '.join(sorted(self.table))})")
        return self.table[str(value)]

    def __call__(self, text: str, ids: list[int], meta: dict[str, Any]) -> float:
        value = float((self.base or self.route(meta))(text, ids, meta))
        if self.overlong is not None:  # DAPO: a linear penalty over the last `buffer` tokens of the budget
            buffer, factor, max_new = self.overlong
            value += min(-(len(ids) - (max_new - buffer)) / buffer * factor, 0.0)
        return value


@functools.cache
def load_reward(name: str) -> RewardFn:
    """The reward function `name` stands for: a built-in, "pkg.module:fn", "file.py:fn", or a
    composite's JSON spec (reward_spec). ValueError naming what is wrong (unknown name, a module
    or file that does not import, no such function, not callable)."""
    if name in REWARDS:
        return REWARDS[name]
    if name.startswith("{"):
        return Composite(json.loads(name))
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
    return called_as_declared(fn, name)


VERL_CALL = ("data_source", "solution_str", "ground_truth", "extra_info")
"""The keywords verl's reward manager calls compute_score with (verl 0.9.1, experimental/
reward_loop/reward_manager/naive.py; the legacy workers/reward_manager/naive.py too)."""
VERL_TURNS = 2
"""extra_info["num_turns"] of a single-turn sample in verl 0.9.1 (its single-turn agent loop's:
the prompt and the response)."""


class VerlReward:
    """A reward in verl's form, called as verl's reward manager calls compute_score: data_source
    the record's data_source, solution_str the response text, ground_truth data.answer_field's
    value (record["answer"]; verl's reward_model.ground_truth), extra_info a copy of the record's
    extra_info ({} without one) with num_turns and rollout_reward_scores added as verl adds them.
    It returns a number, or a dict whose "score" is the reward (verl's other keys are dropped);
    an `async def` one is run to its end."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, text: str, ids: list[int], meta: dict[str, Any]) -> Any:
        result = self.fn(**verl_arguments(text, meta))
        if inspect.isawaitable(result):
            result = asyncio.run(_awaited(result))
        if isinstance(result, dict):
            if "score" not in result:  # not a KeyError: the pre-run check reads that as a missing record field
                raise ValueError(f"returned a dict without 'score' (verl's key for the reward): keys {sorted(result)}")
            return result["score"]
        return result


async def _awaited(result: Any) -> Any:
    return await result


def verl_arguments(text: str, meta: dict[str, Any]) -> dict[str, Any]:
    """What verl passes compute_score for a sample of record `meta` (as the reward gets it, with
    data.answer_field's value as "answer") whose response is `text`: KeyError for a record without
    data_source or the answer, as verl's reward manager raises for one."""
    extra = dict(meta.get("extra_info") or {})
    extra.update(num_turns=VERL_TURNS, rollout_reward_scores={})
    return {
        "data_source": meta["data_source"],
        "solution_str": text,
        "ground_truth": meta["answer"],
        "extra_info": extra,
    }


def called_as_declared(fn: Callable[..., Any], name: str) -> RewardFn:
    """`fn` as a RewardFn: a VerlReward when its first parameter is one of verl's names
    (compute_score(data_source, ...)) or it takes verl's keyword call and not ours (**kwargs); as it
    is when it takes fn(text, ids, record) (a later parameter named like verl's changes nothing);
    ValueError naming the function and its signature when it takes neither, or is named for verl's
    call and does not take it."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a C function): called as ours
        return fn
    ours = _unbound(signature, "", [], {})
    theirs = _unbound(signature, **dict.fromkeys(VERL_CALL))
    verl_first = next(iter(signature.parameters), None) in VERL_CALL  # compute_score(data_source, ...)
    if theirs is None and (verl_first or ours is not None):
        return VerlReward(fn)
    if ours is None and not verl_first:
        return fn
    verl = f"compute_score({'=..., '.join(VERL_CALL)}=...)"
    if set(signature.parameters) & set(VERL_CALL[:3]):
        raise ValueError(
            f"reward {name!r}: its signature {signature} has verl's parameter names, and verl calls it as "
            f"{verl}; it does not take that call ({theirs})"
        )
    raise ValueError(
        f"reward {name!r} is called as fn(text, ids, record), or, when its parameters bear verl's names, as "
        f"verl calls {verl}; its signature {signature} takes neither ({ours})"
    )


def _unbound(signature: inspect.Signature, *args: Any, **kwargs: Any) -> str | None:
    """Why `signature` does not take the call (args, kwargs); None when it does."""
    try:
        signature.bind(*args, **kwargs)
    except TypeError as err:
        return str(err)
    return None


def score(
    name: str, text: str, ids: list[int], meta: dict[str, Any], bounds: tuple[float, float] = (-1e6, 1e6)
) -> tuple[float, str | None]:
    """(reward, None), or (0.0, why) when the verifier throws (sys.exit included), or returns a
    non-number, NaN, an infinity or a value outside `bounds` (reward.range)."""
    try:
        value = float(load_reward(name)(text, ids, meta))
    except (Exception, SystemExit) as err:  # a verifier's failure is the sample's, never the run's
        return 0.0, f"{type(err).__name__}: {err}"
    if not math.isfinite(value) or not bounds[0] <= value <= bounds[1]:
        return 0.0, f"the verifier returned {value!r}, outside reward.range {list(bounds)}"
    return value, None

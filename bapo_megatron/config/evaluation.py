"""eval: held-out evaluation through the engines, on one file or named sets."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from bapo_megatron.errors import check


@dataclass(frozen=True, kw_only=True)
class EvalSetConfig:
    """One named evaluation set of eval.sets, logged as eval/NAME/greedy_acc, avg@k, pass@k."""

    path: str | None = None
    """Its prompts (a file, a directory of shards or a glob, read with data's field map); a
    preset may leave it for the user to set (a run refuses a set without one)."""
    samples: int | None = None
    """k (None: eval.samples)."""
    max_prompts: int | None = None
    """Its first this many records (None: eval.max_prompts)."""
    greedy: bool | None = None
    """None: eval.greedy."""

    def __post_init__(self) -> None:
        if self.samples is not None:
            check(self.samples >= 0, "samples", self.samples, "must be >= 0")
        if self.max_prompts is not None:
            check(self.max_prompts >= 1, "max_prompts", self.max_prompts, "must be >= 1")


EVAL_SET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Held-out evaluation through the engines (no gradient): greedy accuracy, avg@k and pass@k,
    logged as eval/*; scored as training is (the reward section) and read with data's field
    map."""

    path: str | None = None
    """Held-out prompts (jsonl or parquet, as data.format); None: no evaluation."""
    interval: int = 0
    """Evaluate before the first step, every this many steps and after the last (0: only before
    the first and after the last, when path is set)."""
    samples: int = 4
    """k of avg@k (mean correctness of k samples at rollout.sampling.temperature) and pass@k (any of k correct)."""
    greedy: bool = True
    """Also one greedy answer a prompt: eval/greedy_acc."""
    max_prompts: int | None = None
    """Evaluate on the first this many records (None: all)."""
    sets: dict[str, EvalSetConfig] = field(default_factory=dict)
    """Named sets beside (or instead of) path, e.g. {aime24: {path: ..., samples: 16}, math500: {path: ...}};
    each with data's field map and the reward section, logged under eval/NAME/."""

    def __post_init__(self) -> None:
        check(self.interval >= 0, "interval", self.interval, "must be >= 0")
        for name in self.sets:
            check(
                EVAL_SET_NAME.fullmatch(name) is not None and not name.startswith(("greedy_acc", "avg@", "pass@")),
                "sets",
                name,
                "a set's name is letters, digits, _ . - (it names eval/NAME/ metrics)",
            )
        check(self.samples >= 0, "samples", self.samples, "must be >= 0")
        check(self.samples > 0 or self.greedy, "samples", self.samples, "0 samples and greedy off evaluate nothing")
        if self.max_prompts is not None:
            check(self.max_prompts >= 1, "max_prompts", self.max_prompts, "must be >= 1")

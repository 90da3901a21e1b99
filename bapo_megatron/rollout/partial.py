"""Partial rollout: responses cut at a per-step token budget, continued later under newer weights.

The buffer holds every group (the n samples of one prompt) that has not reached training.
Each sample keeps its response tokens with the behaviour log-prob and the policy version
of every token. A sample resumes by resubmitting prompt + partial response as input_ids,
with the remaining new-token allowance (capped by the step's budget). A group is handed to
training only when all its samples are finished. A sample whose oldest token is more than
max_staleness versions behind is dropped and regenerated from scratch (counted). The whole
buffer round-trips through state_dict() exactly (plain lists, JSON-safe), so checkpoints
carry it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from bapo_megatron.common.protocol import Completion


@dataclass
class SampleState:
    uid: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop" or "length" once finished
    reward: float | None = None
    regenerated: int = 0  # times dropped for staleness

    @property
    def finished(self) -> bool:
        return self.finish is not None

    def reset(self) -> None:
        self.response_ids, self.logprobs, self.versions = [], [], []
        self.finish, self.reward = None, None


@dataclass
class GroupState:
    uid: str
    prompt_ids: list[int]
    meta: dict[str, Any]
    samples: list[SampleState]

    @property
    def finished(self) -> bool:
        return all(s.finished and s.reward is not None for s in self.samples)


@dataclass
class Request:
    """One generation request for one sample: what to send and how much to allow."""

    sample: SampleState
    input_ids: list[int]
    max_new_tokens: int


class PartialRolloutBuffer:
    def __init__(
        self, samples_per_prompt: int, max_new_tokens: int, token_budget: int | None = None, max_staleness: int = 4
    ) -> None:
        self.samples_per_prompt, self.max_new_tokens = samples_per_prompt, max_new_tokens
        self.token_budget = token_budget or max_new_tokens
        self.max_staleness = max_staleness
        self.groups: dict[str, GroupState] = {}
        self.counters = {"dropped_stale": 0, "resumed": 0, "groups_added": 0, "groups_done": 0}

    def add_group(self, uid: str, prompt_ids: list[int], meta: dict[str, Any] | None = None) -> GroupState:
        if uid in self.groups:
            raise ValueError(f"prompt {uid!r} is already in the buffer")
        if not prompt_ids:
            raise ValueError(f"prompt {uid!r} has no tokens")
        group = GroupState(
            uid,
            list(prompt_ids),
            dict(meta or {}),
            [SampleState(f"{uid}/{i}", list(prompt_ids)) for i in range(self.samples_per_prompt)],
        )
        self.groups[uid] = group
        self.counters["groups_added"] += 1
        return group

    def group_of(self, sample: SampleState) -> GroupState:
        return self.groups[sample.uid.rpartition("/")[0]]

    def drop_stale(self, version: int, busy: frozenset[str] = frozenset()) -> int:
        """Reset every sample (not being generated: `busy` uids) whose oldest token is more than
        max_staleness versions behind `version`."""
        dropped = 0
        for group in self.groups.values():
            for s in group.samples:
                if s.uid not in busy and s.versions and version - min(s.versions) > self.max_staleness:
                    s.reset()
                    s.regenerated += 1
                    dropped += 1
        self.counters["dropped_stale"] += dropped
        return dropped

    def requests(self, busy: frozenset[str] = frozenset()) -> list[Request]:
        """Requests for every unfinished sample not being generated (`busy` uids), oldest groups first.
        (Call drop_stale once per step, before the step's first requests.)"""
        out = []
        for group in self.groups.values():
            for s in group.samples:
                if s.finished or s.uid in busy:
                    continue
                left = self.max_new_tokens - len(s.response_ids)
                out.append(Request(s, s.prompt_ids + s.response_ids, min(left, self.token_budget)))
        return out

    def record(self, request: Request, completion: Completion, version: int) -> None:
        """Append a completion's tokens to its sample. Tokens carry the versions the engine reports
        (numeric weight versions), else `version`, the one the caller believes was live."""
        s = request.sample
        if s.finished:
            raise RuntimeError(f"{s.uid} is finished already: a duplicate completion")
        if len(completion.output_ids) > request.max_new_tokens:
            raise ValueError(f"{s.uid}: {len(completion.output_ids)} tokens for a request of {request.max_new_tokens}")
        if s.response_ids:
            self.counters["resumed"] += 1
        reported = completion.token_versions()
        versions = [int(v) if v is not None and str(v).lstrip("-").isdigit() else version for v in reported]
        s.response_ids += completion.output_ids
        s.logprobs += completion.logprobs
        s.versions += versions
        if completion.finish == "stop":
            s.finish = "stop"
        elif len(s.response_ids) >= self.max_new_tokens:
            s.finish = "length"
        # "abort", or "length" at the step's budget: unfinished, resumed next step

    def pop_finished(self, limit: int | None = None) -> list[GroupState]:
        """Groups whose samples are all finished and rewarded, oldest first, removed from the buffer."""
        done = [g for g in self.groups.values() if g.finished][:limit]
        for g in done:
            del self.groups[g.uid]
        self.counters["groups_done"] += len(done)
        return done

    @property
    def in_flight(self) -> int:
        return len(self.groups)

    def state_dict(self) -> dict[str, Any]:
        return {
            "config": [self.samples_per_prompt, self.max_new_tokens, self.token_budget, self.max_staleness],
            "groups": [asdict(g) for g in self.groups.values()],
            "counters": dict(self.counters),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        config = [self.samples_per_prompt, self.max_new_tokens, self.token_budget, self.max_staleness]
        if list(state["config"]) != config:
            raise ValueError(
                f"partial-rollout buffer saved with (samples_per_prompt, max_new_tokens, token_budget, "
                f"max_staleness) = {state['config']}, this run has {config}"
            )
        self.groups = {}
        for g in state["groups"]:
            samples = [SampleState(**s) for s in g["samples"]]
            self.groups[g["uid"]] = GroupState(g["uid"], g["prompt_ids"], g["meta"], samples)
        self.counters = dict(state["counters"])

"""Every prompt group between the prompt source and training: tokens, versions, rounds, staleness.

A group holds the n samples of one prompt. Each sample keeps its response tokens with the
behaviour log-prob and the policy version of every token; it continues by resubmitting
prompt + partial response as input_ids, with what is left of its new-token allowance.

The buffer owns four rules that the rollout strategies only ask about:
- the token budget: a request carries at most `token_budget` new tokens of its sample's
  current round; a sample whose round is used up begins another (`begin_requests`), and the
  rounds a step has begun are counted (`begin_step`, `rounds`);
- the staleness bound: no token trained by policy version v may come from a version older
  than v - max_staleness. A sample that would break it is reset and generated again
  (`drop_stale`, counted), or, with mask_stale_prefix, keeps its tokens and leaves the old
  ones out of the loss (`loss_mask`);
- whole groups: a group goes to training only when every sample is finished and rewarded,
  oldest (first admitted) first (`take`);
- equal rewards (rollout.filter_groups, rollout/filtering.py): a complete group whose rewards are
  all equal (every advantage 0) may be set aside (`set_aside_equal`); it is trained only to fill a
  step short of other groups, and the rest are discarded when the step takes its groups.

The groups a step takes become its training batch here (`batch`: each sample's loss mask under the
staleness bound, the routes recorded), and their figures (`batch_figures`).

A sample's state changes only through the buffer's methods: `begin_requests` (its rounds),
`record` (a completion's tokens), `restart` and `drop_stale` (generated again), `apply_reward`
(what the scorer returned). The whole buffer (the groups set aside included) round-trips through
state_dict() exactly (plain lists, JSON-safe), so checkpoints carry it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from bapo_megatron.common.batch import RolloutBatch
from bapo_megatron.common.protocol import Completion
from bapo_megatron.common.routes import RouteShape
from bapo_megatron.config import RolloutConfig


@dataclass
class SampleState:
    uid: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop" or "length" once finished
    reward: float | None = None
    reward_error: str | None = None  # why its reward call failed (it then scores 0)
    regenerated: int = 0  # times reset for staleness
    round_tokens: int = 0  # tokens generated in its current round (the token budget's count)
    step_rounds: int = 0  # rounds begun since the step began
    routes: bytes = b""  # the engines' routed experts of positions 0 .. (RouteShape's compact bytes), when recorded

    @property
    def finished(self) -> bool:
        return self.finish is not None

    def reset(self) -> None:
        self.response_ids, self.logprobs, self.versions, self.routes = [], [], [], b""
        self.finish, self.reward, self.reward_error, self.round_tokens = None, None, None, 0


@dataclass
class GroupState:
    uid: str
    prompt_ids: list[int]
    meta: dict[str, Any]
    samples: list[SampleState]

    @property
    def finished(self) -> bool:
        return all(s.finished and s.reward is not None for s in self.samples)

    @property
    def equal_rewards(self) -> bool:
        """Finished, and every sample's reward the same: every group-relative advantage is 0
        (algo/advantages.py's test, exact equality)."""
        return self.finished and len({s.reward for s in self.samples}) == 1


@dataclass
class Request:
    """One generation request for one sample: what to send and how much to allow."""

    sample: SampleState
    input_ids: list[int]
    max_new_tokens: int
    routes_from: int | None = None
    """The first position whose routed experts to ask for; None: routes are not recorded. Always 0:
    a continued sample's prefix runs again in the engine (under the weights of now, which may route
    it otherwise than the weights that generated it), and its new tokens were computed over that
    run, so the sample's routes become the latest answer's, every position (RolloutBuffer.record)."""


COUNTERS = {"dropped_stale": 0, "resumed": 0, "groups_added": 0, "groups_done": 0, "set_aside": 0}


class RolloutBuffer:
    def __init__(
        self,
        samples_per_prompt: int,
        max_new_tokens: int,
        token_budget: int | None = None,
        max_staleness: int = 4,
        mask_stale_prefix: bool = False,
        routes: RouteShape | None = None,
    ) -> None:
        """routes: record the engines' routed experts of every position (a mixture-of-experts model)."""
        self.samples_per_prompt, self.max_new_tokens = samples_per_prompt, max_new_tokens
        self.routes = routes
        self.token_budget = token_budget or max_new_tokens
        self.max_staleness, self.mask_stale_prefix = max_staleness, mask_stale_prefix
        self.groups: dict[str, GroupState] = {}
        self.set_aside: list[GroupState] = []  # complete, rewards all equal, since the last take (oldest first)
        self.counters = dict(COUNTERS)

    @classmethod
    def from_config(cls, cfg: RolloutConfig, routes: RouteShape | None = None) -> RolloutBuffer:
        return cls(
            cfg.samples_per_prompt,
            cfg.sampling.max_new_tokens,
            cfg.token_budget,
            cfg.max_staleness,
            cfg.mask_stale_prefix,
            routes=routes,
        )

    # -- groups ---------------------------------------------------------------------------
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

    @property
    def in_flight(self) -> int:
        """Groups admitted and not yet taken by training (complete ones included)."""
        return len(self.groups)

    @property
    def complete(self) -> int:
        return sum(g.finished for g in self.groups.values())

    @property
    def generating(self) -> int:
        """Groups not yet complete (some sample unfinished or unscored)."""
        return self.in_flight - self.complete

    @property
    def taken(self) -> int:
        """Groups handed to training so far."""
        return self.counters["groups_done"]

    def take(self, limit: int) -> list[GroupState]:
        """Up to `limit` complete groups, oldest first, removed from the buffer; fewer are topped up
        with the groups set aside (oldest first), and the rest of those are discarded."""
        done = [g for g in self.groups.values() if g.finished][:limit]
        for g in done:
            del self.groups[g.uid]
        done += self.set_aside[: limit - len(done)]
        self.set_aside = []
        self.counters["groups_done"] += len(done)
        return done

    def set_aside_equal(self) -> int:
        """Move every complete group whose rewards are all equal out of the queue, to `set_aside`
        (rollout.filter_groups); how many."""
        equal = [g for g in self.groups.values() if g.equal_rewards]
        for g in equal:
            del self.groups[g.uid]
        self.set_aside += equal
        self.counters["set_aside"] += len(equal)
        return len(equal)

    def samples(self):
        return (s for g in self.groups.values() for s in g.samples)

    def unscored(self, busy: frozenset[str] = frozenset()) -> list[SampleState]:
        """Finished samples without a reward that nothing is scoring (`busy` uids): after a restore."""
        return [s for s in self.samples() if s.finished and s.reward is None and s.uid not in busy]

    # -- requests and rounds ------------------------------------------------------------------
    def begin_step(self) -> None:
        """A new step: every sample's next request begins a round of its own."""
        for s in self.samples():
            s.step_rounds = 0

    @property
    def rounds(self) -> int:
        """The most rounds one sample has begun since the step began."""
        return max((s.step_rounds for s in self.samples()), default=0)

    def begin_requests(self, busy: frozenset[str] = frozenset()) -> list[Request]:
        """The next request of every unfinished sample not being generated (`busy` uids), oldest
        groups first, to be sent: at most the rest of the sample's round of token_budget new
        tokens; a sample whose round is used up (or that has begun none this step) begins another
        here (its round counters advance)."""
        out = []
        for s in self.samples():
            if s.finished or s.uid in busy:
                continue
            if s.step_rounds == 0 or s.round_tokens >= self.token_budget:
                s.step_rounds, s.round_tokens = s.step_rounds + 1, 0
            left = self.max_new_tokens - len(s.response_ids)
            routes_from = 0 if self.routes else None
            out.append(
                Request(s, s.prompt_ids + s.response_ids, min(left, self.token_budget - s.round_tokens), routes_from)
            )
        return out

    def record(self, request: Request, completion: Completion, version: int) -> None:
        """Append a completion's tokens to its sample. Tokens carry the versions the engine reports
        (numeric weight versions), else `version`: the oldest that may have sampled them (the one
        live when the request was sent). The completion is one its engine's client checked against
        the request (engines/client.py: no more tokens than asked, the routes of every position
        run, decoded in `Completion.routes`, which replace the sample's: every position from 0)."""
        s = request.sample
        if s.finished:
            raise RuntimeError(f"{s.uid} is finished already: a duplicate completion")
        routed = self.routes is not None and request.routes_from is not None
        if routed and completion.routes is None:
            raise RuntimeError(f"{s.uid}: a completion without the routes its request asked for (unchecked)")
        if s.response_ids:
            self.counters["resumed"] += 1
        reported = completion.token_versions()
        versions = [int(v) if v is not None and str(v).lstrip("-").isdigit() else version for v in reported]
        if routed and completion.routes:  # an answer that ran no position (aborted queued) keeps what is held
            s.routes = completion.routes
        s.response_ids += completion.output_ids
        s.logprobs += completion.logprobs
        s.versions += versions
        s.round_tokens += len(completion.output_ids)
        if completion.finish == "stop":
            s.finish = "stop"
        elif len(s.response_ids) >= self.max_new_tokens:
            s.finish = "length"
        # "abort", or "length" at the round's budget: unfinished, continued later

    def restart(self, sample: SampleState) -> None:
        """Discard the sample's response: it is generated again from its prompt (a request cut
        short whose output is not kept)."""
        sample.reset()

    def apply_reward(self, sample: SampleState, response: list[int], scored: tuple[float, str | None]) -> bool:
        """The scorer's (reward, error) for `response`, applied when the sample still holds that
        finished response (it was not reset while it was scored); whether it was applied."""
        if not sample.finished or sample.response_ids != response:
            return False
        sample.reward, sample.reward_error = scored
        return True

    # -- staleness ----------------------------------------------------------------------------
    def oldest_allowed(self, version: int) -> int:
        """The oldest token version that policy version `version` may train on."""
        return version - self.max_staleness

    def drop_stale(self, version: int, busy: frozenset[str] = frozenset()) -> int:
        """Reset every sample (not being generated: `busy` uids) holding a token older than version
        `version` may train on, so that it is generated again, and discard such groups set aside
        (they would train nothing: not worth generating again); with mask_stale_prefix nothing is
        reset (those tokens are masked instead: loss_mask). Returns how many samples were reset."""
        if self.mask_stale_prefix:
            return 0
        oldest, dropped = self.oldest_allowed(version), 0
        self.set_aside = [g for g in self.set_aside if min(_versions(g), default=oldest) >= oldest]
        for s in self.samples():
            if s.uid not in busy and s.versions and min(s.versions) < oldest:
                s.reset()
                s.regenerated += 1
                dropped += 1
        self.counters["dropped_stale"] += dropped
        return dropped

    def loss_mask(self, sample: SampleState, version: int) -> list[int] | None:
        """With mask_stale_prefix, the sample's loss mask when version `version` trains it: 0 for the
        tokens older than it may train on. None: every token counts."""
        if not self.mask_stale_prefix:
            return None
        oldest = self.oldest_allowed(version)
        return [int(v >= oldest) for v in sample.versions]

    # -- the step's batch ------------------------------------------------------------------------
    def batch(self, groups: list[GroupState], version: int, temperature: float) -> RolloutBatch:
        """The groups a step took (`take`), as the batch policy version `version` trains on: the
        stale tokens' loss masks, the routes recorded, the version in the metadata."""
        return RolloutBatch.from_groups(
            groups,
            temperature,
            metadata={"version": str(version)},
            loss_masks=[[self.loss_mask(s, version) for s in g.samples] for g in groups],
            routes=self.routes,
        )

    def batch_figures(self, groups: list[GroupState], version: int) -> dict[str, float]:
        """What the groups a step trains on look like: reward, length, truncation, and how stale their
        tokens are for policy version `version` (mean, max, the share at each staleness, the share
        masked out as older than the bound)."""
        samples = [s for g in groups for s in g.samples]
        rewards = [s.reward for s in samples]
        lengths = [len(s.response_ids) for s in samples]
        stale = [version - v for s in samples for v in s.versions]
        out = {
            "rollout/reward_mean": sum(rewards) / len(rewards),
            "rollout/response_length": sum(lengths) / len(lengths),
            "rollout/truncated": sum(n >= self.max_new_tokens for n in lengths) / len(lengths),
            "rollout/token_staleness_mean": sum(stale) / max(1, len(stale)),
            "rollout/token_staleness_max": float(max(stale, default=0)),
            "rollout/stale_masked_share": sum(k > self.max_staleness for k in stale) / max(1, len(stale)),
        }
        for k in range(max(stale, default=0) + 1):
            out[f"rollout/staleness_share/{k}"] = stale.count(k) / len(stale)
        return out

    # -- checkpoints ----------------------------------------------------------------------------
    def _config(self) -> list:
        return [self.samples_per_prompt, self.max_new_tokens, self.token_budget, self.max_staleness]

    def state_dict(self) -> dict[str, Any]:
        """Plain data (JSON but for recorded routes, which are bytes: checkpoints hold them as they are)."""
        groups, aside = [_plain(g) for g in self.groups.values()], [_plain(g) for g in self.set_aside]
        return {"config": self._config(), "groups": groups, "set_aside": aside, "counters": dict(self.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if list(state["config"]) != self._config():
            raise ValueError(
                f"rollout buffer saved with (samples_per_prompt, max_new_tokens, token_budget, "
                f"max_staleness) = {state['config']}, this run has {self._config()}"
            )
        self.groups = {g["uid"]: _group(g) for g in state["groups"]}
        self.set_aside = [_group(g) for g in state.get("set_aside", [])]  # (none in checkpoints before it)
        self.counters = {**COUNTERS, **state["counters"]}


def _versions(group: GroupState):
    return (v for s in group.samples for v in s.versions)


def _plain(group: GroupState) -> dict[str, Any]:
    out = asdict(group)
    for sample in out["samples"]:
        if not sample["routes"]:
            del sample["routes"]
    return out


def _group(state: dict[str, Any]) -> GroupState:
    return GroupState(state["uid"], state["prompt_ids"], state["meta"], [SampleState(**s) for s in state["samples"]])

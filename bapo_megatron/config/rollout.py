"""rollout: what a step generates and how: sampling, partial rollout, the engines, the weight sync."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from bapo_megatron.config.engines import EnginesConfig
from bapo_megatron.errors import check


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """rollout.sampling: how responses are sampled (SGLang's sampling_params)."""

    max_new_tokens: int = 64
    """The longest response, in tokens; a response cut there ends with finish reason "length"."""
    temperature: float = 1.0
    """The trainer divides its logits by it too, as the engines do."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the most likely tokens whose probabilities sum to top_p (1: all)."""
    top_k: int = -1
    """Sample from the top_k most likely tokens only (-1: all)."""

    def __post_init__(self) -> None:
        check(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "must be >= 1")
        # the trainer divides logits by it: below 0.01 a logit gap of 1 is 100 nats, past what
        # float32 log-probs (and bf16 logits) resolve, and every update comes out non-finite
        check(self.temperature >= 0.01, "temperature", self.temperature, "must be >= 0.01 (sampling for RL)")
        check(0 < self.top_p <= 1, "top_p", self.top_p, "must lie in (0, 1]")
        check(self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k, "must be -1 (off) or >= 1")


@dataclass(frozen=True, kw_only=True)
class PartialConfig:
    """rollout.partial: synchronous partial rollout, responses continued in later steps under newer weights."""

    enabled: bool = False
    """Keep what a response has generated when its step ends and continue it next step (else it is
    generated again from the start)."""
    token_budget: int | None = None
    """mode abort: new tokens per request (None: rollout.sampling.max_new_tokens, no cutting). A
    response cut there continues at once while fewer than prompts_per_step groups are complete,
    else next step under newer weights."""
    mode: Literal["abort", "retract"] = "abort"
    """"abort" cuts responses at the token budget and at the end of each step and resubmits them;
    "retract" keeps requests inside the engines across steps and weight updates (paused in retract
    mode, continued under the new weights), with no token budget."""

    def __post_init__(self) -> None:
        if self.token_budget is not None:
            check(
                self.enabled,
                "token_budget",
                self.token_budget,
                "only applies with enabled=true (turning partial rollout off: rollout.partial.token_budget=null too)",
            )
            check(self.token_budget >= 1, "token_budget", self.token_budget, "must be >= 1")
            check(
                self.mode == "abort",
                "token_budget",
                self.token_budget,
                "does not apply with mode=retract (requests are never cut)",
            )
        if self.mode == "retract":
            check(self.enabled, "mode", self.mode, "needs enabled=true")


OnShortfall = Literal["warn", "fill", "error"]
"""rollout.filter_groups.on_shortfall: what a step short of groups whose rewards differ does."""


@dataclass(frozen=True, kw_only=True)
class FilterGroupsConfig:
    """rollout.filter_groups: dynamic sampling (DAPO; verl's algorithm.filter_groups, slime's
    check_reward_nonzero_std filter). A group whose rewards are all equal has every advantage 0 and
    trains nothing: it is set aside and another prompt generated in its place (rollout/filtering.py).
    Metrics every step: rollout/filtered_groups, rollout/extra_rounds, rollout/filter_shortfall,
    rollout/flat_share."""

    enabled: bool = False
    """Set aside the groups whose rewards (reward.*, the overlong penalty included) are all equal and
    generate others until the step has prompts_per_step groups whose rewards differ (sync: a new
    prompt for each; async: the producer admits one in its place)."""
    max_extra_rounds: int = 4
    """A step stops generating once it has seen (1 + this) x prompts_per_step complete groups (those
    completing as it ends are counted too; rollout/extra_rounds: the groups seen beyond
    prompts_per_step, in steps' worth). verl's max_num_gen_batches - 1 where gen_batch_size =
    train_batch_size; there is no unbounded setting (verl's max_num_gen_batches=0). Short of groups
    whose rewards differ by then, the step does what on_shortfall says; with none at all the run
    stops with an error: the prompts are too hard or too easy for the model, or the reward is wrong."""
    on_shortfall: OnShortfall = "warn"
    """A step that has used its max_extra_rounds short of prompts_per_step groups whose rewards differ:
    "warn" tops it up with groups of equal rewards it drew (the oldest set aside), as "fill" does, and
    prints one warning line (the flat share: the groups it set aside over those it looked at; the
    groups short; the rounds); "fill" tops it up without a word. The groups topped up
    (rollout/filter_shortfall) have advantage 0 and give no policy gradient, but they keep the batch's
    size, which algo.updates_per_batch and the data-parallel ranks divide, and its token count (their
    tokens count in the step's token mean, so they scale the policy gradient down, and they carry the
    KL and entropy terms). "error" stops the run with an error line, as verl does when
    max_num_gen_batches runs out."""

    def __post_init__(self) -> None:
        check(self.max_extra_rounds >= 0, "max_extra_rounds", self.max_extra_rounds, "must be >= 0")
        check(
            self.enabled or self.on_shortfall == "warn",
            "on_shortfall",
            self.on_shortfall,
            "applies with enabled=true (rollout.filter_groups.enabled=true)",
        )


@dataclass(frozen=True, kw_only=True)
class WeightSyncConfig:
    """rollout.sync: the trainer's weights to the engines after every step, and the check that they arrived."""

    host: str | None = None
    """Address the engines reach this trainer's rank 0 at for the weight-update group (None:
    127.0.0.1 when the engines are local, else this host's name)."""
    bucket_mb: int = 512
    """Tensors travel in buckets of at most this many MiB."""
    check_every: int = 0
    """Every this many steps (0: never), after the weight sync, the engine's log-probs of a fixed
    probe response are compared with the trainer's (sync/probe_logprob_gap)."""
    check_max_gap: float = 1e-3
    """A probe gap above this stops the run with an error (a broken weight sync) instead of training
    on what the engines generate. Raise it for bf16/fp8 engines, whose kernels differ."""

    verify: bool | str = "auto"
    """How often each engine proves it holds the tensors sent: "off" (false), "every_step" (true),
    "every N" (weight versions), or "auto" (every step for embedded engines, where it costs under
    0.4% of a demo step; off for SGLang). The trainer sends the sha256 of every tensor's bytes with
    the update (SGLang's expected_checksums); an embedded engine hashes what it received before
    loading it, and a mismatch stops the run naming the tensor and the engine. SGLang 0.5.23 takes
    checksums only with LoRA adapters: for it, a due check runs the log-prob probe (check_max_gap)."""

    def verify_every(self, embedded: bool) -> int:
        """Updates between weight checks (0: never), for engines that are embedded or not."""
        if self.verify == "auto":
            return 1 if embedded else 0
        if self.verify == "off":
            return 0
        if self.verify == "every_step":
            return 1
        return int(self.verify.split()[1])

    def __post_init__(self) -> None:
        if isinstance(self.verify, bool):  # YAML reads `off` as false
            object.__setattr__(self, "verify", "every_step" if self.verify else "off")
        words = str(self.verify).split()
        every_n = len(words) == 2 and words[0] == "every" and words[1].isdigit() and int(words[1]) >= 1
        check(
            self.verify in ("auto", "off", "every_step") or every_n,
            "verify",
            self.verify,
            'expected "off", "every_step", "every N" (N >= 1) or "auto"',
        )
        check(self.bucket_mb >= 1, "bucket_mb", self.bucket_mb, "must be >= 1")
        check(self.check_every >= 0, "check_every", self.check_every, "must be >= 0")
        check(self.check_max_gap > 0, "check_max_gap", self.check_max_gap, "must be > 0")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Generation: what a step trains on, how it is scheduled against training, and the engines."""

    mode: Literal["sync", "async"] = "sync"
    """"sync": each step generates its batch, then trains, then syncs the weights (the engines wait
    while the trainer trains). "async": the engines keep generating while the trainer trains; a
    step takes the oldest complete groups, within max_staleness versions of the policy it trains."""
    prompts_per_step: int = 8
    """Prompts (groups) in each step's batch."""
    samples_per_prompt: int = 4
    """Responses generated for each prompt: a group, whose rewards make the advantages."""
    oversample: float = 1.0
    """Keep this many times prompts_per_step groups generating, so slow groups do not stall a step
    (sync: 2 to 3 with partial rollout keeps the engines busy, benchmarks/bench_rollout.py)."""
    max_staleness: int = 4
    """K: no token trained by policy version v was sampled by a version older than v - K. A sample
    that would break it is generated again (or, mask_stale_prefix, its older tokens are left out of
    the loss). Async: no new group starts while those queued and generating could not all be
    trained within K versions."""
    mask_stale_prefix: bool = False
    """Enforce max_staleness by leaving tokens older than v - K out of the loss (they stay in the
    context) instead of generating the sample again."""
    pause_mode: Literal["retract", "abort", "in_place"] = "retract"
    """Async: how the engines pause for a weight update while requests are in flight (SGLang's
    /pause_generation). "retract": requests wait inside the engines, their KV cache is dropped and
    recomputed under the new weights; "abort": requests end and return their tokens, which the
    driver sends back to continue; "in_place": requests keep their KV cache of the old weights
    (nothing recomputed; the cache is not flushed, and tokens sampled after the update attend to
    keys and values of the older policy while counting as the new version)."""
    deterministic: bool = False
    """One request order and per-request sampling seeds (from the job seed, the sample's id and its
    length so far), and batch-invariant engines (the embedded one runs each request alone; SGLang
    gets --enable-deterministic-inference): two runs, or a run and its resumption, generate the
    same samples with the same log-probs. Synchronous rounds, so slower; mode sync only."""
    calls: Literal["auto", "group", "round"] = "auto"
    """How a sync step's requests share the engines' /generate calls (a call is answered when all of
    its requests have finished). "group": a group's samples in one call, so that a complete group is
    scored while the others generate. "round": all of a round's requests to an engine in one call,
    where the step waits for every one of them anyway (no oversample and no filter_groups, or
    deterministic rounds; refused elsewhere): fewer calls, the rewards after the round. "auto":
    "round" on the embedded engine where it applies (else "group"): a call costs it about what a
    decode step of a small model does (one call a step in place of 32 took bench_vs_trl's rollout
    from 118 to 99 ms); "group" on SGLang."""
    record_routes: bool | None = None
    """Mixture-of-experts models: the engines return the experts they routed each position to, and
    samples keep them (1 byte a MoE layer and top-k slot while experts fit; the dry run prints a
    step's worth). None: when algo.routing_replay is on; true without replay measures the router
    disagreement of the trainer's own routing against the engines' (moe/router_disagreement)."""
    replay: str | None = None
    """Train from saved rollout batches instead of generating: a .safetensors file (used every
    step) or a directory of them (one per step, in name order, cycling)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    partial: PartialConfig = field(default_factory=PartialConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    engines: EnginesConfig = field(default_factory=EnginesConfig)
    sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "samples_per_prompt"):
            check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        check(self.oversample >= 1.0, "oversample", self.oversample, "must be >= 1")
        check(self.max_staleness >= 0, "max_staleness", self.max_staleness, "must be >= 0")
        budget, new = self.partial.token_budget, self.sampling.max_new_tokens
        if budget is not None:
            check(budget <= new, "partial.token_budget", budget, f"must not exceed sampling.max_new_tokens={new}")
            reach = budget * (self.max_staleness + 1)
            check(
                self.mask_stale_prefix or reach >= new,
                "partial.token_budget",
                budget,
                f"x (max_staleness + 1) = {reach} tokens is all a response can get before it is stale; "
                f"it must reach sampling.max_new_tokens={new}, or long responses never finish",
            )
        if self.replay is not None:
            check(
                not self.filter_groups.enabled,
                "filter_groups.enabled",
                True,
                "has no effect with rollout.replay (saved batches are trained as they are)",
            )
        if self.deterministic:
            check(self.mode == "sync", "deterministic", True, "needs mode=sync (asynchronous timing decides batches)")
            check(
                self.partial.mode == "abort",
                "deterministic",
                True,
                "needs partial.mode=abort (in retract mode the engines decide when a request continues)",
            )
        if self.calls == "round":  # where it cannot apply, said rather than quietly a group a call
            cuts = self.mode == "async" or (self.partial.enabled and self.partial.mode == "retract")
            check(not cuts, "calls", "round", "applies to mode=sync with partial.mode=abort (these send one a sample)")
            replaces = not self.deterministic and (self.oversample > 1 or self.filter_groups.enabled)
            check(
                not replaces,
                "calls",
                "round",
                "needs a step that waits for every group it draws: oversample=1, filter_groups off (or deterministic)",
            )
        if self.mode == "async":
            check(
                not self.partial.enabled,
                "partial.enabled",
                True,
                "applies to mode=sync; mode=async keeps requests going across weight updates (pause_mode)",
            )
            check(
                not self.engines.colocate,
                "engines.colocate",
                True,
                "mode=async generates while the trainer trains: the engines need GPUs of their own",
            )

    @property
    def round_calls(self) -> bool:
        """Whether a round's requests may share one call an engine (`calls`, auto resolved)."""
        return self.calls == "round" or (self.calls == "auto" and self.engines.kind == "embedded")

    @property
    def token_budget(self) -> int:
        """New tokens one request may generate: partial.token_budget where set, else max_new_tokens."""
        return self.partial.token_budget or self.sampling.max_new_tokens

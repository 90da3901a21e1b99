"""Typed configuration of a whole job: YAML file plus dotted overrides (`algo.bapo.target_rho=0.4`).

    cfg = load_config("examples/tiny_cpu.yaml", ["parallel.tensor=2", "algo.loss=ppo"])

Every section is a keyword-only dataclass that validates itself; an unknown key is rejected
with the closest valid name, and an invalid value raises ConfigError (a ValueError) naming
the dotted field and the value.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from bapo_megatron.algo.advantages import AdvantageConfig
from bapo_megatron.algo.bapo import PRESETS as BAPO_PRESETS
from bapo_megatron.algo.bapo import BAPOConfig
from bapo_megatron.algo.losses import PolicyLossConfig
from bapo_megatron.errors import UNKNOWN_KEY, ConfigError, check


@dataclass(frozen=True, kw_only=True)
class AlgoConfig(PolicyLossConfig):
    """The RL algorithm: the policy loss and its parameters (BAPO or a baseline), advantages."""

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    updates_per_batch: int = 1
    """Optimizer steps taken on one rollout batch (the batch is split into this many mini-batches)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.updates_per_batch >= 1, "updates_per_batch", self.updates_per_batch, "must be >= 1")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The policy network: a Hugging Face checkpoint or config, and how Megatron builds it."""

    hf_path: str | None = None
    """Directory with config.json (and weights, tokenizer); None: the built-in tiny CPU model. Its
    safetensors are the starting weights (loaded by each rank straight into its slices), unless
    mcore_path is set or a checkpoint is resumed; a directory without weights starts from random
    ones, with a warning."""
    mcore_path: str | None = None
    """A Megatron dist checkpoint to start from instead (tools/convert_checkpoint.py hf-to-mcore, or
    a trainer's step directory: its model weights only)."""
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    """"transformer_engine" on GPU (needed for fp8); "local" on CPU and in tests."""
    precision: Literal["fp32", "bf16", "fp8"] = "fp32"
    fp8_format: Literal["hybrid", "e4m3"] = "hybrid"
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise"] = "tensorwise"
    """Scaling recipe: "tensorwise" (current scaling, Hopper), "delayed" (amax history), "blockwise"."""
    fp8_bf16_first_last_layers: bool = True
    """Keep the first and last transformer layers in bf16 under fp8 (not with the delayed recipe)."""
    make_vocab_size_divisible_by: int = 128
    """The embedding is padded to a multiple of this times the tensor-parallel size."""
    vocab_pad_tp: int = 8
    """Pad the vocabulary as for this tensor-parallel size too (a multiple of divisible_by x lcm(tp, this)),
    so that a checkpoint loads at every TP dividing it; the padding is masked and never exported."""
    logprob_memory_mb: int = 1024
    """Memory for the log-prob and entropy temporaries of the loss (float32 [tokens, vocab / TP]
    tensors, a few at once): tokens are processed in chunks sized to fit it (a 152k vocabulary
    at TP=1 takes about 5 MB a token op by op, 0.6 MB fused)."""
    fused_logprobs: bool = True
    """On GPU, run the log-prob and entropy work of each chunk as kernels fused by torch.compile
    (op by op it took 37% of a Qwen2.5-1.5B step on an H100); false: op by op, as on the CPU."""

    def __post_init__(self) -> None:
        check(self.logprob_memory_mb >= 1, "logprob_memory_mb", self.logprob_memory_mb, "must be >= 1")
        check(
            self.make_vocab_size_divisible_by >= 1,
            "make_vocab_size_divisible_by",
            self.make_vocab_size_divisible_by,
            "must be >= 1",
        )
        check(self.vocab_pad_tp >= 1, "vocab_pad_tp", self.vocab_pad_tp, "must be >= 1")
        if self.precision == "fp8":
            check(
                self.transformer_impl == "transformer_engine",
                "precision",
                self.precision,
                "fp8 needs transformer_impl='transformer_engine'",
            )
            check(
                not (self.fp8_recipe == "delayed" and self.fp8_bf16_first_last_layers),
                "fp8_recipe",
                self.fp8_recipe,
                "delayed scaling cannot keep the first/last layers in bf16; "
                "set fp8_bf16_first_last_layers=false or use 'tensorwise'",
            )


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Megatron parallel layout; the data-parallel size is what remains of the world size."""

    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    """Context parallel: not supported yet (1). Megatron does not split sequences itself: each CP
    rank must be fed its 2 x CP load-balanced chunks, with TE attention; until that exists, a
    value above 1 is refused rather than silently training on wrong positions and attention."""
    virtual_pipeline: int | None = None
    """Interleaved pipeline: model chunks per pipeline rank (None: not interleaved)."""
    sequence_parallel: bool = False
    max_tokens_per_microbatch: int = 4096
    """Micro-batches are filled by token count (length-sorted), up to this many tokens each."""

    def __post_init__(self) -> None:
        for name in ("tensor", "pipeline", "context", "max_tokens_per_microbatch"):
            check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        check(
            self.context == 1,
            "context",
            self.context,
            "context parallel is not supported yet (each CP rank would see the whole sequence); "
            "use tensor parallel with sequence_parallel=true for long sequences",
        )
        if self.virtual_pipeline is not None:
            check(
                self.virtual_pipeline >= 2 and self.pipeline >= 2,
                "virtual_pipeline",
                self.virtual_pipeline,
                "needs pipeline >= 2 and at least 2 chunks per rank",
            )
        if self.sequence_parallel:
            check(self.tensor >= 2, "sequence_parallel", self.sequence_parallel, "needs tensor >= 2")

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel size for `world_size` processes; ConfigError if they do not divide."""
        model = self.tensor * self.pipeline * self.context
        check(
            world_size % model == 0,
            "parallel",
            f"tensor*pipeline*context={model}",
            f"does not divide the world size {world_size}",
        )
        return world_size // model


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Adam with linear warmup and an optional decay, gradient clipping."""

    lr: float = 1e-6
    min_lr: float = 0.0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    lr_decay: Literal["constant", "linear", "cosine"] = "constant"
    """After warmup: keep lr, or decay it to min_lr over the run."""
    max_skipped_steps: int = 3
    """The run stops (exit 1) after this many steps in a row whose every update was skipped for a
    non-finite loss or gradient: it is not training, and would otherwise report "finished"."""

    def __post_init__(self) -> None:
        check(self.lr > 0, "lr", self.lr, "must be > 0")
        # Adam moves each weight by about lr a step: past 1 the first step wrecks the weights and
        # every later update is skipped as non-finite
        check(self.lr <= 1, "lr", self.lr, "must be <= 1 (Adam moves each weight by about lr per step)")
        check(self.max_skipped_steps >= 1, "max_skipped_steps", self.max_skipped_steps, "must be >= 1")
        check(0 <= self.min_lr <= self.lr, "min_lr", self.min_lr, f"must lie in [0, lr={self.lr}]")
        check(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "must be >= 0")
        check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            check(0 <= getattr(self, name) < 1, name, getattr(self, name), "must lie in [0, 1)")
        check(self.adam_eps > 0, "adam_eps", self.adam_eps, "must be > 0")
        check(self.clip_grad >= 0, "clip_grad", self.clip_grad, "must be >= 0")


SGLANG_LAUNCHER_ARGS = {
    "model-path": "set to the model being trained",
    "host": "set from rollout.engines.host",
    "port": "set from rollout.engines.port + the server's index",
    "tp-size": "set from rollout.engines.tensor_parallel",
    "dp-size": "always 1: one server per replica, as weight updates need",
    "base-gpu-id": "set from the server's index",
    "mem-fraction-static": "set from rollout.engines.mem_fraction_static",
    "weight-version": "set to the policy version",
    "random-seed": "set from the job seed + the server's index",
    "skip-tokenizer-init": "always true: token ids in and out",
    "enable-memory-saver": "set from rollout.engines.colocate",
    "enable-deterministic-inference": "set from rollout.deterministic (batch-invariant kernels)",
    "admin-api-key": "set from rollout.engines.admin_key_file or $BAPO_ADMIN_API_KEY",
    "api-key": "never set: the rollout client sends only the admin key, so /generate would answer 401",
}
"""SGLang options that engines/sglang_launcher.py derives from the config: never in sglang_args."""

SGLANG_DEPRECATED_ARGS = {
    "disable-cuda-graph": "disable-decode-cuda-graph: true and disable-prefill-cuda-graph: true",
    "enable-dp-attention": "attn-dp-size (each server here has dp-size 1)",
    "monokernel-backend": "enable-amd-monokernel: true",
    "enable-flashinfer-allreduce-fusion": "flashinfer-allreduce-fusion-backend: auto",
    "grpc-mode": "smg-grpc-mode",
    "disable-fast-image-processor": "image-processor-backend: pil",
}
"""SGLang 0.5.23's deprecated server options and what replaces each: its --config merger refuses
some outright ("Unsupported config option"); tests/unit/test_sglang_launch_config.py
checks this list against the options its own parser registers as deprecated."""


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """rollout.sampling: how responses are sampled (SGLang's sampling_params)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    """The trainer divides its logits by it too, as the engines do."""
    top_p: float = 1.0
    top_k: int = -1

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
            check(self.enabled, "token_budget", self.token_budget, "only applies with enabled=true")
            check(self.token_budget >= 1, "token_budget", self.token_budget, "must be >= 1")
            check(
                self.mode == "abort",
                "token_budget",
                self.token_budget,
                "does not apply with mode=retract (requests are never cut)",
            )
        if self.mode == "retract":
            check(self.enabled, "mode", self.mode, "needs enabled=true")


@dataclass(frozen=True, kw_only=True)
class EnginesConfig:
    """rollout.engines: the inference servers, started by the job or already running elsewhere."""

    kind: Literal["embedded", "sglang"] = "embedded"
    """"embedded": the CPU engine of this package; "sglang": SGLang servers."""
    servers: int = 1
    """Engine servers (one per inference data-parallel replica)."""
    tensor_parallel: int = 1
    """Tensor-parallel size of each SGLang server."""
    urls: tuple[str, ...] = ()
    """Engines that are already running (another node, another job): the driver only connects to
    them (and starts none). Empty: the driver starts `servers` engines of `kind`."""
    host: str = "127.0.0.1"
    """Interface the engines listen on; anything beyond loopback requires an admin key."""
    port: int = 30000
    """First server port; server i listens on port + i."""
    colocate: bool = False
    """SGLang shares the trainer's GPUs: memory saver on, weights pushed with update_weights_from_tensor."""
    mem_fraction_static: float | None = None
    """SGLang: fraction of GPU memory for weights and KV cache. None: 0.8 on GPUs of their own;
    colocated, what the trainer's resident memory (parameters, gradients, optimizer states:
    trainer/memory.py) leaves, less 10% of the GPU for SGLang's activations and CUDA graphs."""
    admin_key_file: str | None = None
    """File holding the engines' admin key (else $BAPO_ADMIN_API_KEY; generated when the servers
    listen beyond loopback and none is given)."""
    sglang_args: dict[str, Any] = field(default_factory=dict)
    """SGLang: further server options by their command-line names, passed as given (for example
    {attention-backend: fa3, chunked-prefill-size: 8192, disable-decode-cuda-graph: true}).
    Underscores read as dashes; a None leaves the option at SGLang's default. The options the
    launcher sets from the fields above, and SGLang's deprecated ones, are refused here."""
    max_batch: int = 64
    """Embedded engine: requests decoded together."""
    request_timeout_s: float = 600.0
    startup_timeout_s: float = 600.0
    """Seconds an engine may take to become ready (or an engine URL to answer)."""
    wait_s: float = 900.0
    """With no engine serving for this long (dead, restarting, or waiting for the weights), the run
    stops with one error line. Engines the job started are restarted when they die; engines given
    by `urls` are waited for until they answer again. Either kind serves again only after it has
    taken the current weights and passed the version check (and the probe, with sync.check_every)."""
    max_restarts: int = 3
    """An engine the job started that fails to come back this many times in a row stops the run."""

    def __post_init__(self) -> None:
        for name in ("servers", "tensor_parallel", "max_batch", "max_restarts"):
            check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        for name in ("request_timeout_s", "startup_timeout_s", "wait_s"):
            check(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        for i, url in enumerate(self.urls):
            check(url.startswith(("http://", "https://")), f"urls[{i}]", url, "must be an http(s):// URL")
        check(1 <= self.port <= 65535 - self.servers, "port", self.port, "must leave room for one port per server")
        if self.mem_fraction_static is not None:
            check(
                0 < self.mem_fraction_static < 1, "mem_fraction_static", self.mem_fraction_static, "must lie in (0, 1)"
            )
        for key, value in self.sglang_args.items():
            name = key.replace("_", "-")
            check(
                name not in SGLANG_LAUNCHER_ARGS,
                f"sglang_args.{key}",
                value,
                f"is the launcher's option ({SGLANG_LAUNCHER_ARGS.get(name)})",
            )
            check(
                name not in SGLANG_DEPRECATED_ARGS,
                f"sglang_args.{key}",
                value,
                f"is deprecated in SGLang 0.5.23, whose --config refuses it; use {SGLANG_DEPRECATED_ARGS.get(name)}",
            )
            check(
                value is None or isinstance(value, (str, int, float, bool, list)),
                f"sglang_args.{key}",
                value,
                "must be a scalar or a list",
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

    def __post_init__(self) -> None:
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
    samples_per_prompt: int = 4
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
    replay: str | None = None
    """Train from saved rollout batches instead of generating: a .safetensors file (used every
    step) or a directory of them (one per step, in name order, cycling)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    partial: PartialConfig = field(default_factory=PartialConfig)
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
        if self.deterministic:
            check(self.mode == "sync", "deterministic", True, "needs mode=sync (asynchronous timing decides batches)")
            check(
                self.partial.mode == "abort",
                "deterministic",
                True,
                "needs partial.mode=abort (in retract mode the engines decide when a request continues)",
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
    def token_budget(self) -> int:
        """New tokens one request may generate: partial.token_budget where set, else max_new_tokens."""
        return self.partial.token_budget or self.sampling.max_new_tokens


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Prompts: a jsonl or parquet file and which fields hold what; None: the synthetic task."""

    path: str | None = None
    """Prompts, one record each (needed unless rollout.replay is set): a file, a directory of
    shards, or a glob pattern ("data/train-*.parquet")."""
    format: Literal["auto", "jsonl", "json", "parquet"] = "auto"
    """auto: from each file's suffix (.jsonl, .json, .parquet)."""
    prompt_field: str = "prompt"
    """The record's prompt, a dotted path: text (tokenised with the model directory's tokenizer),
    token ids, or a list of chat messages [{"role": ..., "content": ...}] (verl's layout)."""
    answer_field: str = "answer"
    """The record's reference answer, a dotted path ("reward_model.ground_truth"), handed to the
    reward as record["answer"] beside the whole record."""
    system_prompt: str | None = None
    """A system turn put before chat prompts that have none (text prompts need chat_template)."""
    max_prompt_tokens: int | None = None
    """Prompts longer than this many tokens are dropped, or refused (overlong_prompts)."""
    overlong_prompts: Literal["drop", "error"] = "drop"
    """drop: left out, counted (data/prompts_dropped); error: the run stops naming the record."""
    check_records: int = 1000
    """Records read, rendered and checked before anything starts; the rest when drawn."""
    cache_dir: str | None = None
    """Where parquet files are kept decoded (Arrow, read a batch at a time); None: $BAPO_DATA_CACHE, else
    ~/.cache/bapo-megatron/data."""
    shuffle: bool = True
    seed: int = 0
    reward: str = "math"
    """"math" (math-verify on the last \\boxed answer), "exact" (the text, stripped), "exact_ids",
    or a function of yours, "pkg.module:fn" or "path/to/file.py:fn", called as
    fn(text, ids, record) -> float. A call that fails scores 0 and is counted (rollout/reward_errors)."""
    reward_by: str | None = None
    """Pick each record's reward by this field (a dotted path; verl's data_source): its value names
    the reward in `rewards`. A value without an entry is an error before the first step."""
    rewards: dict[str, str] = field(default_factory=dict)
    """reward_by's map, value -> reward ({math_dapo: dapo, aime: math, mine: "path/to/file.py:fn"})."""
    overlong_buffer: int | None = None
    """DAPO's overlong penalty, over any reward: a response longer than rollout.sampling.max_new_tokens
    minus this many tokens loses up to overlong_penalty_factor, linearly to the budget's end."""
    overlong_penalty_factor: float = 1.0
    reward_workers: int = 1
    """Processes scoring responses beside generation."""
    reward_timeout_s: float = 20.0
    """A reward call that takes longer fails (scores 0, is counted) and its worker is replaced.
    math-verify bounds each of its three stages (the answer's parse, the response's, the
    comparison) with a 5 s alarm of its own: its worst case measured 6.3 s on a loaded 2-core machine."""
    reward_memory_mb: int = 4096
    """Address space a reward worker may take beyond its start (the interpreter and the imported
    reward); a call past it fails with MemoryError and the worker is replaced. 0: no limit."""
    reward_range: tuple[float, float] = (-1e6, 1e6)
    """A reward outside [low, high], or an infinity, is a failed call (as NaN is)."""
    max_reward_failure_share: float = 0.5
    """A step whose batch has more than this share of failed reward calls is a failing step; the
    run stops (exit 1, status.json "failed") after data.reward_failure_steps of them in a row, or
    at once when every call of a step failed: a run whose reward never works learns nothing."""
    reward_failure_steps: int = 3
    chat_template: bool = False
    """Wrap each text prompt in the tokenizer's chat template (one user turn, generation prompt)."""

    def __post_init__(self) -> None:
        for name in ("prompt_field", "answer_field"):
            value = getattr(self, name)
            check(bool(value) and "" not in value.split("."), name, value, "must be a field name or a dotted path")
        if self.max_prompt_tokens is not None:
            check(self.max_prompt_tokens >= 1, "max_prompt_tokens", self.max_prompt_tokens, "must be >= 1")
        check(self.check_records >= 1, "check_records", self.check_records, "must be >= 1")
        check(self.reward_workers >= 1, "reward_workers", self.reward_workers, "must be >= 1")
        routed = self.reward_by is not None
        check(routed == bool(self.rewards), "rewards", self.rewards, "goes with reward_by (both or neither)")
        if self.overlong_buffer is not None:
            check(self.overlong_buffer >= 1, "overlong_buffer", self.overlong_buffer, "must be >= 1")
        factor = self.overlong_penalty_factor
        check(factor >= 0, "overlong_penalty_factor", factor, "must be >= 0")
        check(self.reward_timeout_s > 0, "reward_timeout_s", self.reward_timeout_s, "must be > 0")
        check(self.reward_memory_mb >= 0, "reward_memory_mb", self.reward_memory_mb, "must be >= 0 (0: no limit)")
        low, high = self.reward_range
        check(low < high, "reward_range", list(self.reward_range), "needs low < high")
        share = self.max_reward_failure_share
        check(0 <= share < 1, "max_reward_failure_share", share, "must be in [0, 1) (every call failing always stops)")
        check(self.reward_failure_steps >= 1, "reward_failure_steps", self.reward_failure_steps, "must be >= 1")


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
    logged as eval/*; scored with data.reward and read with data's field map."""

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
    each with data's field map and reward, logged under eval/NAME/."""

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


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Where metrics go: one logger, several backends."""

    backends: tuple[Literal["console", "jsonl", "wandb"], ...] = ("console", "jsonl")
    jsonl_path: str | None = None
    """The jsonl backend's file (None: metrics.jsonl in the run directory)."""
    wandb_project: str | None = None
    wandb_run_name: str | None = None
    interval: int = 1
    progress: bool | None = None
    """Progress bars on stderr for each step's rollout (groups complete, tokens/s) and updates
    (micro-batches); None: only where stderr is a terminal."""

    def __post_init__(self) -> None:
        check(self.interval >= 1, "interval", self.interval, "must be >= 1")
        if "wandb" in self.backends:
            check(
                self.wandb_project is not None, "wandb_project", self.wandb_project, "the wandb backend needs a project"
            )


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Megatron dist checkpoints: where, how often, how many to keep, whether to resume."""

    dir: str | None = None
    interval: int = 0
    """Save every this many steps (0: only at the end, when dir is set)."""
    keep_last: int = 2
    resume: bool = True
    """Continue from dir's latest checkpoint when there is one."""
    save_on_signal: bool = True
    """SIGTERM or SIGUSR1 (Slurm's warning before the time limit): finish the step, save, exit 0."""

    def __post_init__(self) -> None:
        check(self.interval >= 0, "interval", self.interval, "must be >= 0")
        check(self.keep_last >= 1, "keep_last", self.keep_last, "must be >= 1")


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """A whole BAPO job."""

    name: str = "bapo"
    steps: int = 20
    """Rollout-and-train iterations."""
    seed: int = 1234
    run_dir: str | None = None
    """Where the run writes metrics.jsonl, config.yaml, engine logs (None: runs/<name>)."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    stop_when: str | None = None
    """End the run early, as finished (checkpoint saved), once the mean of a metric over its last
    stop_window steps crosses a value: "METRIC>=VALUE" or "METRIC<=VALUE", e.g.
    "sft/answer_acc>=0.2" (the warm start answers 20% of its batches greedily) or "loss/sft<=0.5"."""
    stop_window: int = 10
    """Steps whose values of stop_when's metric are averaged."""

    def __post_init__(self) -> None:
        check(self.steps >= 1, "steps", self.steps, "must be >= 1")
        check(self.stop_window >= 1, "stop_window", self.stop_window, "must be >= 1")
        if self.stop_when is not None:
            parse_stop_when(self.stop_when)
        check(
            self.rollout.samples_per_prompt >= 2,
            "rollout.samples_per_prompt",
            self.rollout.samples_per_prompt,
            "group-relative advantages need at least 2 samples per prompt",
        )
        check(
            self.rollout.prompts_per_step % self.algo.updates_per_batch == 0,
            "algo.updates_per_batch",
            self.algo.updates_per_batch,
            f"must divide rollout.prompts_per_step={self.rollout.prompts_per_step} (mini-batches hold whole groups)",
        )
        if self.data.overlong_buffer is not None:
            new = self.rollout.sampling.max_new_tokens
            check(
                self.data.overlong_buffer <= new,
                "data.overlong_buffer",
                self.data.overlong_buffer,
                f"must not exceed rollout.sampling.max_new_tokens={new} (the penalty's buffer ends the budget)",
            )

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / self.name


def parse_stop_when(rule: str) -> tuple[str, str, float]:
    """The rule METRIC>=VALUE or METRIC<=VALUE as (metric, ">=" or "<=", value); ConfigError otherwise."""
    for op in (">=", "<="):
        metric, found, value = rule.partition(op)
        if found:
            metric = metric.strip()
            try:
                number = float(value)
            except ValueError:
                number = math.nan
            if metric and math.isfinite(number):
                return metric, op, number
    raise ConfigError("stop_when", rule, 'must be "METRIC>=VALUE" or "METRIC<=VALUE", e.g. "sft/answer_acc>=0.2"')


# ----------------------------------------------------------------------------------------------
# Building dataclasses from plain data, with the field path in every error.

SECTION_PRESETS: dict[type, dict[str, Any]] = {BAPOConfig: BAPO_PRESETS}
"""Sections that accept a `preset: NAME` key whose fields the other keys override."""


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


MOVED = {
    "rollout.max_new_tokens": "rollout.sampling.max_new_tokens",
    "rollout.temperature": "rollout.sampling.temperature",
    "rollout.top_p": "rollout.sampling.top_p",
    "rollout.top_k": "rollout.sampling.top_k",
    "rollout.token_budget": "rollout.partial.token_budget",
    "rollout.partial_mode": "rollout.partial.mode",
    "rollout.engine": "rollout.engines.kind",
    "rollout.engine_urls": "rollout.engines.urls",
    "rollout.engine_max_batch": "rollout.engines.max_batch",
    "rollout.servers": "rollout.engines.servers",
    "rollout.tensor_parallel": "rollout.engines.tensor_parallel",
    "rollout.host": "rollout.engines.host",
    "rollout.port": "rollout.engines.port",
    "rollout.colocate": "rollout.engines.colocate",
    "rollout.mem_fraction_static": "rollout.engines.mem_fraction_static",
    "rollout.admin_key_file": "rollout.engines.admin_key_file",
    "rollout.sglang_args": "rollout.engines.sglang_args",
    "rollout.request_timeout_s": "rollout.engines.request_timeout_s",
    "rollout.startup_timeout_s": "rollout.engines.startup_timeout_s",
    "rollout.sync_host": "rollout.sync.host",
    "rollout.sync_bucket_mb": "rollout.sync.bucket_mb",
    "rollout.sync_check_every": "rollout.sync.check_every",
    "rollout.sync_check_max_gap": "rollout.sync.check_max_gap",
}
"""Fields of an earlier layout and where they are now: a config that still names one is told where."""


def _unknown_key(path: str, key: str, valid: list[str]) -> ConfigError:
    dotted = f"{path}.{key}" if path else key
    if dotted in MOVED:
        return ConfigError(dotted, UNKNOWN_KEY, f"moved to {MOVED[dotted]}")
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(sorted(valid))}"
    return ConfigError(f"{path}.{key}" if path else key, UNKNOWN_KEY, hint)


def _coerce(value: Any, hint: Any, path: str) -> Any:
    """`value` as type `hint`, or ConfigError naming `path`."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return build(hint, value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _coerce(value, option, path)
            except ConfigError as err:
                errors.append(err.reason)
        raise ConfigError(path, value, " or ".join(errors))
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint_text = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(path, value, f"must be one of {list(args)}{hint_text}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, value, "must be a mapping")
        return {str(k): _coerce(v, args[1] if args else Any, f"{path}.{k}") for k, v in value.items()}
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            value = [value]
        if args and args[-1] is not Ellipsis:  # a fixed length: (low, high)
            if len(value) != len(args):
                raise ConfigError(path, value, f"must be {len(args)} values")
            return tuple(_coerce(v, item, f"{path}[{i}]") for i, (v, item) in enumerate(zip(value, args, strict=True)))
        item = args[0] if args else Any
        return tuple(_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value))
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, value, "must be true or false")
        return value
    if hint in (int, float) and isinstance(value, str):
        value = _number_from_text(value, hint, path)  # YAML 1.1 reads 1e-6 as text
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, value, "must be an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, value, "must be a number")
        if not math.isfinite(value):  # lr=inf, a NaN: no setting of this package means "unbounded" by inf
            raise ConfigError(path, value, "must be a finite number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(path, value, "must be a string")
        return value
    raise TypeError(f"config field {path} has a type the loader does not handle: {hint!r}")


def _number_from_text(text: str, hint: type, path: str) -> Any:
    try:
        number = float(text)
    except ValueError:
        return text  # reported below as not a number
    if hint is int:
        return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else text
    return number


def build(cls: type, data: Any, path: str = "") -> Any:
    """An instance of dataclass `cls` from a mapping, validated, errors naming dotted fields."""
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path or cls.__name__, data, f"must be a mapping of {cls.__name__} fields")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    data = dict(data)
    base: dict[str, Any] = {}
    presets = SECTION_PRESETS.get(cls)
    if presets is not None and "preset" in data:
        preset = data.pop("preset")
        if preset not in presets:
            raise ConfigError(f"{path}.preset" if path else "preset", preset, f"must be one of {sorted(presets)}")
        base = {name: getattr(presets[preset], name) for name in names}
    kwargs = dict(base)
    for key, value in data.items():
        if key not in names:
            raise _unknown_key(path, key, names + (["preset"] if presets else []))
        kwargs[key] = _coerce(value, hints[key], f"{path}.{key}" if path else key)
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.within(path) from None


def to_dict(obj: Any) -> Any:
    """Plain data (dicts, lists, scalars) of a config, loadable again by `build`."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    return obj


def _set_dotted(data: dict, dotted: str, value: Any, cls: type) -> None:
    """Set data[a][b][c] = value for 'a.b.c', checking each name against the dataclass fields; a
    mapping field takes one free key ('rollout.engines.sglang_args.x=1') or, when its values are
    sections, a key and a path into it ('eval.sets.aime24.path=...')."""
    keys = dotted.split(".")
    node, node_cls, path, i = data, cls, "", 0
    while True:
        key = keys[i]
        names = [f.name for f in dataclasses.fields(node_cls)]
        allowed = names + (["preset"] if node_cls in SECTION_PRESETS else [])
        if key not in allowed:
            raise _unknown_key(path, key, allowed)
        path = f"{path}.{key}" if path else key
        if i == len(keys) - 1:
            node[key] = value
            return
        hint = _hints(node_cls).get(key)
        mapping = typing.get_origin(hint) is dict
        sections = mapping and dataclasses.is_dataclass(typing.get_args(hint)[1])
        if not ((mapping and i == len(keys) - 2) or sections or (hint and dataclasses.is_dataclass(hint))):
            raise ConfigError(dotted, value, f"{path!r} is a value, not a section")
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict):
            raise ConfigError(path, child, "must be a mapping")
        if mapping and i == len(keys) - 2:  # one key into a free-form mapping (or a whole section)
            child[keys[-1]] = value
            return
        if sections:  # a named section of the mapping, then its fields
            name = keys[i + 1]
            entry = child.get(name)
            if entry is None:
                entry = child[name] = {}
            elif not isinstance(entry, dict):
                raise ConfigError(f"{path}.{name}", entry, "must be a mapping")
            node, node_cls, path, i = entry, typing.get_args(hint)[1], f"{path}.{name}", i + 2
            continue
        node, node_cls, i = child, hint, i + 1


def parse_override(text: str) -> tuple[str, Any]:
    """'a.b=value' -> ('a.b', value), the value read as YAML (0.4, true, null, [1, 2], text); a
    value that is not YAML (">=0.2") is its text."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError("override", text, "must look like section.field=value")
    try:
        return key.strip(), yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return key.strip(), raw.strip()


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """A JobConfig from an optional YAML file and dotted overrides applied on top."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("config", str(path), "no such file")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise ConfigError("config", str(path), f"not valid YAML: {' '.join(str(err).split())}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError("config", str(path), "the YAML file must hold a mapping at its top level")
        data = loaded or {}
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(data, key, value, JobConfig)
    return build(JobConfig, data)


def dump_config(config: JobConfig) -> str:
    """The resolved config as YAML (saved beside checkpoints and in logs)."""
    return yaml.safe_dump(to_dict(config), sort_keys=False)

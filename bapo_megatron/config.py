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

    def __post_init__(self) -> None:
        check(self.lr > 0, "lr", self.lr, "must be > 0")
        check(0 <= self.min_lr <= self.lr, "min_lr", self.min_lr, f"must lie in [0, lr={self.lr}]")
        check(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "must be >= 0")
        check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            check(0 <= getattr(self, name) < 1, name, getattr(self, name), "must lie in [0, 1)")
        check(self.adam_eps > 0, "adam_eps", self.adam_eps, "must be > 0")
        check(self.clip_grad >= 0, "clip_grad", self.clip_grad, "must be >= 0")


SGLANG_LAUNCHER_ARGS = {
    "model-path": "set to the model being trained",
    "host": "set from rollout.host",
    "port": "set from rollout.port + the server's index",
    "tp-size": "set from rollout.tensor_parallel",
    "dp-size": "always 1: one server per replica, as weight updates need",
    "base-gpu-id": "set from the server's index",
    "mem-fraction-static": "set from rollout.mem_fraction_static",
    "weight-version": "set to the policy version",
    "random-seed": "set from the job seed + the server's index",
    "skip-tokenizer-init": "always true: token ids in and out",
    "enable-memory-saver": "set from rollout.colocate",
    "enable-deterministic-inference": "set from rollout.deterministic (batch-invariant kernels)",
    "admin-api-key": "set from rollout.admin_key_file or $BAPO_ADMIN_API_KEY",
    "api-key": "never set: the rollout client sends only the admin key, so /generate would answer 401",
}
"""SGLang options that rollout/sglang_launcher.py derives from the config: never in sglang_args."""

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
class RolloutConfig:
    """Generation: the engine, sampling, and partial rollout."""

    engine: Literal["embedded", "sglang"] = "embedded"
    """"embedded": the CPU engine of this package; "sglang": SGLang servers."""
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    partial: bool = False
    """Cut responses at a per-step token budget and continue them later under newer weights."""
    token_budget: int | None = None
    """Partial rollout: new tokens per request (None: max_new_tokens, no cutting). A response cut
    there continues at once while fewer than prompts_per_step groups are complete, else next step
    under newer weights."""
    partial_mode: Literal["abort", "retract"] = "abort"
    """Partial rollout: "abort" cuts responses at the token budget and resubmits them next step;
    "retract" keeps requests inside the engines across weight updates (paused in retract mode,
    continued under the new weights), with no token budget."""
    max_staleness: int = 4
    """Drop and regenerate a sample whose oldest token is more than this many versions behind."""
    mask_stale_prefix: bool = False
    """Partial rollout: leave tokens sampled by older policy versions out of the loss."""
    oversample: float = 1.0
    """Keep this many times prompts_per_step groups in flight, so slow groups do not stall a step.
    With partial rollout, 2 to 3 keeps the engines busy (benchmarks/bench_rollout.py, 2 CPU cores:
    1.4-1.7x the trained tokens per second of full-length rollout at 2, 1.6-1.7x at 3)."""
    host: str = "127.0.0.1"
    """Interface the engines listen on; anything beyond loopback requires an admin key."""
    servers: int = 1
    """Engine servers (one per inference data-parallel replica)."""
    tensor_parallel: int = 1
    """Tensor-parallel size of each SGLang server."""
    request_timeout_s: float = 600.0
    port: int = 30000
    """First server port; server i listens on port + i."""
    mem_fraction_static: float | None = None
    """SGLang: fraction of GPU memory for weights and KV cache. None: 0.8 on GPUs of their own;
    colocated, what the trainer's resident memory (parameters, gradients, optimizer states:
    trainer/memory.py) leaves, less 10% of the GPU for SGLang's activations and CUDA graphs."""
    colocate: bool = False
    """SGLang shares the trainer's GPUs: memory saver on, weights pushed with update_weights_from_tensor."""
    admin_key_file: str | None = None
    """File holding the engines' admin key (else $BAPO_ADMIN_API_KEY; generated when the servers
    listen beyond loopback and none is given)."""
    sglang_args: dict[str, Any] = field(default_factory=dict)
    """SGLang: further server options by their command-line names, passed as given (for example
    {attention-backend: fa3, chunked-prefill-size: 8192, disable-decode-cuda-graph: true}).
    Underscores read as dashes; a None leaves the option at SGLang's default. The options the
    launcher sets from the fields above, and SGLang's deprecated ones, are refused here."""
    engine_urls: tuple[str, ...] = ()
    """Engines that are already running (another node, another job): the driver only connects to
    them (and starts none). Empty: the driver starts rollout.servers engines of rollout.engine."""
    deterministic: bool = False
    """One request order and per-request sampling seeds (from the job seed, the sample's id and its
    length so far), and batch-invariant engines (the embedded one runs each request alone; SGLang
    gets --enable-deterministic-inference): two runs, or a run and its resumption, generate the
    same samples with the same log-probs. Synchronous rounds instead of the asynchronous step, so
    slower; abort mode only."""
    sync_host: str | None = None
    """Address the engines reach this trainer's rank 0 at for the weight-update group (None:
    127.0.0.1 when the engines are local, else this host's name)."""
    sync_bucket_mb: int = 512
    """Weight sync: tensors travel in buckets of at most this many MiB."""
    sync_check_every: int = 0
    """Every this many steps (0: never), after the weight sync, the engine's log-probs of a fixed
    probe response are compared with the trainer's (sync/probe_logprob_gap)."""
    sync_check_max_gap: float = 1e-3
    """A probe gap above this stops the run with an error (a broken weight sync) instead of training
    on what the engines generate. Raise it for bf16/fp8 engines, whose kernels differ."""
    engine_max_batch: int = 64
    """Embedded engine: requests decoded together."""
    startup_timeout_s: float = 600.0
    """Seconds an engine may take to become ready (or an engine URL to answer)."""
    replay: str | None = None
    """Train from saved rollout batches instead of generating: a .safetensors file (used every
    step) or a directory of them (one per step, in name order, cycling)."""

    def __post_init__(self) -> None:
        for name in ("sync_bucket_mb", "engine_max_batch"):
            check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        check(self.sync_check_every >= 0, "sync_check_every", self.sync_check_every, "must be >= 0")
        check(self.sync_check_max_gap > 0, "sync_check_max_gap", self.sync_check_max_gap, "must be > 0")
        check(self.startup_timeout_s > 0, "startup_timeout_s", self.startup_timeout_s, "must be > 0")
        for i, url in enumerate(self.engine_urls):
            check(url.startswith(("http://", "https://")), f"engine_urls[{i}]", url, "must be an http(s):// URL")
        if self.deterministic:
            check(
                self.partial_mode == "abort",
                "deterministic",
                self.deterministic,
                "needs partial_mode=abort (in retract mode the engines decide when a request continues)",
            )
        for name in ("prompts_per_step", "samples_per_prompt", "max_new_tokens", "servers", "tensor_parallel"):
            check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        check(self.temperature > 0, "temperature", self.temperature, "must be > 0")
        check(0 < self.top_p <= 1, "top_p", self.top_p, "must lie in (0, 1]")
        check(self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k, "must be -1 (off) or >= 1")
        if self.token_budget is not None:
            check(self.partial, "token_budget", self.token_budget, "only applies with partial=true")
            check(
                1 <= self.token_budget <= self.max_new_tokens,
                "token_budget",
                self.token_budget,
                f"must lie in [1, max_new_tokens={self.max_new_tokens}]",
            )
        check(self.max_staleness >= 0, "max_staleness", self.max_staleness, "must be >= 0")
        if self.partial_mode == "retract":
            check(self.partial, "partial_mode", self.partial_mode, "needs partial=true")
            check(
                self.token_budget is None,
                "token_budget",
                self.token_budget,
                "does not apply with partial_mode=retract (requests are never cut)",
            )
        if self.partial and self.token_budget is not None:
            reach = self.token_budget * (self.max_staleness + 1)
            check(
                reach >= self.max_new_tokens,
                "token_budget",
                self.token_budget,
                f"x (max_staleness + 1) = {reach} tokens is all a response can get before it is stale; "
                f"it must reach max_new_tokens={self.max_new_tokens}, or long responses never finish",
            )
        check(self.oversample >= 1.0, "oversample", self.oversample, "must be >= 1")
        check(self.request_timeout_s > 0, "request_timeout_s", self.request_timeout_s, "must be > 0")
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
class DataConfig:
    """Prompts: a jsonl or parquet file and which fields hold what; None: the synthetic task."""

    path: str | None = None
    """Prompts, one record each (needed unless rollout.replay is set)."""
    format: Literal["jsonl", "parquet"] = "jsonl"
    prompt_field: str = "prompt"
    """The record's prompt: text (tokenised with the model directory's tokenizer) or token ids."""
    answer_field: str = "answer"
    """The record's reference answer, handed to the reward as record["answer"]."""
    shuffle: bool = True
    seed: int = 0
    reward: str = "math"
    """"math" (math-verify on the last \\boxed answer), "exact" (the text, stripped), "exact_ids",
    or a function of yours, "pkg.module:fn" or "path/to/file.py:fn", called as
    fn(text, ids, record) -> float. A call that fails scores 0 and is counted (rollout/reward_errors)."""
    reward_workers: int = 1
    """Processes scoring responses beside generation."""
    chat_template: bool = False
    """Wrap each text prompt in the tokenizer's chat template (one user turn, generation prompt)."""

    def __post_init__(self) -> None:
        check(self.reward_workers >= 1, "reward_workers", self.reward_workers, "must be >= 1")


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
    """k of avg@k (mean correctness of k samples at rollout.temperature) and pass@k (any of k correct)."""
    greedy: bool = True
    """Also one greedy answer a prompt: eval/greedy_acc."""
    max_prompts: int | None = None
    """Evaluate on the first this many records (None: all)."""

    def __post_init__(self) -> None:
        check(self.interval >= 0, "interval", self.interval, "must be >= 0")
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


def _unknown_key(path: str, key: str, valid: list[str]) -> ConfigError:
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
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    return obj


def _set_dotted(data: dict, dotted: str, value: Any, cls: type) -> None:
    """Set data[a][b][c] = value for 'a.b.c', checking each name against the dataclass fields."""
    keys = dotted.split(".")
    node, node_cls, path = data, cls, ""
    for i, key in enumerate(keys):
        names = [f.name for f in dataclasses.fields(node_cls)]
        allowed = names + (["preset"] if node_cls in SECTION_PRESETS else [])
        if key not in allowed:
            raise _unknown_key(path, key, allowed)
        path = f"{path}.{key}" if path else key
        if i == len(keys) - 1:
            node[key] = value
            return
        hint = _hints(node_cls).get(key)
        into_mapping = typing.get_origin(hint) is dict and i == len(keys) - 2  # one key into a free-form mapping
        if not (into_mapping or (hint and dataclasses.is_dataclass(hint))):
            raise ConfigError(dotted, value, f"{path!r} is a value, not a section")
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict):
            raise ConfigError(path, child, "must be a mapping")
        if into_mapping:
            child[keys[-1]] = value
            return
        node, node_cls = child, hint


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

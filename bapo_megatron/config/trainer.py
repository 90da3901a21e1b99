"""The trainer's sections: the RL algorithm, the policy network, the parallel layout, the optimizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from bapo_megatron.algo.advantages import AdvantageConfig
from bapo_megatron.algo.losses import PolicyLossConfig
from bapo_megatron.config.lora import LoRAConfig
from bapo_megatron.errors import check


@dataclass(frozen=True, kw_only=True)
class AlgoConfig(PolicyLossConfig):
    """The RL algorithm: the policy loss and its parameters (BAPO or a baseline), advantages."""

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    updates_per_batch: int = 1
    """Optimizer steps taken on one rollout batch (the batch is split into this many mini-batches)."""
    routing_replay: bool = False
    """Rollout routing replay (R3), for mixture-of-experts models: the engines return the experts
    they routed every position to, and the trainer's routers take those instead of choosing
    their own, in every forward pass of the step (the prepass and every update). A sample without
    recorded routes (e.g. a replayed batch file from before) routes as the trainer chooses."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.updates_per_batch >= 1, "updates_per_batch", self.updates_per_batch, "must be >= 1")


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """model.moe: how the trainer runs a mixture-of-experts model's routers and experts, with the
    defaults RL stacks run (a dense model ignores it). Tokens reach experts on other expert-parallel
    ranks through Megatron's alltoall dispatcher (its allgather one refuses micro-batches of varying
    lengths in megatron-core 0.16.1)."""

    router_dtype: Literal["fp32", "fp64"] = "fp32"
    """The router's logits and softmax in fp32 (or fp64) whatever the parameters' precision: routing
    decisions close to a tie flip otherwise between the engine and the trainer."""
    aux_loss_coeff: float = 0.0
    """The auxiliary load-balancing loss (0: off). Off by default: in GRPO it made the trainer's
    log-probs drift from the engine's (NeMo-RL's finding); the policy loss alone shapes the router."""
    freeze_router: bool = False
    """The routers' weights are not trained (no gradient, no optimizer state)."""
    grouped_gemm: bool | None = None
    """All of a rank's experts in one grouped GEMM (Transformer Engine's); None: where Transformer
    Engine is the layer implementation, else one expert after another (the CPU)."""

    def __post_init__(self) -> None:
        check(self.aux_loss_coeff >= 0, "aux_loss_coeff", self.aux_loss_coeff, "must be >= 0")


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
    """Parameters and compute: "fp32" (the CPU), "bf16" or "fp8" (a CUDA GPU; fp8 with Transformer
    Engine, its matrix multiplies in fp8 and the rest in bf16)."""
    fp8_format: Literal["hybrid", "e4m3"] = "hybrid"
    """Under fp8: "hybrid" (e4m3 forward, e5m2 gradients) or "e4m3" for both."""
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
    moe: MoEConfig = field(default_factory=MoEConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        check(
            not (self.lora.enabled and self.transformer_impl == "transformer_engine"),
            "lora.rank",
            self.lora.rank,
            "LoRA is built on the local layer spec only so far; set transformer_impl='local'",
        )
        check(self.logprob_memory_mb >= 1, "logprob_memory_mb", self.logprob_memory_mb, "must be >= 1")
        check(
            self.make_vocab_size_divisible_by >= 1,
            "make_vocab_size_divisible_by",
            self.make_vocab_size_divisible_by,
            "must be >= 1",
        )
        check(self.vocab_pad_tp >= 1, "vocab_pad_tp", self.vocab_pad_tp, "must be >= 1")
        check(
            not (self.moe.grouped_gemm and self.transformer_impl != "transformer_engine"),
            "moe.grouped_gemm",
            self.moe.grouped_gemm,
            "needs transformer_impl='transformer_engine' (the grouped GEMM is Transformer Engine's)",
        )
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
    """Tensor parallel: each layer's weights are split over this many ranks."""
    pipeline: int = 1
    """Pipeline parallel: the layers are split into this many stages, one a rank."""
    expert: int = 1
    """Expert parallel: each MoE layer's experts are split over this many ranks (expert tensor
    parallel is 1: an expert is never split). The expert-parallel ranks are consecutive data- and
    tensor-parallel ranks of one pipeline stage; it must divide tensor x data parallel."""
    context: int = 1
    """Context parallel: not supported yet (1). Megatron does not split sequences itself: each CP
    rank must be fed its 2 x CP load-balanced chunks, with TE attention on two GPUs or more; until
    that exists, a value above 1 is refused before anything starts (trainer/memory/fit.py, where the refusal
    can name the longest response the layout fits without it) rather than silently training on
    wrong positions and attention."""
    virtual_pipeline: int | None = None
    """Interleaved pipeline: model chunks per pipeline rank (None: not interleaved)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism: the activations that tensor parallelism replicates (norms,
    dropout, residual) are split along the sequence over the tensor-parallel ranks (needs tensor >=
    2): less activation memory, the same compute."""
    recompute: Literal["none", "selective", "full", "auto"] = "none"
    """Activation recompute: "auto" is the least of the others whose estimated peak memory fits the
    GPU (trainer/memory/fit.py: none, selective, then full over 1, 2, ... layers), resolved before anything
    is built ("none" without a GPU); the dry run says what it chose and why. "selective" keeps
    every layer's activations but core attention's
    (recomputed in the backward pass, as Megatron's selective recompute does); "full" keeps only the
    inputs of `recompute_layers` layers of each pipeline stage and runs them again in the backward
    pass (Megatron's block method): the least memory, about one more forward's compute. Full
    recompute reruns the routers too; with algo.routing_replay each rerun replays the routes of the
    micro-batch being backpropagated (trainer/routing.py)."""
    recompute_layers: int | None = None
    """With recompute "full": how many layers of each pipeline stage (virtual stage) are recomputed,
    the first ones; None: all of them."""
    over_memory: bool = False
    """Go on when the memory estimate (trainer/memory/estimate.py) puts the peak over the GPU: by default the
    run and the dry run refuse it ("does not fit", with what would fit); true runs it anyway, with
    a warning (recompute "auto" then takes the most recompute there is). For an estimate you have
    measured to be too high."""
    max_tokens_per_microbatch: int = 4096
    """Micro-batches are filled by token count (length-sorted), up to this many tokens each."""
    packing: Literal["auto", "padded", "packed"] = "auto"
    """How samples make micro-batches. "padded": rows of one sample each, right-padded to the
    micro-batch's longest (samples x longest <= max_tokens_per_microbatch; under a virtual pipeline
    every micro-batch padded to the step's largest, as its schedule needs one shape). "packed":
    each micro-batch one row of samples laid end to end, at most max_tokens_per_microbatch tokens,
    attention kept inside each sample (Transformer Engine's THD with cu_seqlens on GPU; a
    block-diagonal causal mask with the local implementation, whose attention then costs the whole
    row squared); under a virtual pipeline a rank's rows share one length. "auto": packed with
    Transformer Engine or a virtual pipeline, padded otherwise. perf/packing_efficiency reports
    the share of computed tokens that are real."""

    def __post_init__(self) -> None:
        for name in ("tensor", "pipeline", "expert", "context", "max_tokens_per_microbatch"):
            check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        if self.virtual_pipeline is not None:
            check(
                self.virtual_pipeline >= 2 and self.pipeline >= 2,
                "virtual_pipeline",
                self.virtual_pipeline,
                "needs pipeline >= 2 and at least 2 chunks per rank",
            )
        if self.sequence_parallel:
            check(self.tensor >= 2, "sequence_parallel", self.sequence_parallel, "needs tensor >= 2")
        if self.recompute_layers is not None:
            check(self.recompute == "full", "recompute_layers", self.recompute_layers, 'needs recompute="full"')
            check(self.recompute_layers >= 1, "recompute_layers", self.recompute_layers, "must be >= 1")

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel size for `world_size` processes; ConfigError if they do not divide."""
        model = self.tensor * self.pipeline * self.context
        check(
            world_size % model == 0,
            "parallel",
            f"tensor*pipeline*context={model}",
            f"does not divide the world size {world_size}",
        )
        data = world_size // model
        check(
            (self.tensor * data * self.context) % self.expert == 0,
            "parallel.expert",
            self.expert,
            f"must divide tensor x data parallel ({self.tensor} x {data}): the expert-parallel ranks "
            "of a pipeline stage are among its tensor- and data-parallel ranks",
        )
        return data


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Adam with linear warmup and an optional decay, gradient clipping."""

    lr: float = 1e-6
    """The learning rate after warmup (the peak)."""
    min_lr: float = 0.0
    """Where lr_decay ends at the last step."""
    warmup_steps: int = 0
    """Optimizer steps over which the learning rate rises linearly from 0 to lr (0: none)."""
    weight_decay: float = 0.0
    """Adam's decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    """Adam's decay rate of the gradient's running mean."""
    adam_beta2: float = 0.999
    """Adam's decay rate of the squared gradient's running mean."""
    adam_eps: float = 1e-8
    """Added to the denominator of Adam's update."""
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

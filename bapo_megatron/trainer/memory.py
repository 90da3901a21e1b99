"""Per-GPU memory of a trainer rank, estimated from the model's shape and the job's layout.

No model is built: this runs at config time (the colocated SGLang servers' static memory, a
dry run). Parameters are counted exactly per tensor- and expert-parallel rank of each pipeline
stage (tests compare with Megatron's own model); the rest follows Megatron's storage:
  - gradients: DDP's fp32 buffer (grad_reduce_in_fp32), one per trained parameter;
  - Adam: exp_avg and exp_avg_sq in fp32, plus fp32 main parameters when the parameters are
    bf16 (fp8 keeps bf16 parameters); the distributed optimizer splits them over data parallel,
    the experts' over expert data parallel (the TP x DP / EP ranks of a stage holding the same
    experts: world / (EP x PP));
  - activations (an estimate): what one micro-batch keeps for backward per layer (inputs of the
    norms and linears, q/k/v and the normalised q/k, the attention output, the MLP's gate/up and
    SwiGLU output, flash attention's softmax statistics aside), in the parameters' dtype, divided
    by TP where the tensor is split (and the rest too under sequence parallel); the first stage of
    a 1F1B pipeline holds PP micro-batches at once; plus the last stage's logits and their
    gradient, and the log-prob temporaries (model.logprob_memory_mb).

Mixture-of-experts layers (expert tensor parallel 1, Megatron's alltoall dispatcher): attention,
norms and the router are held as in a dense layer (the router whole on every TP rank), the
experts split over EP only (each EP rank holds num_experts / EP whole experts). A rank routes its
own tokens (its sequence-parallel share at TP > 1), each to top_k experts; the estimate assumes
routing spread evenly over the EP ranks, so that a rank receives, on average, top_k copies of as
many tokens as it sent (a rank holding a popular expert receives more). Per token it keeps
top_k x (the permuted token the all-to-all delivered, the first linear's gate and up, the SwiGLU
output), the router's logits and scores and the top_k probabilities (in model.moe.router_dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

from bapo_megatron.common.model_spec import ModelSpec, padded_vocab_size
from bapo_megatron.config import JobConfig, ModelConfig, ParallelConfig

PARAM_BYTES = {"fp32": 4, "bf16": 2, "fp8": 2}
ROUTER_BYTES = {"fp32": 4, "fp64": 8}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one GPU of the trainer (its most loaded pipeline stage)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    experts: int = 0
    """Of the resident bytes: the experts' parameters, gradients and optimizer state."""

    @property
    def resident(self) -> int:
        """What stays on the GPU between steps (while a colocated engine generates)."""
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        return self.resident + self.activations


@dataclass(frozen=True)
class LayerParams:
    """One transformer layer's parameters, by how a layout splits them."""

    tensor: int
    """Split over TP: the q/k/v/o projections (and q/k/v biases), a dense MLP."""
    replicated: int
    """Whole on every TP rank: the two norms, the q/k norms."""
    router: int
    """Whole on every TP rank: a MoE layer's router."""
    experts: int
    """All of a MoE layer's experts (split over EP, each expert whole)."""


@dataclass(frozen=True)
class RankParams:
    """The parameters one rank holds, by the group over which the optimizer shards their state."""

    dense: int
    """Sharded over data parallel: everything but the experts (the routers included)."""
    experts: int
    """Sharded over expert data parallel."""
    router: int
    """Of `dense`: the routers (no gradient, no optimizer state under model.moe.freeze_router)."""

    @property
    def total(self) -> int:
        return self.dense + self.experts


def layer_params(spec: ModelSpec, layer: int) -> LayerParams:
    """The parameters of 0-based layer `layer`."""
    d, hd = spec.hidden_size, spec.head_dim
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * hd
    attention = d * qkv + (qkv if spec.qkv_bias else 0) + spec.num_heads * hd * d
    norms = 2 * d + (2 * hd if spec.qk_norm else 0)  # a q/k norm is one head_dim vector each
    if not spec.is_moe_layer(layer):
        return LayerParams(tensor=attention + 3 * d * spec.ffn_hidden_size, replicated=norms, router=0, experts=0)
    moe = spec.moe
    return LayerParams(
        tensor=attention,
        replicated=norms,
        router=moe.num_experts * d,
        experts=moe.num_experts * 3 * d * moe.ffn_hidden_size,
    )


def stage_layers(num_layers: int, pipeline: int, stage: int, virtual: int | None = None) -> list[int]:
    """The 0-based layers pipeline rank `stage` builds: Megatron's even split, one run of layers
    per virtual stage (chunk c of rank s starts at c x L / VPP + s x L / (PP x VPP))."""
    chunks = virtual or 1
    size = num_layers // (pipeline * chunks)
    return [c * num_layers // chunks + stage * size + i for c in range(chunks) for i in range(size)]


def rank_params(
    spec: ModelSpec,
    padded_vocab: int,
    tp: int,
    pp: int,
    stage: int,
    *,
    expert: int = 1,
    virtual: int | None = None,
) -> RankParams:
    """Parameters one tensor- and expert-parallel rank of pipeline `stage` holds."""
    d = spec.hidden_size
    layers = [layer_params(spec, i) for i in stage_layers(spec.num_layers, pp, stage, virtual)]
    dense = sum(p.tensor // tp + p.replicated + p.router for p in layers)
    embedding = padded_vocab * d // tp
    if stage == 0:
        dense += embedding
    if stage == pp - 1:
        dense += d  # final norm
        if not spec.tie_embeddings or pp > 1:  # tied across stages: the last keeps its own copy
            dense += embedding
    return RankParams(
        dense=dense, experts=sum(p.experts for p in layers) // expert, router=sum(p.router for p in layers)
    )


def stage_params(
    spec: ModelSpec,
    padded_vocab: int,
    tp: int,
    pp: int,
    stage: int,
    *,
    expert: int = 1,
    virtual: int | None = None,
) -> int:
    """All the parameters one rank of pipeline `stage` holds (norms and routers are replicated)."""
    return rank_params(spec, padded_vocab, tp, pp, stage, expert=expert, virtual=virtual).total


def layer_activation_bytes(spec: ModelSpec, model: ModelConfig, parallel: ParallelConfig, layer: int) -> int:
    """What layer `layer` keeps for backward per token of a micro-batch, on one rank."""
    d, hd, tp, experts = spec.hidden_size, spec.head_dim, parallel.tensor, spec.is_moe_layer(layer)
    width = PARAM_BYTES[model.precision]
    split = (spec.num_heads + 2 * spec.num_kv_heads) * hd + 2 * spec.num_heads * hd
    if spec.qk_norm:
        split += (spec.num_heads + spec.num_kv_heads) * hd  # the normalised q and k
    if not experts:
        split += 3 * spec.ffn_hidden_size
    unsplit = 4 * d  # two norm inputs, two residuals
    per_token = width * (split // tp + (unsplit // tp if parallel.sequence_parallel else unsplit))
    if experts:  # at TP > 1 always under sequence parallel: each rank routes its share of the tokens
        per_token += moe_token_bytes(spec, model) // tp
    return per_token


def moe_token_bytes(spec: ModelSpec, model: ModelConfig) -> int:
    """What one token routed through a MoE layer leaves for backward, on average over the EP ranks:
    top_k x (permuted token, gate and up, SwiGLU output), and the router's logits, scores and top-k
    probabilities."""
    moe = spec.moe
    routed = moe.top_k * (spec.hidden_size + 3 * moe.ffn_hidden_size) * PARAM_BYTES[model.precision]
    return routed + ROUTER_BYTES[model.moe.router_dtype] * (2 * moe.num_experts + moe.top_k)


def recomputed_layers(spec: ModelSpec, parallel: ParallelConfig, stage: int) -> list[int]:
    """The layers of pipeline rank `stage` that full recompute reruns: the first recompute_layers of
    each (virtual) stage, Megatron's block method. Selective recompute reruns core attention only,
    whose own activations (flash attention's) the estimate does not count: it changes nothing here."""
    if parallel.recompute != "full":
        return []
    layers = stage_layers(spec.num_layers, parallel.pipeline, stage, parallel.virtual_pipeline)
    size = len(layers) // (parallel.virtual_pipeline or 1)
    keep = parallel.recompute_layers or size
    return [layer for c in range(0, len(layers), size) for layer in layers[c : c + keep]]


def activation_bytes(spec: ModelSpec, model: ModelConfig, parallel: ParallelConfig, tokens: int, stage: int) -> int:
    """What stage `stage` keeps for backward while running one micro-batch of `tokens` tokens; a
    recomputed layer keeps its input only, and one of them is rebuilt whole at a time in backward."""
    layers = stage_layers(spec.num_layers, parallel.pipeline, stage, parallel.virtual_pipeline)
    rerun = set(recomputed_layers(spec, parallel, stage))
    split = parallel.tensor if parallel.sequence_parallel else 1
    layer_input = PARAM_BYTES[model.precision] * spec.hidden_size // split
    per_token = sum(layer_input if i in rerun else layer_activation_bytes(spec, model, parallel, i) for i in layers)
    in_flight = parallel.pipeline - stage  # 1F1B: stage s holds PP - s micro-batches
    total = per_token * tokens * in_flight
    if rerun:
        total += max(layer_activation_bytes(spec, model, parallel, i) for i in rerun) * tokens
    if stage == parallel.pipeline - 1:
        vocab = padded_vocab_size(
            spec.vocab_size, model.make_vocab_size_divisible_by, parallel.tensor, model.vocab_pad_tp
        )
        total += tokens * vocab // parallel.tensor * (PARAM_BYTES[model.precision] + 4)  # logits, fp32 gradient
        total += model.logprob_memory_mb << 20
    return total


def trainer_memory(
    spec: ModelSpec,
    model: ModelConfig,
    parallel: ParallelConfig,
    data_parallel: int,
    distributed_optimizer: bool = True,
) -> MemoryEstimate:
    """The estimate for the most loaded pipeline stage, with micro-batches of
    parallel.max_tokens_per_microbatch tokens."""
    vocab = padded_vocab_size(spec.vocab_size, model.make_vocab_size_divisible_by, parallel.tensor, model.vocab_pad_tp)
    return max(
        (
            _stage_memory(spec, model, parallel, vocab, data_parallel, distributed_optimizer, s)
            for s in range(parallel.pipeline)
        ),
        key=lambda e: e.peak,
    )


def _stage_memory(
    spec: ModelSpec,
    model: ModelConfig,
    parallel: ParallelConfig,
    vocab: int,
    data_parallel: int,
    distributed_optimizer: bool,
    stage: int,
) -> MemoryEstimate:
    """One pipeline stage's estimate (`vocab`: the padded vocabulary)."""
    width = PARAM_BYTES[model.precision]
    per_param = 8 + (4 if width < 4 else 0)  # Adam's moments, and fp32 main parameters under bf16/fp8
    expert_data_parallel = parallel.tensor * data_parallel // parallel.expert
    shards, expert_shards = (data_parallel, expert_data_parallel) if distributed_optimizer else (1, 1)
    n = rank_params(
        spec,
        vocab,
        parallel.tensor,
        parallel.pipeline,
        stage,
        expert=parallel.expert,
        virtual=parallel.virtual_pipeline,
    )
    dense_trained = n.dense - (n.router if model.moe.freeze_router else 0)
    experts_optimizer = n.experts * per_param // expert_shards
    return MemoryEstimate(
        params=n.total * width,
        grads=(dense_trained + n.experts) * 4,
        optimizer=dense_trained * per_param // shards + experts_optimizer,
        activations=activation_bytes(spec, model, parallel, parallel.max_tokens_per_microbatch, stage),
        experts=n.experts * (width + 4) + experts_optimizer,
    )


def routing_replay_bytes(spec: ModelSpec, tokens: int) -> int:
    """The routes `tokens` tokens took, as routing replay (R3) stores them: in every MoE layer, the
    top_k expert indices of each token, one byte each while the experts number at most 256, else two."""
    if spec.moe is None:
        return 0
    index = 1 if spec.moe.num_experts <= 256 else 2
    return len(spec.moe.sparse_layers) * spec.moe.top_k * index * tokens


def colocated_mem_fraction(gpu_bytes: int, trainer: MemoryEstimate, reserve: float = 0.1) -> float:
    """SGLang's mem_fraction_static for a server sharing GPUs with the trainer: what the trainer's
    resident state leaves, less `reserve` of the GPU for SGLang's activations and CUDA graphs.
    (Its weights and KV cache are released while the trainer runs, so the trainer's activations
    need no room here.) ValueError, naming the sizes, when too little is left to serve."""
    fraction = (gpu_bytes - trainer.resident) / gpu_bytes - reserve
    if fraction < 0.1:
        raise ValueError(
            f"colocated: the trainer keeps {trainer.resident / 2**30:.1f} GiB per GPU (parameters, gradients, "
            f"optimizer) of {gpu_bytes / 2**30:.1f} GiB, leaving SGLang {max(fraction, 0.0):.0%}; use more "
            "GPUs (tensor/pipeline/data parallel), or run the engines on GPUs of their own "
            "(rollout.engines.colocate=false)"
        )
    return round(fraction, 3)


def rollout_mem_fraction(job: JobConfig, spec: ModelSpec, gpu_bytes: int, data_parallel: int) -> float:
    """What a colocated SGLang server may take of a GPU of gpu_bytes beside a trainer rank of `job`
    (GPU runs use Megatron's distributed optimizer)."""
    estimate = trainer_memory(spec, job.model, job.parallel, data_parallel, distributed_optimizer=True)
    return colocated_mem_fraction(gpu_bytes, estimate)

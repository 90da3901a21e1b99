"""Per-GPU memory of a trainer rank, estimated from the model's shape and the job's layout.

No model is built: this runs at config time (the colocated SGLang servers' static memory, a
dry run). Parameters are counted exactly per tensor- and expert-parallel rank of each pipeline
stage (tests compare with Megatron's own model); the rest follows Megatron's storage:
  - gradients: DDP's fp32 buffer (grad_reduce_in_fp32), one per trained parameter (with LoRA, the
    adapters alone: model.lora, models/lora.py counts them; the base keeps its parameters only);
  - Adam: exp_avg and exp_avg_sq in fp32, plus fp32 main parameters when the parameters are
    bf16 (fp8 keeps bf16 parameters); the distributed optimizer splits them over data parallel,
    the experts' over expert data parallel (the TP x DP / EP ranks of a stage holding the same
    experts: world / (EP x PP));
  - activations (an estimate): what one micro-batch keeps for backward per layer (inputs of the
    norms and linears, q/k/v and the normalised q/k, the attention output, the MLP's gate/up and
    SwiGLU output, flash attention's softmax statistics aside), in the parameters' dtype, divided
    by TP where the tensor is split (and the rest too under sequence parallel), and with LoRA what
    its adapters keep (trainer/memory/adapters.py: the rank-r intermediates, and under sequence
    parallel the inputs gathered for the q/k/v and gate/up adapters); the first stage of
    a 1F1B pipeline holds PP micro-batches at once; plus the last stage's logits and their
    gradient, and the log-prob temporaries (model.logprob_memory_mb);
  - activations with the local implementation (model.transformer_impl "local", the CPU's: no
    fusion but torch's fused attention kernel), local_activation_bytes: what its ops keep per token,
    a packed row's mask, [heads, tokens, tokens] probabilities where Megatron's own softmax runs
    (gpt-oss), and the peak of the phase that needs most (the loss's backward, or a core
    attention's); measured on CPU (probe.py, benchmarks/bench_memory.py;
    tests/dist/test_memory_measured.py holds it to 20%).

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
from fractions import Fraction

from bapo_megatron.config import JobConfig, ModelConfig, ParallelConfig
from bapo_megatron.models import family_of
from bapo_megatron.models.lora import adapter_params
from bapo_megatron.models.spec import ModelSpec
from bapo_megatron.trainer.megatron_config import padded_vocab
from bapo_megatron.trainer.memory.adapters import adapter_token_bytes
from bapo_megatron.trainer.packing import packs

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
    reference: int = 0
    """The KL loss's frozen reference model (algo.kl_coef > 0): the stage's parameters once more; 0
    under LoRA, whose reference is the base with the adapters off (trainer/reference.py)."""

    @property
    def resident(self) -> int:
        """What stays on the GPU between steps (while a colocated engine generates)."""
        return self.params + self.grads + self.optimizer + self.reference

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
    return LayerParams(**family_of(spec).layer_params(spec, layer))


def stage_layers(num_layers: int, pipeline: int, stage: int, virtual: int | None = None) -> list[int]:
    """The 0-based layers pipeline rank `stage` builds: Megatron's even split, one run of layers
    per virtual stage (chunk c of rank s starts at c x L / VPP + s x L / (PP x VPP))."""
    chunks = virtual or 1
    size = num_layers // (pipeline * chunks)
    return [c * num_layers // chunks + stage * size + i for c in range(chunks) for i in range(size)]


def rank_params(
    spec: ModelSpec,
    vocab: int,
    tp: int,
    pp: int,
    stage: int,
    *,
    expert: int = 1,
    virtual: int | None = None,
) -> RankParams:
    """Parameters one tensor- and expert-parallel rank of pipeline `stage` holds (`vocab`: the
    embedding's rows, padding included)."""
    d = spec.hidden_size
    layers = [layer_params(spec, i) for i in stage_layers(spec.num_layers, pp, stage, virtual)]
    dense = sum(p.tensor // tp + p.replicated + p.router for p in layers)
    embedding = vocab * d // tp
    if stage == 0:
        dense += embedding
    if stage == pp - 1:
        dense += d  # final norm
        if not spec.tie_embeddings or pp > 1:  # tied across stages: the last keeps its own copy
            dense += embedding
    return RankParams(
        dense=dense, experts=sum(p.experts for p in layers) // expert, router=sum(p.router for p in layers)
    )


def stage_params(spec: ModelSpec, vocab: int, tp: int, pp: int, stage: int, **layout: int | None) -> int:
    """All the parameters one rank of pipeline `stage` holds (norms and routers are replicated):
    rank_params's total, with its `expert` and `virtual`."""
    return rank_params(spec, vocab, tp, pp, stage, **layout).total


def layer_activation_bytes(spec: ModelSpec, model: ModelConfig, parallel: ParallelConfig, layer: int) -> int:
    """What layer `layer` keeps for backward per token of a micro-batch, on one rank: its attention's
    (the family's answer, Family.attention_memory), the MLP's, two norm inputs and two residuals, and
    its LoRA adapters'."""
    d, tp, family = spec.hidden_size, parallel.tensor, family_of(spec)
    experts, width = family.routed(spec, layer), PARAM_BYTES[model.precision]
    attention = family.attention_memory(spec, layer, local=False, selective=parallel.recompute == "selective")
    # a dense MLP, or a MoE layer's shared expert (as dense, split over TP; width 0 without one)
    split = attention.split + 3 * (spec.moe.shared_ffn_hidden_size if experts else spec.ffn_hidden_size)
    unsplit = 4 * d + attention.sequence
    per_token = width * (split // tp + (unsplit // tp if parallel.sequence_parallel else unsplit))
    per_token += 4 * attention.fp32 // tp
    if experts:  # at TP > 1 always under sequence parallel: each rank routes its share of the tokens
        per_token += moe_token_bytes(spec, model) // tp
    return per_token + adapter_token_bytes(spec, model.lora, parallel, layer, width, local=False)


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
    whose own activations (flash attention's) the estimate does not count: it changes nothing here
    but for the local implementation, whose attention keeps its probabilities (local_layer_bytes)."""
    if parallel.recompute != "full":
        return []
    layers = stage_layers(spec.num_layers, parallel.pipeline, stage, parallel.virtual_pipeline)
    size = len(layers) // (parallel.virtual_pipeline or 1)
    keep = parallel.recompute_layers or size
    return [layer for c in range(0, len(layers), size) for layer in layers[c : c + keep]]


def micro_batches_in_flight(parallel: ParallelConfig, stage: int) -> Fraction:
    """The micro-batches whose activations pipeline rank `stage` holds at its peak, counted in whole
    micro-batches through all its layers. 1F1B: PP - s. Interleaved (parallel.virtual_pipeline):
    Megatron-Core 0.16.1's warm-up (schedules.get_pp_rank_microbatches) runs 2 (PP - s - 1) +
    (VPP - 1) x PP chunk forwards (microbatch_group_size_per_vp_stage defaults to PP) before the
    first backward, and one more runs beside it; each holds one chunk, 1 / VPP of the rank's layers:
    PP + (PP - 1) / VPP on the first stage."""
    vpp = parallel.virtual_pipeline
    if not vpp:
        return Fraction(parallel.pipeline - stage)
    return Fraction(2 * (parallel.pipeline - stage - 1) + (vpp - 1) * parallel.pipeline + 1, vpp)


def activation_bytes(spec: ModelSpec, model: ModelConfig, parallel: ParallelConfig, tokens: int, stage: int) -> int:
    """What stage `stage` keeps for backward while running one micro-batch of `tokens` tokens; a
    recomputed layer keeps its input only, and one of them is rebuilt whole at a time in backward."""
    if model.transformer_impl == "local":
        return local_activation_bytes(spec, model, parallel, tokens, stage)
    layers = stage_layers(spec.num_layers, parallel.pipeline, stage, parallel.virtual_pipeline)
    rerun = set(recomputed_layers(spec, parallel, stage))
    split = parallel.tensor if parallel.sequence_parallel else 1
    layer_input = PARAM_BYTES[model.precision] * spec.hidden_size // split
    per_token = sum(layer_input if i in rerun else layer_activation_bytes(spec, model, parallel, i) for i in layers)
    in_flight = micro_batches_in_flight(parallel, stage)  # 1F1B: PP - s; interleaved: more
    total = int(per_token * tokens * in_flight)
    if rerun:
        total += max(layer_activation_bytes(spec, model, parallel, i) for i in rerun) * tokens
    if stage == parallel.pipeline - 1:
        logits = tokens * padded_vocab(spec, model, parallel) // parallel.tensor
        total += logits * (PARAM_BYTES[model.precision] + 4)  # the logits and their fp32 gradient
        total += model.logprob_memory_mb << 20
    return total


def local_layer_bytes(spec: ModelSpec, model: ModelConfig, parallel: ParallelConfig, layer: int) -> int:
    """What layer `layer` of the local implementation keeps for backward per token, on one rank, its
    [tokens x tokens] attention aside (local_score_bytes). Unfused, op by op, it keeps more than the
    fused layers (measured, layer by layer, on CPU):
      - per norm (input and pre-MLP) x * rsqrt and the output, and the two residual sums: 6 x hidden;
      - the attention's, as its family counts it (Family.attention_memory: grouped-query attention's
        q, k and v after rope, the context and the q/k norms; a gate; multi-latent attention's
        latents; Gated DeltaNet's per-token tensors) and its rotary cos and sin, whole on every rank;
      - a dense MLP: gate and up, silu(gate), up + glu_linear_offset (a copy), their product;
      - LoRA's adapters (trainer/memory/adapters.py)."""
    d, tp, family = spec.hidden_size, parallel.tensor, family_of(spec)
    attention = family.attention_memory(spec, layer, local=True, selective=parallel.recompute == "selective")
    experts = family.routed(spec, layer)
    # a dense MLP, or a MoE layer's shared expert (as dense, split over TP; width 0 without one)
    split = attention.split + 5 * (spec.moe.shared_ffn_hidden_size if experts else spec.ffn_hidden_size)
    unsplit = 6 * d + attention.sequence
    unsplit = unsplit // tp if parallel.sequence_parallel else unsplit
    per_token = PARAM_BYTES[model.precision] * (split // tp + unsplit + attention.rotary) + 4 * attention.fp32 // tp
    if experts:
        per_token += local_moe_token_bytes(spec, model) // tp
    width = PARAM_BYTES[model.precision]
    return per_token + adapter_token_bytes(spec, model.lora, parallel, layer, width, local=True)


def softmax_attention(spec: ModelSpec, layer: int) -> bool:
    """Whether layer `layer`'s local core attention keeps a [heads, tokens, tokens] softmax: Megatron's
    op by op (gpt-oss). torch's fused kernel (models/local_attention.py, every other family) keeps
    none, and a Gated DeltaNet layer (Qwen3.5, Qwen3-Next) keeps a recurrent state instead."""
    attention = family_of(spec).attention_memory(spec, layer, local=True, selective=False)
    return attention.scores and not attention.fused


def packed_mask_bytes(
    spec: ModelSpec, model: ModelConfig, parallel: ParallelConfig, layers: list[int], tokens: int
) -> int:
    """A packed row's block-diagonal mask, one a micro-batch (trainer/packing.py: one byte an entry),
    and the fused kernel's additive copy of it in the parameters' dtype, made once and shared by the
    layers it reaches (models/local_attention.py); padded rows are masked by the kernel itself."""
    if not packs(spec, model, parallel):
        return 0
    fused = any(family_of(spec).attention_memory(spec, i, local=True, selective=False).fused for i in layers)
    return tokens * tokens * (1 + PARAM_BYTES[model.precision] * fused)


def local_moe_token_bytes(spec: ModelSpec, model: ModelConfig) -> int:
    """moe_token_bytes for the local implementation (measured on CPU): top_k x (the permuted token;
    6 x the expert's width: a dense MLP's 5, and the product scaled by the token's probability), and
    the router's: per expert its logits and scores (model.moe.router_dtype) and two boolean maps,
    per route the probability twice and the expert index (int64) twice."""
    moe, router = spec.moe, ROUTER_BYTES[model.moe.router_dtype]
    routed = moe.top_k * (spec.hidden_size + 6 * moe.ffn_hidden_size) * PARAM_BYTES[model.precision]
    return routed + moe.num_experts * (2 * router + 2) + moe.top_k * (2 * router + 16)


def local_score_bytes(spec: ModelSpec, model: ModelConfig, parallel: ParallelConfig, tokens: int) -> int:
    """One [heads / TP, tokens, tokens] tensor of the local attention in the parameters' dtype: its
    scores, their softmax, or a gradient of either. A micro-batch counts as one row of `tokens` (a
    packed row; a padded micro-batch of b rows of s tokens has b x s^2, less than (b x s)^2)."""
    return spec.num_heads // parallel.tensor * tokens * tokens * PARAM_BYTES[model.precision]


def local_activation_bytes(
    spec: ModelSpec, model: ModelConfig, parallel: ParallelConfig, tokens: int, stage: int
) -> int:
    """activation_bytes for the local implementation, as measured on CPU (benchmarks/bench_memory.py).
    Each layer keeps local_layer_bytes per token (the fused kernel's output and statistics among
    them) and, where Megatron's op-by-op softmax runs (softmax_attention: gpt-oss) unless core
    attention is recomputed, its attention probabilities (one local_score_bytes) and its causal mask
    (one byte per [tokens, tokens] entry); a packed micro-batch its mask (packed_mask_bytes); a layer
    under full recompute keeps its input only. The peak is that of the phase that needs the most
    beside them:
      - the loss's backward: the logits, their gradient and the op-by-op log-prob kernels'
        temporaries (logprobs.EAGER_TEMPORARIES float32 [tokens, the slice's real-vocabulary
        columns]: they slice the padding off; within model.logprob_memory_mb);
      - the core attention's backward of the last layer keeping its activations: three score-sized
        tensors more (the gradients of the probabilities and of the scores, and the copies autograd
        makes for the scores' in-place masking, a view; the layer's probabilities are freed by
        then); under selective recompute its probabilities rebuilt besides;
      - under full recompute, a rebuilt layer's: the recomputed layers' inputs and that layer whole,
        its three more besides (the later layers' activations are freed by then).
    Plus, where Megatron's softmax runs, its global memory buffer, which the scores are computed into:
    one score tensor, kept from one step to the next; and the micro-batches a pipeline rank holds
    beside the running one (micro_batches_in_flight), each with all it keeps."""
    from bapo_megatron.trainer.logprobs import EAGER_TEMPORARIES

    layers = stage_layers(spec.num_layers, parallel.pipeline, stage, parallel.virtual_pipeline)
    rerun = set(recomputed_layers(spec, parallel, stage))
    score = local_score_bytes(spec, model, parallel, tokens)
    kept_score = 0 if parallel.recompute == "selective" else score + tokens * tokens
    split = parallel.tensor if parallel.sequence_parallel else 1
    inputs = len(rerun) * tokens * PARAM_BYTES[model.precision] * spec.hidden_size // split
    scores = {i: softmax_attention(spec, i) for i in layers}  # fused or linear attention: none
    whole = [
        local_layer_bytes(spec, model, parallel, i) * tokens + kept_score * scores[i] for i in layers if i not in rerun
    ]
    kept = inputs + sum(whole) + packed_mask_bytes(spec, model, parallel, layers, tokens)
    attends = any(scores[i] for i in layers if i not in rerun)
    phases = [kept + (3 * score + (score if parallel.recompute == "selective" else 0)) * attends] if whole else []
    if rerun:  # the recomputed layers come first in a stage: rebuilt once the later ones are done
        rebuilt = max(
            local_layer_bytes(spec, model, parallel, i) * tokens + (4 * score + tokens * tokens) * scores[i]
            for i in rerun
        )
        phases.append(inputs + rebuilt)
    if stage == parallel.pipeline - 1:
        v_local = padded_vocab(spec, model, parallel) // parallel.tensor
        logits = tokens * v_local
        columns = min(v_local, spec.vocab_size)  # TP rank 0's: no slice holds more real columns
        temporaries = min(model.logprob_memory_mb << 20, EAGER_TEMPORARIES * 4 * tokens * columns)
        phases.append(kept + 2 * PARAM_BYTES[model.precision] * logits + temporaries)  # logits, their gradient
    in_flight = micro_batches_in_flight(parallel, stage) - 1  # beside the running one
    buffer = score if any(scores.values()) else 0
    return int(in_flight * kept) + max(phases) + buffer


def trainer_memory(
    spec: ModelSpec,
    model: ModelConfig,
    parallel: ParallelConfig,
    data_parallel: int,
    distributed_optimizer: bool = True,
    reference: bool = False,
) -> MemoryEstimate:
    """The estimate for the most loaded pipeline stage, with micro-batches of
    parallel.max_tokens_per_microbatch tokens; `reference`: a KL loss's reference model counted
    (none under LoRA: the base with the adapters off)."""
    stages = range(parallel.pipeline)
    estimates = (
        stage_memory(spec, model, parallel, data_parallel, s, distributed_optimizer, reference) for s in stages
    )
    return max(estimates, key=lambda e: e.peak)


def stage_memory(
    spec: ModelSpec,
    model: ModelConfig,
    parallel: ParallelConfig,
    data_parallel: int,
    stage: int,
    distributed_optimizer: bool = True,
    reference: bool = False,
) -> MemoryEstimate:
    """The estimate for pipeline rank `stage` (trainer_memory takes the most loaded of them)."""
    width = PARAM_BYTES[model.precision]
    per_param = 8 + (4 if width < 4 else 0)  # Adam's moments, and fp32 main parameters under bf16/fp8
    expert_data_parallel = parallel.tensor * data_parallel // parallel.expert
    shards, expert_shards = (data_parallel, expert_data_parallel) if distributed_optimizer else (1, 1)
    n = rank_params(
        spec,
        padded_vocab(spec, model, parallel),
        parallel.tensor,
        parallel.pipeline,
        stage,
        expert=parallel.expert,
        virtual=parallel.virtual_pipeline,
    )
    dense_trained = n.dense - (n.router if model.moe.freeze_router else 0)
    trained_experts = n.experts
    layers = stage_layers(spec.num_layers, parallel.pipeline, stage, parallel.virtual_pipeline)
    adapters = adapter_params(spec, model.lora, layers, parallel.tensor, parallel.expert)
    if adapters:  # LoRA: the base frozen, gradients and Adam state for the adapters alone
        dense_trained, trained_experts = adapters, 0
    experts_optimizer = trained_experts * per_param // expert_shards
    return MemoryEstimate(
        params=(n.total + adapters) * width,
        grads=(dense_trained + trained_experts) * 4,
        optimizer=dense_trained * per_param // shards + experts_optimizer,
        activations=activation_bytes(spec, model, parallel, parallel.max_tokens_per_microbatch, stage),
        experts=n.experts * width + trained_experts * 4 + experts_optimizer,
        reference=n.total * width if reference and not model.lora.enabled else 0,
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
    kl = job.algo.kl_coef > 0
    estimate = trainer_memory(spec, job.model, job.parallel, data_parallel, distributed_optimizer=True, reference=kl)
    return colocated_mem_fraction(gpu_bytes, estimate)

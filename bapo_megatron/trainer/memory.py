"""Per-GPU memory of a trainer rank, estimated from the model's shape and the job's layout.

No model is built: this runs at config time (the colocated SGLang servers' static memory, a
dry run). Parameters are counted exactly per tensor-parallel rank of each pipeline stage (tests
compare with Megatron's own model); the rest follows Megatron's storage:
  - gradients: DDP's fp32 buffer (grad_reduce_in_fp32), one per parameter;
  - Adam: exp_avg and exp_avg_sq in fp32, plus fp32 main parameters when the parameters are
    bf16 (fp8 keeps bf16 parameters); the distributed optimizer splits them over data parallel;
  - activations (an estimate): what one micro-batch keeps for backward per layer (inputs of the
    norms and linears, q/k/v, the attention output, the MLP's gate/up and SwiGLU output, flash
    attention's softmax statistics aside), in the parameters' dtype, divided by TP where the
    tensor is split (and the rest too under sequence parallel); the first stage of a 1F1B
    pipeline holds PP micro-batches at once; plus the last stage's logits and their gradient,
    and the log-prob temporaries (model.logprob_memory_mb).
"""

from __future__ import annotations

from dataclasses import dataclass

from bapo_megatron.common.model_spec import ModelSpec, padded_vocab_size
from bapo_megatron.config import JobConfig, ModelConfig, ParallelConfig

PARAM_BYTES = {"fp32": 4, "bf16": 2, "fp8": 2}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one GPU of the trainer (its most loaded pipeline stage)."""

    params: int
    grads: int
    optimizer: int
    activations: int

    @property
    def resident(self) -> int:
        """What stays on the GPU between steps (while a colocated engine generates)."""
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        return self.resident + self.activations


def layer_params(spec: ModelSpec) -> int:
    d, hd = spec.hidden_size, spec.head_dim
    qkv = d * (spec.num_heads + 2 * spec.num_kv_heads) * hd
    bias = (spec.num_heads + 2 * spec.num_kv_heads) * hd if spec.qkv_bias else 0
    return qkv + bias + spec.num_heads * hd * d + 3 * d * spec.ffn_hidden_size + 2 * d


def stage_params(spec: ModelSpec, padded_vocab: int, tp: int, pp: int, stage: int) -> int:
    """Parameters one tensor-parallel rank of pipeline `stage` holds (norms are replicated)."""
    d = spec.hidden_size
    per_layer = (layer_params(spec) - 2 * d) // tp + 2 * d
    count = per_layer * spec.num_layers // pp
    embedding = padded_vocab * d // tp
    if stage == 0:
        count += embedding
    if stage == pp - 1:
        count += d  # final norm
        if not spec.tie_embeddings or pp > 1:  # tied across stages: the last keeps its own copy
            count += embedding
    return count


def activation_bytes(spec: ModelSpec, model: ModelConfig, parallel: ParallelConfig, tokens: int, stage: int) -> int:
    """What stage `stage` keeps for backward while running one micro-batch of `tokens` tokens."""
    d, hd, tp = spec.hidden_size, spec.head_dim, parallel.tensor
    width = PARAM_BYTES[model.precision]
    split = (spec.num_heads + 2 * spec.num_kv_heads) * hd + 2 * spec.num_heads * hd + 3 * spec.ffn_hidden_size
    unsplit = 4 * d  # two norm inputs, two residuals
    per_token_layer = width * (split // tp + (unsplit // tp if parallel.sequence_parallel else unsplit))
    layers = spec.num_layers // parallel.pipeline
    in_flight = parallel.pipeline - stage  # 1F1B: stage s holds PP - s micro-batches
    total = per_token_layer * layers * tokens * in_flight
    if stage == parallel.pipeline - 1:
        vocab = padded_vocab_size(spec.vocab_size, model.make_vocab_size_divisible_by, tp, model.vocab_pad_tp)
        total += tokens * vocab // tp * (width + 4)  # logits and their fp32 gradient
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
    width = PARAM_BYTES[model.precision]
    optimizer_per_param = 8 + (4 if width < 4 else 0)
    shards = data_parallel if distributed_optimizer else 1
    stages = []
    for stage in range(parallel.pipeline):
        n = stage_params(spec, vocab, parallel.tensor, parallel.pipeline, stage)
        stages.append(
            MemoryEstimate(
                params=n * width,
                grads=n * 4,
                optimizer=n * optimizer_per_param // shards,
                activations=activation_bytes(spec, model, parallel, parallel.max_tokens_per_microbatch, stage),
            )
        )
    return max(stages, key=lambda e: e.peak)


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

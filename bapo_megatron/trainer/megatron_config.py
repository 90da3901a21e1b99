"""The one translation point to Megatron-Core: our configs -> TransformerConfig and GPTModel.

Nothing else in the package names Megatron's config fields. Transformer Engine is imported
only when transformer_impl is "transformer_engine".
"""

from __future__ import annotations

import torch

from bapo_megatron.config import ModelConfig, OptimizerConfig, ParallelConfig
from bapo_megatron.errors import ConfigError
from bapo_megatron.models import family_of
from bapo_megatron.models.local_attention import with_sdpa_core_attention
from bapo_megatron.models.spec import ModelSpec, check_layout, padded_vocab_size
from bapo_megatron.trainer.lora import apply_lora

EXTRA_STATE = "_extra_state"
"""The key suffix of Transformer Engine modules' own state (fp8 scaling history) in state dicts."""

FP8_ROWS_MULTIPLE = 16
"""Tokens (rows) each rank's fp8 GEMM input is padded to a multiple of. Transformer Engine asserts
the product of the leading dimensions is divisible by 8 (assert_dim_for_fp8_exec, every recipe);
16 is the alignment TE and Megatron pad to themselves (get_fp8_align_size)."""
FP8_BLOCK_ROWS = 128
"""Float8BlockScaling quantises an all-gathered input (sequence parallel) in blocks of 128 rows:
TE asserts rows % 128 there (Float8BlockQuantizer.is_quantizable)."""
FP8_BLOCKWISE_MIN_CAPABILITY, FP8_BLOCKWISE_MIN_CUDA = (9, 0), (12, 9)
"""What TE's check_fp8_block_scaling_support asks of the blockwise recipe."""

PARAMS_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


def check_precision_support(model: ModelConfig) -> None:
    """ConfigError, before any process group starts, when this machine cannot run `model`'s precision."""
    if model.transformer_impl == "transformer_engine" or model.precision == "fp8":
        try:
            import transformer_engine.pytorch  # noqa: F401
        except ImportError as err:
            raise ConfigError(
                "model.transformer_impl",
                model.transformer_impl,
                f"Transformer Engine is not importable here ({err}); install the [gpu] extra "
                "or use transformer_impl='local'",
            ) from None
    if model.precision in ("bf16", "fp8") and not torch.cuda.is_available():
        raise ConfigError("model.precision", model.precision, "needs a CUDA GPU; use 'fp32' on CPU")
    if model.precision == "fp8":
        problem = fp8_hardware_problem(model.fp8_recipe, torch.cuda.get_device_capability(), torch.version.cuda)
        if problem:
            raise ConfigError(
                "model.fp8_recipe" if model.fp8_recipe == "blockwise" else "model.precision",
                model.fp8_recipe if model.fp8_recipe == "blockwise" else "fp8",
                problem,
            )


def fp8_hardware_problem(recipe: str, capability: tuple[int, int], cuda: str | None) -> str | None:
    """Why a GPU of `capability` with torch built for CUDA `cuda` cannot run fp8 `recipe` (None: it can)."""
    if tuple(capability) < (8, 9):
        return f"needs a GPU of compute capability >= 8.9 (Ada, Hopper); found {capability[0]}.{capability[1]}"
    if recipe == "blockwise":
        version = tuple(int(x) for x in (cuda or "0.0").split(".")[:2])
        if tuple(capability) < FP8_BLOCKWISE_MIN_CAPABILITY or version < FP8_BLOCKWISE_MIN_CUDA:
            return (
                f"blockwise fp8 needs compute capability >= 9.0 (Hopper) and CUDA >= 12.9; found "
                f"{capability[0]}.{capability[1]} with CUDA {cuda}: use fp8_recipe='tensorwise'"
            )
    return None


def fp8_rows_multiple(recipe: str, sequence_parallel: bool) -> int:
    """Rows each rank's fp8 GEMM input must be a multiple of, under `recipe`."""
    return FP8_BLOCK_ROWS if recipe == "blockwise" and sequence_parallel else FP8_ROWS_MULTIPLE


def sequence_multiple(model: ModelConfig, parallel: ParallelConfig) -> int:
    """Every packed sequence length must be a multiple of this, so that each rank's slice is whole.

    Sequence parallel gives each TP rank s / TP rows of every sequence: the fp8 rule applies to a
    rank's slice, so the per-rank multiple is multiplied by TP, not merely combined with it by lcm
    (lcm(16, 4) = 16 leaves a TP=4 rank 4 rows of a 16-token sequence)."""
    split = parallel.tensor if parallel.sequence_parallel else 1
    per_rank = fp8_rows_multiple(model.fp8_recipe, parallel.sequence_parallel) if model.precision == "fp8" else 1
    return per_rank * split


def transformer_config(
    spec: ModelSpec, model: ModelConfig, parallel: ParallelConfig, initialize: bool = True, cpu_init: bool = False
):
    """Megatron's TransformerConfig for `spec` under our model and parallel settings.

    initialize=False skips the random initialisation of weights that are about to be loaded.
    Megatron's own switch for that (perform_initialization=False) also skips marking the
    parameters tensor-parallel, which breaks TP gathers and grad-norm de-duplication at
    TP > 1; there the initialisation runs, with init methods that leave the memory as it is.
    At TP = 1 (the converters) nothing is marked or gathered, and the switch saves a copy.
    cpu_init: parameters made on the CPU (or the default device, e.g. meta) even where CUDA is.
    """
    check_layout(
        spec, parallel.tensor, parallel.pipeline, parallel.virtual_pipeline, parallel.expert, parallel.sequence_parallel
    )
    assert parallel.context == 1, "context parallel is refused before the model is built (trainer/memory/fit.py)"
    dtype = PARAMS_DTYPE[model.precision]
    fp8 = {}
    if model.precision == "fp8":
        fp8 = {
            "fp8": model.fp8_format,
            "fp8_recipe": model.fp8_recipe,
            "first_last_layers_bf16": model.fp8_bf16_first_last_layers,
        }
    family = family_of(spec)
    return family.config_class(spec)(
        **family.transformer_fields(spec),
        **_layout(parallel),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # The loss returns (sum, token count): Megatron must not average per micro-batch.
        calculate_per_token_loss=True,
        variable_seq_lengths=True,
        # Batched p2p (Megatron's default) posts a step's sends and receives to a peer in one list;
        # with two pipeline stages the previous and next stage are the same peer, and the
        # interleaved schedule's activation and gradient then meet the wrong receive (measured on
        # gloo: a gradient of another micro-batch's shape). Megatron's unbatched p2p splits the two
        # directions over two process groups for exactly this case.
        batch_p2p_comm=parallel.pipeline != 2,
        # Frees each stage's output activations once sent (Megatron-LM's default): less memory
        deallocate_pipeline_outputs=True,
        # Dense models ignore the dispatcher, but 0.16.1 rejects its default ("allgather") with variable lengths.
        moe_token_dispatcher_type="alltoall",
        **_moe(spec, model),
        **recompute_settings(spec, parallel),
        use_cpu_initialization=cpu_init or not torch.cuda.is_available(),
        perform_initialization=initialize or parallel.tensor > 1,
        **({} if initialize else {"init_method": _leave_as_is, "output_layer_init_method": _leave_as_is}),
        # Fusions need CUDA kernels; on CPU (local spec) they must all be off.
        **_fusions(model.transformer_impl == "transformer_engine"),
        **fp8,
    )


def _layout(parallel: ParallelConfig) -> dict:
    """TransformerConfig's parallel layout: set here too, or every stage builds every layer."""
    return {
        "tensor_model_parallel_size": parallel.tensor,
        "pipeline_model_parallel_size": parallel.pipeline,
        "virtual_pipeline_model_parallel_size": parallel.virtual_pipeline,
        "context_parallel_size": parallel.context,
        "sequence_parallel": parallel.sequence_parallel,
        "expert_model_parallel_size": parallel.expert,
        "expert_tensor_parallel_size": 1,  # an expert is never split (every anchor runs MoE at expert TP 1)
    }


def _moe(spec: ModelSpec, model: ModelConfig) -> dict:
    """TransformerConfig's settings for how a mixture-of-experts model's routers and experts run
    (none for a dense model; its experts' shape is its family's transformer_fields)."""
    if spec.moe is None:
        return {}
    settings = model.moe
    return {
        "moe_router_dtype": settings.router_dtype,
        "moe_router_load_balancing_type": "aux_loss" if settings.aux_loss_coeff > 0 else "none",
        "moe_aux_loss_coeff": settings.aux_loss_coeff,
        "moe_grouped_gemm": grouped_gemm(model),
        # every token reaches its experts: no capacity factor, nothing dropped (as the engines route)
        "moe_expert_capacity_factor": None,
        # each router can take given routes (rollout routing replay); it routes as usual until told to
        "moe_enable_routing_replay": True,
    }


def recompute_settings(spec: ModelSpec, parallel: ParallelConfig) -> dict:
    """TransformerConfig's activation recompute fields for parallel.recompute."""
    assert parallel.recompute != "auto", (
        "parallel.recompute=auto is resolved before the model is built (trainer/memory/fit.py)"
    )
    if parallel.recompute == "none":
        return {}
    if parallel.recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    per_stage = spec.num_layers // (parallel.pipeline * (parallel.virtual_pipeline or 1))
    layers = parallel.recompute_layers or per_stage
    if layers > per_stage:
        raise ConfigError(
            "parallel.recompute_layers", layers, f"exceeds the {per_stage} layers of a pipeline stage (virtual stage)"
        )
    return {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": layers}


def grouped_gemm(model: ModelConfig) -> bool:
    """Whether a rank's experts run as one grouped GEMM (Transformer Engine's) or one after another."""
    if model.moe.grouped_gemm is not None:
        return model.moe.grouped_gemm
    return model.transformer_impl == "transformer_engine"


def _leave_as_is(weight: torch.Tensor) -> None:
    """An init method that does nothing: the weights are loaded right after the model is built."""


def _fusions(enabled: bool) -> dict:
    """Kernel fusions: all on with Transformer Engine, all off on the local (CPU) spec. Gradient
    accumulation fusion only where apex's wgrad kernel imports: Megatron's own output layer
    (a ColumnParallelLinear even under the TE spec) refuses to build without it."""
    flags = {
        name: enabled
        for name in (
            "bias_activation_fusion",
            "bias_dropout_fusion",
            "masked_softmax_fusion",
            "persist_layer_norm",
            "apply_rope_fusion",
        )
    }
    flags["gradient_accumulation_fusion"] = enabled and wgrad_fusion_available()
    return flags


def wgrad_fusion_available() -> bool:
    """Whether apex's fused_weight_gradient_mlp_cuda extension imports (Megatron's own test: an
    extension that is present but fails to load counts as missing)."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except ImportError:
        return False
    return True


def layer_spec(spec: ModelSpec, model: ModelConfig, config=None, vp_stage: int | None = None):
    """The transformer layer spec: Transformer Engine modules on GPU, Megatron's local ones otherwise.
    A mixture-of-experts model gets a block spec instead (its layers differ: dense or experts), which
    needs the TransformerConfig `config` and the virtual stage being built. The local modules' core
    attention runs in torch's fused kernel (models/local_attention.py)."""
    te = model.transformer_impl == "transformer_engine"
    built = family_of(spec).layer_spec(spec, te, config, vp_stage)
    return built if te else with_sdpa_core_attention(built)


def padded_vocab(spec: ModelSpec, model: ModelConfig, parallel: ParallelConfig) -> int:
    """Rows of the (vocab-parallel) embedding and output layer, padding included."""
    return padded_vocab_size(spec.vocab_size, model.make_vocab_size_divisible_by, parallel.tensor, model.vocab_pad_tp)


def build_gpt_model(
    spec: ModelSpec,
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None = None,
    initialize: bool = True,
    cpu_init: bool = False,
):
    """One pipeline stage (or virtual chunk) of the policy as a Megatron GPTModel."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = transformer_config(spec, model, parallel, initialize, cpu_init)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(spec, model, config, vp_stage),
        vocab_size=padded_vocab(spec, model, parallel),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,  # logits stay vocab-parallel: log-probs never gather the vocabulary
        share_embeddings_and_output_weights=spec.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta),
        rotary_percent=spec.rotary_fraction,
        rope_scaling=spec.rope_scaling_factor is not None,
        rope_scaling_factor=spec.rope_scaling_factor or 8.0,
        vp_stage=vp_stage,
    )
    for name, param in gpt.named_parameters():
        if ".mlp.experts." in name:
            # Expert gradients are reduced over the expert-data-parallel group and the experts get an
            # optimizer of their own (Megatron chains it after the dense one) at every EP, 1 included:
            # Megatron does so only from EP 2, and the optimizer's checkpoint then changed shape with EP
            param.allreduce = False
        if model.moe.freeze_router and name.endswith("mlp.router.weight"):
            param.requires_grad_(False)
    apply_lora(gpt, spec, model.lora)  # adapters beside the base (model.lora.rank > 0), which is frozen
    return gpt


def ddp_config(model: ModelConfig):
    """Megatron DDP settings: fp32 gradient reduction; the distributed optimizer on GPU."""
    from megatron.core.distributed import DistributedDataParallelConfig

    on_gpu = torch.cuda.is_available()
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=on_gpu,
        use_distributed_optimizer=on_gpu,
        # Non-finite gradients are detected by the trainer, which skips the step instead of raising.
        check_for_nan_in_grad=False,
    )


def optimizer_config(optimizer: OptimizerConfig, model: ModelConfig):
    """Megatron's OptimizerConfig: Adam with fp32 main weights (bf16 params on GPU)."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

    dtype = PARAMS_DTYPE[model.precision]
    return MegatronOptimizerConfig(
        optimizer="adam",
        lr=optimizer.lr,
        min_lr=optimizer.min_lr,
        weight_decay=optimizer.weight_decay,
        adam_beta1=optimizer.adam_beta1,
        adam_beta2=optimizer.adam_beta2,
        adam_eps=optimizer.adam_eps,
        clip_grad=optimizer.clip_grad,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=torch.cuda.is_available(),
    )


def lr_scheduler(megatron_optimizer, optimizer: OptimizerConfig, total_steps: int):
    """Linear warmup from 0, then `optimizer.lr_decay` down to min_lr over the remaining steps."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        megatron_optimizer,
        init_lr=0.0 if optimizer.warmup_steps else optimizer.lr,
        max_lr=optimizer.lr,
        min_lr=optimizer.min_lr,
        lr_warmup_steps=optimizer.warmup_steps,
        lr_decay_steps=max(total_steps, optimizer.warmup_steps + 1),
        lr_decay_style=optimizer.lr_decay,
        start_wd=optimizer.weight_decay,
        end_wd=optimizer.weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
    )

"""The dry run's memory figures: a trainer GPU's estimate, the longest response it fits, the experts,
routing replay and an SGLang server's KV cache.

    lines = memory_lines(plan, gpu_bytes)   # after plan.plan_run, for GPUs of gpu_bytes

Estimates from trainer/memory/ (exact parameter counts, the rest estimated): no GPU, no Megatron.
"""

from __future__ import annotations

from bapo_megatron.plan import RunPlan

GIB = 2**30


def memory_lines(plan: RunPlan, gpu_bytes: int) -> list[str]:
    """A trainer GPU's parameters, gradients, optimizer state and activations (GPU runs use
    Megatron's distributed optimizer, trainer/megatron_config.py: no other to estimate), the
    reference model of a KL loss, the longest response, the experts and the engines' memory."""
    from bapo_megatron.trainer.memory.estimate import trainer_memory

    cfg, spec, dp = plan.cfg, plan.spec, plan.data_parallel
    m = trainer_memory(spec, cfg.model, cfg.parallel, dp, distributed_optimizer=True, reference=cfg.algo.kl_coef > 0)
    out = [
        f"trainer, distributed optimizer: parameters {m.params / GIB:.2f} GiB, gradients {m.grads / GIB:.2f} GiB, "
        f"optimizer {m.optimizer / GIB:.2f} GiB, activations of the micro-batches in flight "
        f"{m.activations / GIB:.2f} GiB; peak {m.peak / GIB:.2f} GiB"
    ]
    if m.reference:
        out.append(f"KL loss (algo.kl_coef): the reference model, {m.reference / GIB:.2f} GiB, counted in the peak")
    elif cfg.algo.kl_coef > 0 and cfg.model.lora.enabled:
        out.append("KL loss (algo.kl_coef): reference: base with adapters off (no second copy of the weights)")
    if cfg.model.lora.enabled:
        out.append(lora_line(plan))
    out.append(reach_line(plan, gpu_bytes))
    if spec.moe is not None:
        out += _moe_memory(plan)
    if cfg.rollout.replay is None and cfg.rollout.engines.kind == "sglang":
        out.append(_sglang_memory(plan, gpu_bytes))
    return out


def lora_line(plan: RunPlan) -> str:
    """The adapters' size (model.lora): all a LoRA run trains, keeps optimizer state for and exports."""
    from bapo_megatron.models.lora import adapter_params
    from bapo_megatron.trainer.memory.estimate import PARAM_BYTES

    model, spec = plan.cfg.model, plan.spec
    n = adapter_params(spec, model.lora, list(range(spec.num_layers)), 1)
    mib = n * PARAM_BYTES[model.precision] / 2**20
    sync = (
        f"each weight sync sends the adapters alone, {mib:.1f} MiB (the base once, and to an engine that "
        "restarts: model.lora.sync=adapter)"
        if model.lora.adapter_sync
        else "each weight sync sends the whole model, the adapters merged (model.lora.sync=merged)"
    )
    main = 0 if model.precision == "fp32" else 4  # the optimizer's fp32 copy of lower-precision weights
    saved = n * (PARAM_BYTES[model.precision] + main + 8) / 2**20  # + Adam's two fp32 moments
    return (
        f"LoRA adapters (model.lora, rank {model.lora.rank}): {n:,} parameters, {mib:.1f} MiB in "
        f"{model.precision}; the base is frozen: gradients and optimizer state above are the adapters' only; {sync}; "
        f"each checkpoint holds the adapters and their optimizer state, {saved:,.1f} MiB, and names the base "
        "(lora_base.json) without a copy of it"
    )


def reach_line(plan: RunPlan, gpu_bytes: int) -> str:
    """The longest response the layout fits after the micro-batch's prompt room, with the most
    recompute and with none (trainer/memory/fit.py); where that room already fills the model's
    context, the context is the limit, not memory, and the line says that instead."""
    from bapo_megatron.trainer.memory.fit import describe, longest_response, prompt_room

    cfg, spec, dp = plan.cfg, plan.spec, plan.data_parallel
    room, gpus = prompt_room(cfg), f"on {gpu_bytes / GIB:.0f} GiB GPUs"
    if room >= spec.max_position_embeddings:
        return _context_line(plan, gpu_bytes)
    most = longest_response(cfg, spec, dp, gpu_bytes)
    if most.tokens == 0:
        return (
            f"longest response this layout fits: none, even with the most recompute "
            f"({describe(spec, most.parallel, room)}), after prompts of up to {room:,} tokens, {gpus}"
        )
    plain = longest_response(cfg, spec, dp, gpu_bytes, recompute=False)
    limit = ", the model's context" if most.context else ""
    return (
        f"longest response this layout fits: {most.tokens:,} tokens{limit} (recompute "
        f"{describe(spec, most.parallel, room + most.tokens)}); without recompute "
        f"{plain.tokens:,}; after prompts of up to {room:,} tokens, {gpus}"
    )


def _context_line(plan: RunPlan, gpu_bytes: int) -> str:
    """The reach of a model whose context is no longer than the prompt room a micro-batch leaves
    (parallel.max_tokens_per_microbatch less rollout.sampling.max_new_tokens): a prompt and its
    response together, up to the context, and the least recompute that holds them."""
    from bapo_megatron.trainer.memory.fit import describe, least_recompute, prompt_room

    cfg, spec = plan.cfg, plan.spec
    context, p = spec.max_position_embeddings, cfg.parallel
    room = (
        f"a micro-batch leaves prompts {prompt_room(cfg):,} tokens, parallel.max_tokens_per_microbatch="
        f"{p.max_tokens_per_microbatch} less rollout.sampling.max_new_tokens={cfg.rollout.sampling.max_new_tokens}"
    )
    least = least_recompute(cfg, spec, plan.data_parallel, gpu_bytes, context)
    if least is None:
        return (
            f"longest response this layout fits: none; a prompt and response of the model's context, {context:,} "
            f"tokens, do not fit {gpu_bytes / GIB:.0f} GiB GPUs even with the most recompute ({room})"
        )
    return (
        f"longest response this layout fits: the model's context, {context:,} tokens with its prompt "
        f"(recompute {describe(spec, least, context)}), on {gpu_bytes / GIB:.0f} GiB GPUs: the context, not "
        f"memory, is the limit ({room})"
    )


def _moe_memory(plan: RunPlan) -> list[str]:
    """The experts' share of a trainer GPU, and the routes a step stores for routing replay."""
    from bapo_megatron.trainer.memory.estimate import routing_replay_bytes, trainer_memory

    cfg, spec = plan.cfg, plan.spec
    moe, r = spec.moe, cfg.rollout
    experts = trainer_memory(spec, cfg.model, cfg.parallel, plan.data_parallel, distributed_optimizer=True).experts
    layers, index = len(moe.sparse_layers), 1 if moe.num_experts <= 256 else 2
    prompt = cfg.data.max_prompt_tokens or 512  # as the micro-batch count above, when prompts are not capped
    tokens = r.prompts_per_step * r.samples_per_prompt * (prompt + r.sampling.max_new_tokens)
    replay = routing_replay_bytes(spec, tokens)
    steps = r.max_staleness + 1  # async: the groups queued or generating, (K + 1) steps' worth
    queued = (
        f"; async, {steps} steps' worth queued or generating: {steps * replay / GIB:.2f} GiB"
        if r.mode == "async"
        else ""
    )
    return [
        f"experts on a trainer GPU (distributed optimizer): parameters, gradients and optimizer state "
        f"{experts / GIB:.2f} GiB of the above",
        f"routing replay (R3): {layers} MoE layers x top-{moe.top_k} x {index} byte{'s' if index > 1 else ''} = "
        f"{layers * moe.top_k * index} B a token; a step's {r.prompts_per_step} prompts x {r.samples_per_prompt} "
        f"samples x ({prompt} prompt + {r.sampling.max_new_tokens} new) tokens = {tokens:,} tokens: "
        f"{replay / GIB:.2f} GiB{queued}",
    ]


def _sglang_memory(plan: RunPlan, gpu_bytes: int) -> str:
    """An SGLang server GPU: its share of the weights and what is left of mem_fraction_static for the
    KV cache, and for a hybrid model the request slots of its recurrent state (trainer/memory/engine.py)."""
    from bapo_megatron.engines.sglang_launcher import mem_fraction
    from bapo_megatron.trainer.memory.engine import engine_cache, engine_weight_bytes
    from bapo_megatron.trainer.memory.estimate import rollout_mem_fraction
    from bapo_megatron.weights.publish import engine_quantization

    cfg, spec = plan.cfg, plan.spec
    e = cfg.rollout.engines
    quantization = engine_quantization(cfg)  # a quantized release is served as it is stored
    weights = engine_weight_bytes(spec, e.tensor_parallel, quantization)
    try:
        colocated = rollout_mem_fraction(cfg, spec, gpu_bytes, plan.data_parallel) if e.colocate else None
        fraction = mem_fraction(cfg.rollout, colocated)
    except ValueError as err:
        return f"each SGLang server GPU: cannot fit ({err})"
    cache = engine_cache(spec, e.tensor_parallel, max(0, int(fraction * gpu_bytes) - weights))
    line = (
        f"each SGLang server GPU: mem_fraction_static {fraction:.2f}: weights {weights / GIB:.2f} GiB"
        f"{_stored_as(quantization)}, "
        f"KV cache {cache.kv_bytes / GIB:.2f} GiB = {cache.tokens:,} tokens"
    )
    if cache.requests is None:
        return line
    return (
        f"{line} (its full-attention layers'); recurrent state {cache.per_request / 2**20:.1f} MiB a request "
        f"(linear-attention layers, any length): {cache.state_bytes / GIB:.2f} GiB = {cache.requests:,} "
        "concurrent requests (SGLang's default mamba_full_memory_ratio 0.9)"
    )


def _stored_as(quantization) -> str:
    """How the engine's weights are counted, for a server started from a quantized release (bf16: unsaid)."""
    if quantization is None:
        return ""
    if quantization.method == "mxfp4":
        return " (as the release stores them: MXFP4 experts, 4 bits a weight and an E8M0 scale a 32; the rest bf16)"
    block = "x".join(map(str, quantization.block))
    return f" (as the release stores them: fp8, 1 byte a weight and a float32 scale a {block} block; the rest bf16)"

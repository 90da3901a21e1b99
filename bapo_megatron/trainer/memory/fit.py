"""What a job needs to fit its GPUs, by the memory estimate (estimate.py): the activation
recompute `parallel.recompute: auto` stands for, and the longest response a layout fits.

    fitted = fit_to_gpu(cfg, spec, world_size, gpu_bytes)   # before anything is built
    fitted.cfg.parallel.recompute                            # "none", "selective" or "full", never "auto"
    print(fitted.line)                                       # what it is, why, and at what cost

`auto` becomes the least recompute whose estimated peak fits the GPU less a reserve: none, then
selective, then full over the first 1, 2, ... layers of each pipeline stage; with nothing that
fits (or a recompute set by hand that does not), a ConfigError names the peak, the GPU and what
would make it fit, unless parallel.over_memory asks to go on (a warning). The dry run
(--gpu-memory-gib) and the run (its GPU's size) call the same function, so what one
accepts the other accepts. Context parallel is refused here too, where the figure that replaces
it (the longest response this layout fits without it) can be worked out.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from bapo_megatron.config import JobConfig, ParallelConfig
from bapo_megatron.errors import ConfigError
from bapo_megatron.models.spec import ModelSpec, check_layout
from bapo_megatron.trainer.memory.estimate import layer_params, recomputed_layers, trainer_memory

GIB = 2**30
RESERVE_BYTES = 3 * GIB
"""Kept out of the estimate's reach on every GPU, outside PyTorch's allocator: what the driver keeps
of the GPU's nominal size (an 80 GiB H100 reports 79.2 GiB to CUDA), the CUDA context with the
cuBLAS and Transformer Engine workspaces (about 1 GiB), and NCCL's buffers for the communicators a
job opens (tensor, pipeline, data, expert parallel: about 1 GiB)."""
RESERVE_SHARE = 0.05
"""And this share of the GPU: the caching allocator's fragmentation (micro-batches of varying
shapes free blocks that later requests of other sizes cannot reuse)."""
NO_GPU_BYTES = 80 * GIB
"""The GPU that figures quoted without a GPU at hand (a refusal on the CPU) are worked out for: an H100's."""


def usable_bytes(gpu_bytes: int) -> int:
    """What the estimated peak may reach on a GPU of nominal size gpu_bytes (73 GiB of an 80 GiB H100)."""
    return max(int(gpu_bytes * (1 - RESERVE_SHARE)) - RESERVE_BYTES, 0)


def local_gpu_bytes() -> int | None:
    """The nominal size of this process's GPU (LOCAL_RANK's), None without CUDA: what CUDA reports,
    up to a whole GiB (an H100's 79.2 GiB is the 80 a dry run's --gpu-memory-gib names), so that
    the run and the dry run fit the same size. A job's GPUs are of one kind: every rank resolves
    `auto` alike."""
    import torch

    if not torch.cuda.is_available():
        return None
    device = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    return nominal_bytes(torch.cuda.get_device_properties(device).total_memory)


def nominal_bytes(reported: int) -> int:
    """A GPU's size as sold, from what CUDA reports (the driver keeps a little): up to a whole GiB."""
    return -(-reported // GIB) * GIB


def stage_size(spec: ModelSpec, parallel: ParallelConfig) -> int:
    """The layers of one pipeline stage (virtual stage): what full recompute counts in."""
    return spec.num_layers // (parallel.pipeline * (parallel.virtual_pipeline or 1))


def recompute_options(cfg: JobConfig, spec: ModelSpec) -> list[ParallelConfig]:
    """The settings `auto` tries, least recompute first (under routing replay too: a recomputed
    router replays its micro-batch's routes, trainer/routing.py)."""
    p = dataclasses.replace(cfg.parallel, recompute_layers=None)
    options = [dataclasses.replace(p, recompute="none"), dataclasses.replace(p, recompute="selective")]
    layers = range(1, stage_size(spec, p) + 1)
    return options + [dataclasses.replace(p, recompute="full", recompute_layers=k) for k in layers]


def peak_bytes(cfg: JobConfig, spec: ModelSpec, parallel: ParallelConfig, data_parallel: int) -> int:
    """The estimated peak of the most loaded GPU with `parallel` for cfg.parallel (GPU runs use the
    distributed optimizer; a KL loss keeps its reference model)."""
    reference = cfg.algo.kl_coef > 0
    return trainer_memory(
        spec, cfg.model, parallel, data_parallel, distributed_optimizer=True, reference=reference
    ).peak


def least_recompute(
    cfg: JobConfig, spec: ModelSpec, data_parallel: int, gpu_bytes: int, tokens: int | None = None
) -> ParallelConfig | None:
    """The first of recompute_options whose peak fits a GPU of gpu_bytes, with micro-batches of
    `tokens` (default: parallel.max_tokens_per_microbatch); None when none does."""
    usable = usable_bytes(gpu_bytes)
    for option in recompute_options(cfg, spec):
        if tokens is not None:
            option = dataclasses.replace(option, max_tokens_per_microbatch=tokens)
        if peak_bytes(cfg, spec, option, data_parallel) <= usable:
            return option
    return None


def recompute_cost(spec: ModelSpec, parallel: ParallelConfig, tokens: int) -> float:
    """About how much more compute a training step takes with parallel.recompute than without, for
    sequences of `tokens`: a step is a forward and a backward (twice the forward), full recompute
    runs each recomputed layer's forward once more, selective every layer's core attention."""
    if parallel.recompute == "none":
        return 0.0
    attention = 2 * spec.num_heads * spec.head_dim * tokens  # QK^T and AV per token, over the causal half

    def layer(i: int) -> float:  # a layer's forward FLOPs per token: its matmuls (the experts a token visits)
        n = layer_params(spec, i)
        active = n.experts * spec.moe.top_k // spec.moe.num_experts if n.experts else 0
        return 2 * (n.tensor + n.router + active) + attention

    forward = sum(layer(i) for i in range(spec.num_layers)) + 2 * spec.hidden_size * spec.vocab_size  # + the logits
    if parallel.recompute == "selective":
        extra = spec.num_layers * attention
    else:
        rerun = {i for s in range(parallel.pipeline) for i in recomputed_layers(spec, parallel, s)}
        extra = sum(layer(i) for i in rerun)
    return extra / (3 * forward)


def describe(spec: ModelSpec, parallel: ParallelConfig, tokens: int) -> str:
    """A recompute setting in words, with its cost for sequences of `tokens`."""
    if parallel.recompute == "none":
        return "none"
    if parallel.recompute == "selective":
        what = "selective: core attention of every layer"
    else:
        size = stage_size(spec, parallel)
        what = f"full: {parallel.recompute_layers or size} of the {size} layers of each pipeline stage"
    return f"{what} run again in the backward pass, about +{recompute_cost(spec, parallel, tokens):.0%} step compute"


@dataclass(frozen=True)
class Reach:
    """The longest response a layout fits on a GPU."""

    tokens: int
    """Response tokens (0: not even one), beside prompt_room(cfg) tokens of prompt."""
    parallel: ParallelConfig
    """The least recompute that fits them, micro-batches of prompt + response tokens."""
    context: bool
    """The model's context, not memory, set the figure."""


def prompt_room(cfg: JobConfig) -> int:
    """The prompt tokens a micro-batch leaves beside a whole response: parallel.max_tokens_per_microbatch
    less rollout.sampling.max_new_tokens (longer prompts are dropped)."""
    return max(cfg.parallel.max_tokens_per_microbatch - cfg.rollout.sampling.max_new_tokens, 0)


def longest_response(
    cfg: JobConfig, spec: ModelSpec, data_parallel: int, gpu_bytes: int, recompute: bool = True
) -> Reach:
    """The most response tokens whose micro-batch (response and prompt room) fits a GPU of gpu_bytes
    with the most recompute `auto` may choose (recompute=False: with none), up to the model's context."""
    room, usable = prompt_room(cfg), usable_bytes(gpu_bytes)
    options = recompute_options(cfg, spec)
    most = options[-1] if recompute else options[0]

    def fits(response: int) -> bool:
        option = dataclasses.replace(most, max_tokens_per_microbatch=room + response)
        return peak_bytes(cfg, spec, option, data_parallel) <= usable

    context = spec.max_position_embeddings - room
    low, high = 0, context  # low fits (or is 0); nothing above high does
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    least = least_recompute(cfg, spec, data_parallel, gpu_bytes, room + low) if recompute and low else None
    return Reach(low, least or dataclasses.replace(most, max_tokens_per_microbatch=room + low), 0 < low == context)


@dataclass(frozen=True)
class Fitted:
    """A job fitted to its GPUs."""

    cfg: JobConfig
    """The job, parallel.recompute concrete."""
    line: str
    """Its recompute, why, and what it costs (the dry run prints it; the run, when it chose it)."""
    fits: bool
    """Whether the estimated peak fits the GPU (False only for a recompute the user set)."""


def fit_to_gpu(cfg: JobConfig, spec: ModelSpec, world_size: int, gpu_bytes: int | None) -> Fitted:
    """`cfg` with parallel.recompute resolved for GPUs of gpu_bytes (None: no GPU, "auto" is "none");
    ConfigError when context parallel is asked for, or when the estimated peak does not fit (with
    the recompute set by hand, or with anything "auto" may choose) and parallel.over_memory does
    not ask to go on: then `fits` is False and `line` says so, for a warning."""
    p = cfg.parallel
    check_layout(spec, p.tensor, p.pipeline, p.virtual_pipeline, p.expert, p.sequence_parallel)
    refuse_context_parallel(cfg, spec, world_size, gpu_bytes)
    dp, tokens = p.data_parallel_size(world_size), p.max_tokens_per_microbatch
    if gpu_bytes is None:
        if p.recompute != "auto":
            return Fitted(cfg, f"activation recompute: {describe(spec, p, tokens)}", True)
        resolved = dataclasses.replace(cfg, parallel=dataclasses.replace(p, recompute="none"))
        return Fitted(resolved, "activation recompute: auto chose none (no GPU here: no memory to fit)", True)
    room = f"the {usable_bytes(gpu_bytes) / GIB:.1f} GiB usable of each {gpu_bytes / GIB:.0f} GiB GPU"
    if p.recompute != "auto":
        peak = peak_bytes(cfg, spec, p, dp)
        fits = peak <= usable_bytes(gpu_bytes)
        if not fits and not p.over_memory:
            raise ConfigError("parallel.recompute", p.recompute, does_not_fit(cfg, spec, world_size, gpu_bytes))
        line = f"activation recompute: {describe(spec, p, tokens)}; estimated peak {peak / GIB:.1f} GiB "
        line += f"fits {room}" if fits else f"does NOT fit {room}: run anyway (parallel.over_memory=true)"
        return Fitted(cfg, line, fits)
    chosen = least_recompute(cfg, spec, dp, gpu_bytes)
    if chosen is None and not p.over_memory:
        raise ConfigError("parallel.recompute", "auto", does_not_fit(cfg, spec, world_size, gpu_bytes))
    if chosen is None:
        most = recompute_options(cfg, spec)[-1]
        peak = peak_bytes(cfg, spec, most, dp)
        line = (
            f"activation recompute: auto chose the most there is, {describe(spec, most, tokens)}; its estimated "
            f"peak {peak / GIB:.1f} GiB does NOT fit {room}: run anyway (parallel.over_memory=true)"
        )
        return Fitted(dataclasses.replace(cfg, parallel=most), line, False)
    peak = peak_bytes(cfg, spec, chosen, dp)
    line = (
        f"activation recompute: auto chose {describe(spec, chosen, tokens)}; the least whose estimated peak, "
        f"{peak / GIB:.1f} GiB, fits {room} (less {RESERVE_BYTES / GIB:.0f} GiB and {RESERVE_SHARE:.0%} kept for "
        "the driver, the CUDA context, NCCL and the allocator)"
    )
    return Fitted(dataclasses.replace(cfg, parallel=chosen), line, True)


def does_not_fit(cfg: JobConfig, spec: ModelSpec, world_size: int, gpu_bytes: int) -> str:
    """Why the recompute set by hand, or (with "auto") nothing it may choose, fits; and what would
    (parallel.over_memory=true runs it anyway)."""
    p = cfg.parallel
    dp = p.data_parallel_size(world_size)
    chosen = least_recompute(cfg, spec, dp, gpu_bytes) if p.recompute != "auto" else None
    most = p if p.recompute != "auto" else recompute_options(cfg, spec)[-1]
    peak = peak_bytes(cfg, spec, most, dp)
    remedies = [f"{change} ({where})" for change, where in _layouts_that_fit(cfg, spec, world_size, gpu_bytes)]
    if chosen is not None:  # the least recompute that fits, before any change of layout
        remedies.insert(0, f"parallel.recompute=auto ({describe(spec, chosen, p.max_tokens_per_microbatch)})")
    reach = longest_response(cfg, spec, dp, gpu_bytes, recompute=p.recompute != "none")
    if reach.tokens:
        budget = prompt_room(cfg) + reach.tokens
        auto = " and parallel.recompute=auto" if p.recompute not in ("auto", "none") else ""
        remedies.append(
            f"parallel.max_tokens_per_microbatch={budget} or less{auto} (rollout.sampling.max_new_tokens="
            f"{reach.tokens} after prompts of up to {prompt_room(cfg)} tokens)"
        )
    what = describe(spec, most, p.max_tokens_per_microbatch)
    if p.recompute == "auto":
        what = f"the most recompute there is ({what})"
    else:
        what = f"parallel.recompute={p.recompute}" + (f" ({what})" if p.recompute != "none" else "")
    return (
        f"does not fit: with {what} the estimated peak is {peak / GIB:.1f} GiB a GPU, more than the "
        f"{usable_bytes(gpu_bytes) / GIB:.1f} GiB usable of each {gpu_bytes / GIB:.0f} GiB GPU; it would fit with "
        + ("; or ".join(remedies) or "more GPUs for each model replica (parallel.tensor, parallel.pipeline)")
        + ". parallel.over_memory=true runs it anyway"
    )


def _layouts_that_fit(cfg: JobConfig, spec: ModelSpec, world_size: int, gpu_bytes: int) -> list[tuple[str, str]]:
    """(override, where) for sequence parallel, twice the pipeline and twice the tensor parallel,
    those of them that fit, on this many GPUs where they divide it, else on just enough."""
    p = cfg.parallel
    changes = [("parallel.sequence_parallel=true", {"sequence_parallel": True})] if p.tensor > 1 else []
    changes = [] if p.sequence_parallel else changes
    changes += [
        (f"parallel.pipeline={2 * p.pipeline}", {"pipeline": 2 * p.pipeline}),
        (f"parallel.tensor={2 * p.tensor}", {"tensor": 2 * p.tensor, "sequence_parallel": True}),
    ]
    found = []
    for change, fields in changes:
        try:
            q = dataclasses.replace(p, **fields)
            check_layout(spec, q.tensor, q.pipeline, q.virtual_pipeline, q.expert, q.sequence_parallel)
            world = world_size if world_size % (q.tensor * q.pipeline) == 0 else q.tensor * q.pipeline
            dp = q.data_parallel_size(world)
        except ConfigError:
            continue
        chosen = least_recompute(dataclasses.replace(cfg, parallel=q), spec, dp, gpu_bytes)
        if chosen is not None:
            found.append(
                (change, f"{world} GPUs, DP {dp}: recompute {describe(spec, chosen, q.max_tokens_per_microbatch)}")
            )
    return found


def refuse_context_parallel(cfg: JobConfig, spec: ModelSpec, world_size: int, gpu_bytes: int | None) -> None:
    """ConfigError for parallel.context > 1, naming the longest response the layout fits without it."""
    p = cfg.parallel
    if p.context == 1:
        return
    gpu = gpu_bytes or NO_GPU_BYTES
    plain = dataclasses.replace(cfg, parallel=dataclasses.replace(p, context=1))
    dp = max(world_size // (p.tensor * p.pipeline), 1)  # the CP ranks as data parallel
    reach = longest_response(plain, spec, dp, gpu)
    where = f"on {gpu / GIB:.0f} GiB GPUs" if gpu_bytes else f"on {gpu / GIB:.0f} GiB GPUs (no GPU here)"
    longer = " (the model's context)" if reach.context else ""
    more = "" if reach.context else " (longer responses: more parallel.tensor or parallel.pipeline)"
    raise ConfigError(
        "parallel.context",
        p.context,
        "context parallel is not supported: Megatron-Core 0.16.1 runs it only with Transformer Engine's "
        "attention and at least two GPUs a group, and this trainer does not yet hand each CP rank its "
        f"share of every sequence. Without it, TP {p.tensor} x PP {p.pipeline} x DP {dp} fits responses of up "
        f"to {reach.tokens:,} tokens{longer} {where}, after prompts of up to {prompt_room(cfg):,} (recompute "
        f"{describe(spec, reach.parallel, reach.parallel.max_tokens_per_microbatch)}): set parallel.context=1{more}",
    )

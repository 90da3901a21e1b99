"""`bapo-train CONFIG --dry-run`: what a run would do, planned by the run's own functions, building nothing.

    print(dry_run_command(args, cfg))      # the world chosen as below, then dry_run's report
    print(dry_run(cfg, 8, 80 * GIB))       # the resolved config, layout, rollout, data and memory

The world it plans for: --world-size, else $WORLD_SIZE (a launcher's), else the Slurm script that
runs the config (cli/slurm.py: on the nodes the config's own sbatch command states, where it gives
one), else the smallest the layout needs. The memory figures come from
trainer/memory/ (exact parameter counts, the rest estimated) and need neither a GPU nor Megatron.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path

from bapo_megatron.cli.dry_run_memory import GIB, memory_lines
from bapo_megatron.cli.slurm import SlurmPlan, find_slurm_plan
from bapo_megatron.config import JobConfig, RolloutConfig, dump_config
from bapo_megatron.models.spec import ModelSpec
from bapo_megatron.plan import RunPlan, plan_run


@dataclass(frozen=True)
class PlannedWorld:
    """The trainer processes a dry run plans for, and how they were chosen."""

    size: int
    slurm: SlurmPlan | None
    """The script whose world it is: the engines go where it places them."""
    notes: tuple[str, ...] = ()
    """How the size was chosen when no one gave it (the report's first lines)."""


def planned_world(args: argparse.Namespace, cfg: JobConfig) -> PlannedWorld:
    """--world-size, else $WORLD_SIZE, else the world of the Slurm script that runs the config (its
    trainer nodes x its GPUs a node), else the smallest the config's parallel sizes need (TP x PP x CP);
    a size given that is the script's world still places the engines as the script does."""
    search = find_slurm_plan(Path(args.config)) if args.config else None
    plan = search.plan if search is not None else None
    given = args.world_size or int(os.environ.get("WORLD_SIZE", 0))
    if given:
        return PlannedWorld(given, plan if plan is not None and plan.world_size == given else None)
    if plan is not None:
        how = "runs this config" if plan.default else f"runs it (CONFIG={args.config} sbatch {plan.name})"
        if plan.stated is not None:  # the preset's own command, on other nodes than the script's default
            how = f"runs it as its comments say ({plan.stated})"
        engines = (  # as the script runs them with COLOCATE=1: its rollout nodes are not asked for
            f"engines colocated on the {plan.train_nodes} trainer node(s), no rollout node"
            if cfg.rollout.engines.colocate
            else f"{plan.rollout_nodes} rollout node(s)"
        )
        note = (
            f"no --world-size: planned for {plan.world_size} trainer processes, as {plan.name} {how}: "
            f"{plan.train_nodes} trainer node(s) x {plan.gpus_per_node} GPUs, {engines}"
        )
        return PlannedWorld(plan.world_size, plan, (note,))
    p = cfg.parallel
    size = p.tensor * p.pipeline * p.context
    notes = [search.none_found()] if search is not None else []
    if size > 1:
        notes.insert(
            0,
            f"no --world-size: planned for the smallest world the layout needs, TP {p.tensor} x PP {p.pipeline} x "
            f"CP {p.context} = {size} trainer processes (data parallel 1); --world-size N plans another",
        )
    return PlannedWorld(size, None, tuple(notes))


def dry_run_command(args: argparse.Namespace, cfg: JobConfig) -> str:
    """`bapo-train CFG --dry-run`: how the world was chosen (when no one gave it), then dry_run. A
    preset that a Slurm script runs is planned as the script runs it (its trainer nodes, its engines
    on rollout nodes), unless --world-size or $WORLD_SIZE plans another world."""
    world = planned_world(args, cfg)
    gpus_per_node = world.slurm.gpus_per_node if world.slurm is not None else args.gpus_per_node
    text = dry_run(cfg, world.size, int(args.gpu_memory_gib * GIB), gpus_per_node, world.slurm)
    return "\n".join([*(f"# {note}" for note in world.notes), text])


def dry_run(
    cfg: JobConfig, world_size: int, gpu_bytes: int, gpus_per_node: int = 8, slurm: SlurmPlan | None = None
) -> str:
    """What `bapo-train` would do with `cfg` on `world_size` trainer processes (one a GPU, nodes of
    gpus_per_node), without doing it; with `slurm`, the engines where that script places them. It
    plans as the run plans (plan.plan_run: recompute fitted to a GPU of gpu_bytes, then the run's
    checks), so it refuses what the run refuses, this machine's precision support aside."""
    from bapo_megatron.rollout.inputs import dry_run_check

    plan = plan_run(cfg, world_size, gpu_bytes, machine=False)
    out = ["# resolved config", dump_config(plan.cfg).rstrip(), "", "# layout", *_layout_lines(plan)]
    out += _rollout_lines(plan.cfg.rollout, world_size, gpus_per_node, slurm)
    out += ["", "# data (the run's own checks)", *dry_run_check(plan.cfg, plan.spec)]
    out += ["", f"# memory per GPU (estimate; GPU of {gpu_bytes / GIB:.0f} GiB)", *memory_lines(plan, gpu_bytes)]
    return "\n".join(out)


def _layout_lines(plan: RunPlan) -> list[str]:
    """The trainer's layout, a step's samples and micro-batches, the experts, the recompute."""
    cfg, dp = plan.cfg, plan.data_parallel
    r, updates = cfg.rollout, cfg.algo.updates_per_batch
    samples = r.prompts_per_step * r.samples_per_prompt // updates
    out = [
        f"trainer: {plan.world_size} process{'es' if plan.world_size != 1 else ''}, {plan.layout}",
        f"per optimizer step: {samples} samples, {math.ceil(samples / dp)} per data-parallel rank "
        f"(responses up to {r.sampling.max_new_tokens} tokens); {updates} optimizer "
        f"step{'s' if updates != 1 else ''} per batch",
        _microbatch_line(cfg, plan.spec, samples, dp),
    ]
    if plan.spec.moe is not None:
        out.append(_experts_layout(plan))
    return [*out, plan.recompute_line]


def _microbatch_line(cfg: JobConfig, spec: ModelSpec, samples: int, dp: int) -> str:
    """How a rank's samples make micro-batches (trainer/packing.py), and how many at worst: every
    sample as long as a micro-batch allows."""
    from bapo_megatron.trainer.packing import microbatch_layout, packing_leak, packs

    p, r = cfg.parallel, cfg.rollout
    longest = r.sampling.max_new_tokens + (cfg.data.max_prompt_tokens or p.max_tokens_per_microbatch)
    longest = min(longest, p.max_tokens_per_microbatch)
    layout = microbatch_layout(spec, cfg.model, p, 1)
    plan = layout.plan([longest] * samples, dp, p.pipeline if p.virtual_pipeline else 1)
    if packs(spec, cfg.model, p):
        attention = "THD with cu_seqlens" if cfg.model.transformer_impl == "transformer_engine" else "a masked row"
        how = f"packed rows of whole samples end to end, attention inside each sample ({attention})"
    else:
        leak = packing_leak(spec, cfg.model)
        how = "padded rows of one sample each"
        if leak is not None:
            how += f" (not packed: {spec.architecture}'s {leak} would mix the samples of a packed row)"
        if p.virtual_pipeline:
            how += ", padded to the step's longest (the virtual pipeline's one shape)"
    return (
        f"micro-batches: {how}, at most {p.max_tokens_per_microbatch} tokens each (parallel.packing={p.packing}); "
        f"at worst (every sample {longest} tokens) {len(plan[0])} a data-parallel rank and optimizer step"
    )


def _experts_layout(plan: RunPlan) -> str:
    """Where a mixture-of-experts model's experts live, in one line."""
    spec, p, dp = plan.spec, plan.cfg.parallel, plan.data_parallel
    moe = spec.moe
    return (
        f"experts: {moe.num_experts} a layer in {len(moe.sparse_layers)} of {spec.num_layers} layers, "
        f"top-{moe.top_k}; EP {p.expert}: {moe.num_experts // p.expert} whole experts on each rank (expert TP 1), "
        f"their optimizer state sharded over expert data parallel {p.tensor * dp // p.expert} (the rest over DP {dp})"
    )


def _rollout_lines(r: RolloutConfig, world_size: int, gpus_per_node: int, slurm: SlurmPlan | None) -> list[str]:
    """Where the batches come from: replayed, or generated on a schedule by engines placed somewhere."""
    if r.replay is not None:
        return [f"rollout: replayed batches from {r.replay} (no engine)"]
    out = [_schedule(r)]
    if r.filter_groups.enabled:
        f = r.filter_groups
        out.append(
            "dynamic sampling (rollout.filter_groups): groups whose rewards are all equal are set aside and "
            f"replaced by new prompts, up to {f.max_extra_rounds} more steps' worth of groups a step "
            f"(generation up to {1 + f.max_extra_rounds}x a step's)"
        )
    return out + _engines(r, world_size, gpus_per_node, slurm)


def _schedule(r: RolloutConfig) -> str:
    """How generation runs against training, in one line."""
    k = r.max_staleness
    bound = f"no token more than {k} version(s) older than the policy it trains" + (
        " (older ones masked out of the loss)" if r.mask_stale_prefix else " (older samples generated again)"
    )
    if r.mode == "async":
        queued, generating = (k + 1) * r.prompts_per_step, math.ceil(r.prompts_per_step * r.oversample)
        return (
            f"rollout: mode async, max_staleness K={k}: the engines generate while the trainer trains; at most "
            f"{queued} groups queued or generating, {generating} generating; weight updates pause them "
            f"({r.pause_mode}); {bound}"
        )
    how = (
        "deterministic rounds"
        if r.deterministic
        else (
            f"partial rollout ({r.partial.mode}, {r.token_budget} tokens a request)"
            if r.partial.enabled
            else "whole responses"
        )
    )
    return f"rollout: mode sync, max_staleness K={k}: each step generates, then trains; {how}; {bound}"


def _engines(r: RolloutConfig, world_size: int, gpus_per_node: int, slurm: SlurmPlan | None) -> list[str]:
    """Where the engines run: given (rollout.engines.urls), where the Slurm script puts them, or
    beside the trainer on the driver's node."""
    e = r.engines
    if e.urls:
        return [f"engines: {len(e.urls)} running elsewhere: {', '.join(e.urls)}"]
    if slurm is not None and not e.colocate and slurm.rollout_nodes > 0:
        count = slurm.rollout_nodes * slurm.engines_per_node
        differs = "" if count == e.servers else f" (the script's count, not rollout.engines.servers={e.servers})"
        used = slurm.engines_per_node * e.tensor_parallel
        room = "" if used <= slurm.gpus_per_node else f": they need {used} GPUs a node, which has {slurm.gpus_per_node}"
        return [
            f"engines: {count} {e.kind} server(s){differs}, TP {e.tensor_parallel} each, on rollout nodes as "
            f"{slurm.name} places them: {slurm.rollout_nodes} node(s) x {slurm.engines_per_node} server(s), "
            f"{used} of each node's {slurm.gpus_per_node} GPUs{room}; the script passes their URLs to the trainer "
            "(rollout.engines.urls; COLOCATE=1 puts them on the trainer's GPUs instead)"
        ]
    if e.colocate:
        return _colocated(r, world_size, gpus_per_node)
    if e.kind == "embedded":
        where = "in processes of their own on this machine's CPU, on 127.0.0.1"
    else:
        where = "colocated with the trainer" if e.colocate else f"on GPUs of their own, listening on {e.host}"
    first = e.first_port
    ports = "a free port each" if first is None else f"ports {first}..{first + e.servers - 1}"
    out = [f"engines: {e.servers} {e.kind} server(s), TP {e.tensor_parallel} each, {ports}, {where}"]
    if e.kind == "sglang":
        out.append(_sglang_placement(r, min(world_size, gpus_per_node), gpus_per_node))
    return out


def _colocated(r: RolloutConfig, world_size: int, gpus_per_node: int) -> list[str]:
    """Colocated engines on every node of the trainer (engines/fleet.colocated_servers): how many a
    node, on which GPUs, fed by which trainer ranks, and the GPUs that wait during generation."""
    from bapo_megatron.engines.fleet import block_layout, colocated_servers

    e = r.engines
    layout = block_layout(world_size, gpus_per_node)
    head = f"engines: {e.servers} {e.kind} server(s), TP {e.tensor_parallel} each, colocated with the trainer"
    try:
        servers = colocated_servers(e.servers, e.tensor_parallel, layout)
    except ValueError as err:
        return [f"{head}: cannot place them ({err})"]
    first = e.first_port
    ports = "a free port each" if first is None else f"ports {first}..{first + e.servers - 1}"
    per_node = e.servers // len(layout)
    out = [f"{head} on every node: {len(layout)} node(s) x {per_node} server(s), {ports}"]
    last = len(layout) - 1
    for node in sorted({0, last}) if last > 2 else range(len(layout)):
        if node == last and last > 2:
            out.append(f"  nodes 1..{last - 1} likewise, {per_node} server(s) each")
        here = ", ".join(
            f"server {s.index} on GPUs {_span(s.gpus)} (weights from trainer ranks {_span(s.ranks)})"
            for s in servers
            if s.node == node
        )
        out.append(f"  node {node}: {here}")
    out.append(
        "colocated weight updates: every trainer rank gathers the whole model's buckets (its tensor- and "
        "expert-parallel groups), and each server's TP rank loads, by CUDA IPC, the copy of the trainer rank "
        "on its GPU, on its node"
    )
    idle = world_size - e.servers * e.tensor_parallel
    if idle > 0:
        fits = len(layout) * (min(len(ranks) for ranks in layout) // e.tensor_parallel)
        out.append(
            f"colocated: {idle} of the trainer's {world_size} GPUs run no engine and wait during generation; "
            f"rollout.engines.servers={fits} uses every GPU"
        )
    return out


def _span(numbers: tuple[int, ...]) -> str:
    return str(numbers[0]) if len(numbers) == 1 else f"{numbers[0]}-{numbers[-1]}"


def _sglang_placement(r: RolloutConfig, trainer_gpus: int, node_gpus: int) -> str:
    from bapo_megatron.engines.sglang_launcher import gpu_placement

    try:
        bases = gpu_placement(r, trainer_gpus, node_gpus)
    except ValueError as err:
        return f"SGLang servers on the driver's node: cannot place them ({err})"
    tp = r.engines.tensor_parallel
    gpus = ", ".join(f"{b}" if tp == 1 else f"{b}-{b + tp - 1}" for b in bases)
    return (
        f"SGLang servers on the driver's node ({node_gpus} GPUs, trainer ranks on GPUs 0-{trainer_gpus - 1}): "
        f"GPUs {gpus}"
    )

"""The `bapo-train` command line: arguments, --help-config (from the config dataclasses) and --dry-run.

    bapo-train CONFIG.yaml [key=value ...]          # same as python -m bapo_megatron.train
    bapo-train --help-config                        # every field: type, default, what it does
    bapo-train CONFIG.yaml --dry-run [key=value]    # resolved config, layout, engines, memory; builds nothing

The field list is generated from the dataclasses and their field docstrings, never kept by
hand. The dry run's memory figures come from trainer/memory.py (exact parameter counts, the
rest estimated) and need neither a GPU nor Megatron.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import os
import re
import sys
import textwrap
import typing

from bapo_megatron.config import SECTION_PRESETS, JobConfig, ParallelConfig, RolloutConfig, dump_config

if typing.TYPE_CHECKING:
    from bapo_megatron.common.model_spec import ModelSpec

USAGE = "bapo-train [CONFIG.yaml] [key=value ...] [--dry-run] [--world-size N] [--gpu-memory-gib G]"
GIB = 2**30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line's options (None: it had no arguments at all)."""
    parser = argparse.ArgumentParser(
        prog="bapo-train",
        usage=USAGE,
        description="BAPO reinforcement learning on Megatron-Core: rollout, rewards, policy update, weight sync.",
        epilog="Overrides are dotted config fields (algo.bapo.target_rho=0.4); --help-config lists them all. "
        "torchrun and srun start the same command on every rank. Relative paths, in the file or an "
        "override, resolve against the working directory: run the examples from the repository root.",
    )
    parser.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value", help="a YAML file, then overrides")
    parser.add_argument("--help-config", action="store_true", help="list every config field and exit")
    parser.add_argument("--dry-run", action="store_true", help="print what would run and the memory it needs; exit")
    parser.add_argument(
        "--world-size",
        type=int,
        help="the trainer processes --dry-run plans for (default: $WORLD_SIZE, else as the slurm/ script "
        "that runs the config does, else the fewest the layout needs, TP x PP x CP); the run itself takes "
        "its launcher's world",
    )
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="GPU size for --dry-run (default 80: H100)")
    parser.add_argument(
        "--gpus-per-node", type=int, default=8, help="GPUs of the driver's node for --dry-run (default 8)"
    )
    if argv is None:  # the command line, given nothing: the built-in defaults have no prompts
        parser.print_usage(sys.stderr)
        parser.exit(
            2,
            "bapo-train: give a config, e.g. `bapo-train examples/tiny_online.yaml` from the repository "
            "root (--help: the options; --help-config: every field)\n",
        )
    args = parser.parse_intermixed_args(argv)  # overrides before or after the options
    args.config = args.args[0] if args.args and "=" not in args.args[0] else None
    args.overrides = args.args[1:] if args.config else args.args
    bad = [a for a in args.overrides if "=" not in a]
    if bad:
        parser.error(f"{bad[0]!r} is neither the config file (first) nor a key=value override")
    return args


# ----------------------------------------------------------------------------------------------
# --help-config


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it in the class body), inherited ones too."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError):
            continue
        for node, following in zip(body, [*body[1:], None], strict=True):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                doc = (
                    following.value.value
                    if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    else ""
                )
                docs[node.target.id] = " ".join(str(doc).split())
    return docs


def _type_name(hint) -> str:
    text = str(hint).replace("typing.", "").replace("NoneType", "None")
    return text if "[" in text or "|" in text else getattr(hint, "__name__", text)


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "(section)" if dataclasses.is_dataclass(value) else repr(value)
    return "(required)"


def config_fields(cls: type = JobConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted name, type, default, doc) of every field, sections expanded; a section that takes a
    `preset: NAME` key lists it first."""
    hints, docs, rows = typing.get_type_hints(cls), field_docs(cls), []
    if cls in SECTION_PRESETS:
        names = ", ".join(sorted(SECTION_PRESETS[cls]))
        doc = f"A named set of this section's fields ({names}), which its other keys override (None: the defaults)."
        rows.append((prefix + "preset", "str | None", "None", doc))
    for f in dataclasses.fields(cls):
        name, hint = prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(hint):
            rows += config_fields(hint, name + ".")
        else:
            rows.append((name, _type_name(hint), _default(f), docs.get(f.name, "")))
    return rows


def help_config() -> str:
    lines = ["Every field (dotted name, type, default), settable in the YAML file or as key=value:", ""]
    for name, type_name, default, doc in config_fields():
        lines.append(f"{name}: {type_name} = {default}")
        if doc:
            lines.extend("    " + line for line in textwrap.wrap(doc, 96))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# --dry-run


def dry_run_command(args: argparse.Namespace, cfg: JobConfig) -> str:
    """`bapo-train CFG --dry-run`: the world it plans for (said when no one gave it), then dry_run.
    A preset that a slurm/*.sh script runs is planned as the script runs it (its trainer nodes, its
    engines on rollout nodes), unless --world-size or $WORLD_SIZE plans another world."""
    size, assumed = world_size(args, cfg)
    plan = slurm_plan(args.config) if args.config else None
    plan = plan if plan is not None and plan.world_size == size else None
    gpus_per_node = plan.gpus_per_node if plan is not None else args.gpus_per_node
    text = dry_run(cfg, size, int(args.gpu_memory_gib * GIB), gpus_per_node, plan)
    return f"# {assumed}\n{text}" if assumed else text


def dry_run(
    cfg: JobConfig, world_size: int, gpu_bytes: int, gpus_per_node: int = 8, slurm: SlurmPlan | None = None
) -> str:
    """What `bapo-train` would do with `cfg` on `world_size` trainer processes (one a GPU, nodes of
    gpus_per_node), without doing it; with `slurm`, the engines where that script places them. It
    refuses what the run refuses, by the run's own functions: fit_to_gpu (recompute, a peak over the
    GPU) and preflight.validate (layout, batch split, a sample against the micro-batch, the run's
    inputs), this machine's precision support aside."""
    from bapo_megatron.preflight import model_spec, validate
    from bapo_megatron.rollout.inputs import dry_run_check
    from bapo_megatron.trainer.fit import fit_to_gpu, reach_line
    from bapo_megatron.trainer.memory import trainer_memory

    spec = model_spec(cfg)
    fitted = fit_to_gpu(cfg, spec, world_size, gpu_bytes)  # the run's own check (job.py), on a GPU of gpu_bytes
    cfg, p = fitted.cfg, fitted.cfg.parallel
    dp = p.data_parallel_size(world_size)
    validate(cfg, spec, world_size, machine=False)  # as job.py, after fitting; the GPU's precision is the run's
    r = cfg.rollout
    samples = r.prompts_per_step * r.samples_per_prompt // cfg.algo.updates_per_batch
    out = ["# resolved config", dump_config(cfg).rstrip(), "", "# layout"]
    out.append(
        f"trainer: {world_size} process{'es' if world_size != 1 else ''} = TP {p.tensor} x PP {p.pipeline} x "
        f"VPP {p.virtual_pipeline or 1} "
        f"(virtual stages) x CP {p.context} x DP {dp}"
    )
    out.append(
        f"per optimizer step: {samples} samples, {math.ceil(samples / dp)} per data-parallel rank "
        f"(responses up to {r.sampling.max_new_tokens} tokens); {cfg.algo.updates_per_batch} optimizer "
        f"step{'s' if cfg.algo.updates_per_batch != 1 else ''} per batch"
    )
    out.append(_microbatch_line(cfg, samples, dp))
    if spec.moe is not None:
        out.append(_experts_layout(spec, p, dp))
    out.append(fitted.line)
    if r.replay is not None:
        out.append(f"rollout: replayed batches from {r.replay} (no engine)")
    else:
        out.append(_schedule(r))
        if r.filter_groups.enabled:
            f = r.filter_groups
            out.append(
                "dynamic sampling (rollout.filter_groups): groups whose rewards are all equal are set aside and "
                f"replaced by new prompts, up to {f.max_extra_rounds} more steps' worth of groups a step "
                f"(generation up to {1 + f.max_extra_rounds}x a step's)"
            )
        out += _engines(r, world_size, gpus_per_node, slurm)
    out += ["", "# data (the run's own checks)", *dry_run_check(cfg, spec)]
    out += ["", f"# memory per GPU (estimate; GPU of {gpu_bytes / GIB:.0f} GiB)"]
    # GPU runs use Megatron's distributed optimizer (trainer/megatron_config.py): no other to estimate
    m = trainer_memory(spec, cfg.model, p, dp, distributed_optimizer=True, reference=cfg.algo.kl_coef > 0)
    out.append(
        f"trainer, distributed optimizer: parameters {m.params / GIB:.2f} GiB, gradients {m.grads / GIB:.2f} GiB, "
        f"optimizer {m.optimizer / GIB:.2f} GiB, activations of the micro-batches in flight "
        f"{m.activations / GIB:.2f} GiB; peak {m.peak / GIB:.2f} GiB"
    )
    if m.reference:
        out.append(f"KL loss (algo.kl_coef): the reference model, {m.reference / GIB:.2f} GiB, counted in the peak")
    out.append(reach_line(cfg, spec, dp, gpu_bytes))
    if spec.moe is not None:
        out += _moe_memory(cfg, spec, dp)
    if r.replay is None and r.engines.kind == "sglang":
        out.append(_sglang_memory(cfg, spec, gpu_bytes, dp))
    return "\n".join(out)


def _microbatch_line(cfg: JobConfig, samples: int, dp: int) -> str:
    """How a rank's samples make micro-batches (trainer/packing.py), and how many at worst: every
    sample as long as a micro-batch allows."""
    from bapo_megatron.trainer.packing import microbatch_layout, packs

    p, r = cfg.parallel, cfg.rollout
    longest = r.sampling.max_new_tokens + (cfg.data.max_prompt_tokens or p.max_tokens_per_microbatch)
    longest = min(longest, p.max_tokens_per_microbatch)
    plan = microbatch_layout(cfg.model, p, 1).plan([longest] * samples, dp, p.pipeline if p.virtual_pipeline else 1)
    if packs(cfg.model, p):
        attention = "THD with cu_seqlens" if cfg.model.transformer_impl == "transformer_engine" else "a masked row"
        how = f"packed rows of whole samples end to end, attention inside each sample ({attention})"
    else:
        how = "padded rows of one sample each" + (
            ", padded to the step's longest (the virtual pipeline's one shape)" if p.virtual_pipeline else ""
        )
    return (
        f"micro-batches: {how}, at most {p.max_tokens_per_microbatch} tokens each (parallel.packing={p.packing}); "
        f"at worst (every sample {longest} tokens) {len(plan[0])} a data-parallel rank and optimizer step"
    )


def _experts_layout(spec: ModelSpec, p: ParallelConfig, dp: int) -> str:
    """Where a mixture-of-experts model's experts live, in one line."""
    moe = spec.moe
    return (
        f"experts: {moe.num_experts} a layer in {len(moe.sparse_layers)} of {spec.num_layers} layers, "
        f"top-{moe.top_k}; EP {p.expert}: {moe.num_experts // p.expert} whole experts on each rank (expert TP 1), "
        f"their optimizer state sharded over expert data parallel {p.tensor * dp // p.expert} (the rest over DP {dp})"
    )


def _moe_memory(cfg: JobConfig, spec: ModelSpec, dp: int) -> list[str]:
    """The experts' share of a trainer GPU, and the routes a step stores for routing replay."""
    from bapo_megatron.trainer.memory import routing_replay_bytes, trainer_memory

    moe, r = spec.moe, cfg.rollout
    experts = trainer_memory(spec, cfg.model, cfg.parallel, dp, distributed_optimizer=True).experts
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
            f"{slurm.script} places them: {slurm.rollout_nodes} node(s) x {slurm.engines_per_node} server(s), "
            f"{used} of each node's {slurm.gpus_per_node} GPUs{room}; the script passes their URLs to the trainer "
            "(rollout.engines.urls; COLOCATE=1 puts them on the trainer's GPUs instead)"
        ]
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


def _sglang_memory(cfg: JobConfig, spec, gpu_bytes: int, dp: int) -> str:
    from bapo_megatron.engines.sglang_launcher import mem_fraction
    from bapo_megatron.trainer.memory import rollout_mem_fraction, stage_params

    e = cfg.rollout.engines
    # bf16 weights of one server rank: the whole model at TP = the server's, one stage, no vocabulary
    # padding; SGLang splits each expert over its TP ranks, the same bytes as EP = TP whole experts
    weights = stage_params(spec, spec.vocab_size, e.tensor_parallel, 1, 0, expert=e.tensor_parallel) * 2
    try:
        colocated = rollout_mem_fraction(cfg, spec, gpu_bytes, dp) if e.colocate else None
        fraction = mem_fraction(cfg.rollout, colocated)
    except ValueError as err:
        return f"each SGLang server GPU: cannot fit ({err})"
    kv_budget = max(0, int(fraction * gpu_bytes) - weights)
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2 // e.tensor_parallel  # keys+values, bf16
    return (
        f"each SGLang server GPU: mem_fraction_static {fraction:.2f}: weights {weights / GIB:.2f} GiB, "
        f"KV cache {kv_budget / GIB:.2f} GiB = {kv_budget // max(per_token, 1):,} tokens"
    )


def world_size(args: argparse.Namespace, cfg: JobConfig | None = None) -> tuple[int, str | None]:
    """The trainer processes a dry run plans for, and how that number was chosen when no one gave
    it: --world-size, else $WORLD_SIZE (a launcher's), else the Slurm script of this repository
    that runs the config (its trainer nodes x --gpus-per-node), else the smallest world the config's
    parallel sizes need (TP x PP x CP)."""
    if args.world_size:
        return args.world_size, None
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"]), None
    if cfg is None:
        return 1, None
    plan = slurm_plan(args.config) if args.config else None
    if plan is not None:
        how = "runs this config" if plan.default else f"runs it (CONFIG={args.config} sbatch {plan.script})"
        return plan.world_size, (
            f"no --world-size: planned for {plan.world_size} trainer processes, as {plan.script} {how}: "
            f"{plan.train_nodes} trainer node(s) x {plan.gpus_per_node} GPUs, {plan.rollout_nodes} rollout node(s)"
        )
    p = cfg.parallel
    size = p.tensor * p.pipeline * p.context
    if size == 1:
        return 1, None
    return size, (
        f"no --world-size: planned for the smallest world the layout needs, TP {p.tensor} x PP {p.pipeline} x "
        f"CP {p.context} = {size} trainer processes (data parallel 1); --world-size N plans another"
    )


SLURM_CONFIG = re.compile(r"^CONFIG=\$\{CONFIG:-(\S+?)\}", re.M)
SLURM_JOB = re.compile(r"^bapo_gpu_job\s+(\d+)\s+(\d+)\b", re.M)
SLURM_GPUS = re.compile(r"^#SBATCH\s+--gpus-per-node=(\d+)", re.M)
SLURM_NODES = re.compile(r"^#SBATCH\s+--nodes=(\d+)", re.M)


@dataclasses.dataclass(frozen=True)
class SlurmPlan:
    """How a slurm/*.sh script of this checkout runs a config: its `bapo_gpu_job TRAIN_NODES
    ENGINES_PER_NODE ...` line and its #SBATCH header (the nodes beyond the trainer's hold the engines)."""

    script: str
    """slurm/NAME.sh"""
    default: bool
    """The config is the script's default CONFIG (else one beside it, run with CONFIG=...)."""
    train_nodes: int
    engines_per_node: int
    nodes: int
    gpus_per_node: int

    @property
    def world_size(self) -> int:
        return self.train_nodes * self.gpus_per_node

    @property
    def rollout_nodes(self) -> int:
        return self.nodes - self.train_nodes


def slurm_plan(config: str) -> SlurmPlan | None:
    """The slurm/*.sh script in this checkout that runs `config`: the one whose default CONFIG it
    is, else the one whose default CONFIG lies in the same folder (a preset's variants, recipe.yaml
    and long.yaml, run by their preset's script with CONFIG=...); None when none does."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    target = Path(config).resolve()
    found: list[SlurmPlan] = []
    for script in sorted((root / "slurm").glob("*.sh")):
        text = script.read_text()
        default, job = SLURM_CONFIG.search(text), SLURM_JOB.search(text)
        gpus, nodes = SLURM_GPUS.search(text), SLURM_NODES.search(text)
        if not (default and job and gpus and nodes):
            continue
        preset = (root / default.group(1)).resolve()
        if preset == target or preset.parent == target.parent:
            numbers = (int(job.group(1)), int(job.group(2)), int(nodes.group(1)), int(gpus.group(1)))
            found.append(SlurmPlan(f"slurm/{script.name}", preset == target, *numbers))
    return max(found, key=lambda plan: plan.default, default=None)
